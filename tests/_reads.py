"""Host reads per training step on a real run, counted with torch.profiler.

A host read is where a tensor's value reaches Python; on an accelerator each one waits for the device. What a
callback adds is the difference between two runs of the same seeded training, with it and without it
(``added_reads``): no stack walking, and a read the callback causes inside a library (torchmetrics) or inside
Lightning counts as its own. Two kinds are counted, as torch 2.13 behaves:

- ``aten::_local_scalar_dense``: what ``.item()``, ``float()``, ``int()``, ``bool()``, ``torch.is_nonzero`` and
  ``torch.allclose`` come down to, one per call.
- ``Tensor.tolist()`` and ``Tensor.numpy()``, one per call: on the CPU they read host memory without any aten op
  (a stacked ``.tolist()`` is not one ``_local_scalar_dense`` per element), so the profiler alone would not see
  them; on an accelerator the one copy to the host they need is the sync. While counting, each call is marked
  with a ``record_function`` range, and a scalar read inside that range is the same read, not another.

``.cpu()`` is not counted: on the CPU it copies nothing, and its value reaches Python through one of the above.
"""

from __future__ import annotations

import bisect
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.profiler import ProfilerActivity, profile, record_function

T = TypeVar("T")
ReadsByStep = dict[int, Counter[str]]  # trainer.global_step at the batch's start -> reads by kind

SCALAR_READ = "aten::_local_scalar_dense"
_WHOLE_TENSOR_READS = ("tolist", "numpy")
_READ_MARK = "host read: Tensor."
_STEP_MARK = "training batch at step "


class _StepRanges(Callback):
    """Each training batch as one profiler range, from its start to the next batch's start (or the end)."""

    def __init__(self) -> None:
        self._open: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.close()
        self._open = record_function(f"{_STEP_MARK}{trainer.global_step}")
        self._open.__enter__()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def close(self) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


@contextmanager
def _marked_whole_tensor_reads() -> Iterator[None]:
    saved = {name: torch.Tensor.__dict__.get(name) for name in _WHOLE_TENSOR_READS}

    def marked(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            with record_function(_READ_MARK + name):
                return original(tensor, *args, **kwargs)

        return read

    for name in _WHOLE_TENSOR_READS:
        setattr(torch.Tensor, name, marked(name, getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)  # the inherited C method shows through again
            else:
                setattr(torch.Tensor, name, method)


def _containing(intervals: list[tuple[int, int, int, Any]], start: int, end: int, thread: int) -> Any:
    """The label of the interval (sorted, not overlapping on one thread) that holds ``[start, end]``, or None."""
    i = bisect.bisect_right(intervals, start, key=lambda t: t[0]) - 1
    while i >= 0 and intervals[i][2] != thread:
        i -= 1
    if i >= 0 and intervals[i][1] >= end:
        return intervals[i][3]
    return None


def reads_per_step(fit: Callable[[list[Callback]], T]) -> tuple[ReadsByStep, T]:
    """Run ``fit(callbacks)`` under the profiler and count the host reads of each training batch.

    ``fit`` must put the given callbacks first in its trainer's list (they mark the batches); its result is
    handed back. Reads outside any training batch (set-up, the end of the fit) are not counted.
    """
    ranges = _StepRanges()
    with _marked_whole_tensor_reads(), profile(activities=[ProfilerActivity.CPU]) as prof:
        try:
            result = fit([ranges])
        finally:
            ranges.close()
    # The raw events: building the FunctionEvent tree (prof.events()) costs seconds per short fit.
    events = prof.profiler.kineto_results.events()
    steps = sorted((e.start_ns(), e.end_ns(), e.start_thread_id(), int(e.name()[len(_STEP_MARK):]))
                   for e in events if e.name().startswith(_STEP_MARK))
    marks = sorted((e.start_ns(), e.end_ns(), e.start_thread_id(), "Tensor." + e.name()[len(_READ_MARK):])
                   for e in events if e.name().startswith(_READ_MARK))
    reads: ReadsByStep = {step: Counter() for *_, step in steps}
    for start, end, thread, kind in marks:
        step = _containing(steps, start, end, thread)
        if step is not None:
            reads[step][kind] += 1
    for e in events:
        if e.name() != SCALAR_READ:
            continue
        where = (e.start_ns(), e.end_ns(), e.start_thread_id())
        step = _containing(steps, *where)
        if step is not None and _containing(marks, *where) is None:  # inside tolist/numpy: the same read
            reads[step]["_local_scalar_dense"] += 1
    return reads, result


def added_reads(watched: ReadsByStep, bare: ReadsByStep) -> ReadsByStep:
    """Per step, the reads of the ``watched`` run beyond those of the ``bare`` one (the same run without the
    code under test). Runs that differ in their steps, or a step with fewer reads watched than bare, are not
    alike enough to subtract: that is an error, not a count."""
    if watched.keys() != bare.keys():
        raise ValueError(f"the runs trained different steps: {sorted(watched)} against {sorted(bare)}")
    fewer = {step: dict(bare[step] - watched[step]) for step in bare if bare[step] - watched[step]}
    if fewer:
        raise ValueError(f"steps with fewer reads in the watched run than in the bare one: {fewer}")
    return {step: watched[step] - bare[step] for step in watched}
