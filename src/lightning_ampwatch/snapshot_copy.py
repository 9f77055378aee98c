"""A snapshot's host copy off the compute stream (CUDA only).

On CUDA, the ring's copies of the weights and the optimizer state run on a side stream into the ring's pinned host
buffers (allocated once per slot and reused by the snapshots after it), so that the compute stream goes on with the
next forward and backward while they run. What the copy reads must not change under it: those tensors change in the
next optimizer step, so that step waits for the copy's event on the device (``current_stream().wait_event``), never
on the host. Everything else a snapshot copies stays on the compute stream, as before: buffers (the next forward
writes BatchNorm's running statistics), gradients, and the scaler's scale and growth tracker (its update writes them
after a skipped step too, which never calls the optimizer's step). A CPU tensor never comes here: the CPU path is a
plain copy, unchanged.

Not ordered before the copy: a write to the weights outside the optimizer's step before the next one (a callback
that clamps the weights after the step, later in the callback list than AmpWatch). Such a snapshot may hold the
written value.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat, sharding

#: one copier per CUDA device, made on the first snapshot there
_COPIERS: dict[torch.device, "DeviceCopier"] = {}


def _pointer(t: Any) -> int | None:
    """Where a tensor's data starts on its device (a DTensor's local shard's), or None for anything else."""
    if not isinstance(t, Tensor):
        return None
    try:
        return sharding.local(t).data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage (meta, a subclass): not one to copy aside
        return None


def stepped_pointers(optimizers: Sequence[Any]) -> set[int] | None:
    """The data pointers of every tensor the next optimizer step changes in place, and nothing else changes before
    it: the optimizers' parameters and their state. None where an optimizer cannot hold the step back (it takes no
    step pre-hook: DeepSpeed's)."""
    found: set[int] = set()
    for opt in optimizers:
        if not callable(getattr(opt, "register_step_pre_hook", None)):
            return None
        for group in opt.param_groups:
            found.update(p for p in map(_pointer, group["params"]) if p is not None)
        for per in opt.state.values():
            if isinstance(per, dict):
                found.update(p for p in map(_pointer, per.values()) if p is not None)
    return found


def split_for_side_stream(src: Sequence[Tensor], stepped: set[int]) -> tuple[list[int], list[int]]:
    """``(side, compute)``: the indices of ``src`` that only the next optimizer step changes (copied on the side
    stream), and the rest (copied on the compute stream, ordered before anything that follows it)."""
    side: list[int] = []
    compute: list[int] = []
    for i, t in enumerate(src):
        (side if t.device.type == "cuda" and _pointer(t) in stepped else compute).append(i)
    return side, compute


class DeviceCopier:
    """Device-to-host copies on a side stream of one CUDA device, each recorded with an event, and the one wait
    that orders them before the next optimizer step (a one-shot step pre-hook on each optimizer, removed at the
    first step that fires it). ``copy`` launches; nothing here waits on the host but :meth:`finish`, which only a
    replay or a rollback calls (they read the host copies)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = None  # made at the first copy
        self.pending: Any = None  # the event of the latest copy the compute stream has not waited for yet
        self._hooks: list[Any] = []
        self._split_for: tuple[Sequence[Tensor], list[int], list[int]] | None = None
        self.copies = 0  # copies launched on the side stream (for tests and benchmarks)

    def copy(self, dst: list[Tensor], src: list[Tensor], optimizers: Sequence[Any]) -> None:
        """``dst[i].copy_(src[i])`` for every pair, without a host sync: the optimizer-owned tensors on the side
        stream (after everything the compute stream has queued so far), the rest on the compute stream."""
        compute = torch.cuda.current_stream(self.device)
        split = self._split_for
        if split is None or split[0] is not src:  # the ring's copy plan hands the same list while it holds
            stepped = stepped_pointers(optimizers)
            side, rest = split_for_side_stream(src, stepped) if stepped is not None else ([], list(range(len(src))))
            self._split_for = split = (src, side, rest)
        _, side, rest = split
        if rest:
            compat.copy_all([dst[i] for i in rest], [src[i] for i in rest], non_blocking=True)
        if not side:
            return
        self.settle()  # an earlier copy not yet waited for (no step between two snapshots): waited for first
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(compute)  # the copy reads the state the compute stream has made so far
        side_src = [src[i] for i in side]
        with torch.cuda.stream(self.stream):
            compat.copy_all([dst[i] for i in side], side_src, non_blocking=True)
        for t in side_src:  # the allocator keeps their blocks until the side stream is done with them
            t.record_stream(self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        self.pending = event
        self.copies += 1
        self._arm(optimizers)

    def _arm(self, optimizers: Sequence[Any]) -> None:
        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.settle()

        self._hooks = [opt.register_step_pre_hook(before_step) for opt in optimizers]

    def settle(self) -> None:
        """The compute stream waits (on the device) for the latest copy: called before the weights change."""
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()
        event, self.pending = self.pending, None
        if event is not None:
            self._wait(event)

    def _wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def finish(self) -> None:
        """The host waits for the latest copy (a replay or a rollback reads the host copies): not a healthy step's."""
        event = self.pending
        self.settle()
        if event is not None:
            event.synchronize()


def copier(device: torch.device) -> DeviceCopier:
    """The copier of a CUDA device (made on first use)."""
    key = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    found = _COPIERS.get(key)
    if found is None:
        found = _COPIERS[key] = DeviceCopier(key)
    return found


def copy_to_host(dst: list[Tensor], src: list[Tensor], state: Any) -> None:
    """A snapshot's copy into pinned host buffers ``dst`` (``state``: the ring's ``TrainState``): off the compute
    stream on CUDA."""
    copier(state.device).copy(dst, src, state.optimizers)


def settle() -> None:
    """Every device's compute stream waits for its latest copy (before a restore writes the live state)."""
    for c in list(_COPIERS.values()):
        c.settle()


def finish() -> None:
    """The host waits for every copy still running (before the host copies are read)."""
    for c in list(_COPIERS.values()):
        c.finish()
