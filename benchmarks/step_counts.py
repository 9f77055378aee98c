"""Deterministic counts of AmpWatch's own work on each step of a healthy fp16 run: the Python calls its hooks make
(function calls and calls of builtins, counted with ``sys.setprofile``), which load from elsewhere on the machine
cannot change. ``tests/test_step_counts.py`` holds the budget on them; ``overhead.py`` prints the times.

    python benchmarks/step_counts.py                       # the toy, AmpWatch's defaults (snapshot_every="auto")
    python benchmarks/step_counts.py --steps 400 --by-function

A step's count runs over every call made while one of AmpWatch's per-step hooks is on the stack: the callback's
hooks Lightning calls, and the optimizer step hooks the watch registers (found on the optimizer at train start).
A step is "ordinary" when it is neither a log step (``(batch + 1) % log_every_n_steps == 0``) nor a step whose
hooks took a snapshot. The steps before ``SETTLED`` are counted and not judged: the "auto" cadences time them.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, Callable

import lightning.pytorch as pl
from lightning.pytorch.loggers.logger import DummyLogger
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin

#: the budget on an ordinary step (issue 29): at most this many Python calls in the watch's hooks
ORDINARY_CALLS_BUDGET = 25
LOG_EVERY = 50
#: Lightning's per-step callback hooks; those AmpWatch defines are counted
STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
              "on_before_zero_grad", "on_train_batch_end")
KINDS = ("ordinary", "log", "snapshot")
#: the steps counted from: the "auto" cadences decide within the toy's first 100 steps (they time its first
#: snapshots and log steps), from here on every step is one of a long run
SETTLED = 100


@dataclass
class StepCounts:
    """Python calls inside AmpWatch's hooks, per batch index, and what kind of step each was."""

    calls: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    kinds: dict[int, str] = field(default_factory=dict)
    where: dict[int, collections.Counter[str]] = field(default_factory=dict)

    def of_kind(self, kind: str, first: int = 0) -> dict[int, int]:
        """The counts of the steps of ``kind`` from batch ``first`` on."""
        return {b: self.calls.get(b, 0) for b, k in sorted(self.kinds.items()) if k == kind and b >= first}


class _Counter:
    """A ``sys.setprofile`` function that counts the calls made while an entry code object is running."""

    def __init__(self, by_function: bool) -> None:
        self.entries: set[CodeType] = set()
        self.batch = -1
        self.counts = StepCounts()
        self.by_function = by_function
        self._inside: FrameType | None = None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        inside = self._inside
        if inside is None:
            if event == "call" and frame.f_code in self.entries:
                self._inside = inside = frame
            else:
                return
        if event == "call" or event == "c_call":
            self.counts.calls[self.batch] += 1
            if self.by_function:
                name = (f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}" if event == "call"
                        else f"<builtin {getattr(arg, '__qualname__', arg)}>")
                self.counts.where.setdefault(self.batch, collections.Counter())[name] += 1
        elif event == "return" and frame is inside:
            self._inside = None


def _ampwatch_code(fn: Any) -> CodeType | None:
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    return code if code is not None and "lightning_ampwatch" in code.co_filename else None


def count_steps(steps: int = 200, seed: int = 0, log_every: int = LOG_EVERY, by_function: bool = False,
                make_watch: Callable[[], AmpWatch] = lambda: AmpWatch(verbose=False)) -> StepCounts:
    """One healthy run of the toy (``scenarios.Regressor``, true fp16 with a default GradScaler on the CPU) of
    ``steps`` steps under ``make_watch()``; every step's calls counted."""
    watch = make_watch()
    counter = _Counter(by_function)
    for name in STEP_HOOKS:  # the callback's own hooks (a subclass's too, wherever it is written)
        hook = getattr(type(watch), name)
        if hook is not getattr(pl.Callback, name) and hasattr(hook, "__code__"):
            counter.entries.add(hook.__code__)

    class Marker(pl.Callback):
        """First in the callbacks: dates each batch, finds the optimizer hooks, tells snapshot steps."""

        newest = -1

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            for opt in trainer.optimizers:  # the optimizer step hooks the watch registered at fit start
                for hooks in (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks):
                    for hook in hooks.values():
                        code = _ampwatch_code(hook)
                        if code is not None:
                            counter.entries.add(code)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            counter.batch = batch_idx
            counts.kinds[batch_idx] = "log" if (batch_idx + 1) % log_every == 0 else "ordinary"

    class After(pl.Callback):
        """Last in the callbacks: a step whose hooks took a snapshot is a snapshot step."""

        newest = -1

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            control = watch.watcher.trajectory
            held = control.ring.snapshots if control is not None else ()
            newest = held[-1].step if held else -1
            if newest != self.newest:
                self.newest = newest
                counts.kinds[counter.batch] = "snapshot"

    counts = counter.counts
    pl.seed_everything(seed, verbose=False)
    data = DataLoader(regression_data(n=32 * 1024, seed=seed), batch_size=32, shuffle=False)
    with tempfile.TemporaryDirectory(prefix="ampwatch-counts-") as root:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=[true_fp16_plugin()],
                             logger=DummyLogger(), default_root_dir=root, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=log_every,
                             callbacks=[Marker(), watch, After()])
        previous = sys.getprofile()
        sys.setprofile(counter)
        try:
            trainer.fit(Regressor(), data)
        finally:
            sys.setprofile(previous)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="steps of the run (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--by-function", action="store_true", help="also the calls made most, per kind of step")
    parser.add_argument("--top", type=int, default=12, help="with --by-function: entries shown per kind")
    args = parser.parse_args(argv)
    if args.steps < SETTLED + LOG_EVERY:
        parser.error(f"--steps={args.steps} is not valid; use at least {SETTLED + LOG_EVERY} (the cadences' "
                     "choice, then a log interval)")
    counts = count_steps(args.steps, args.seed, by_function=args.by_function)
    print(f"Python calls in AmpWatch's hooks per step (toy, {args.steps} steps, log every {LOG_EVERY}; from step "
          f"{SETTLED} on, once the cadences have decided):")
    for kind in KINDS:
        values = list(counts.of_kind(kind, first=SETTLED).values())
        if not values:
            continue
        print(f"  {kind:9} {len(values):4d} steps: median {statistics.median(values):.0f}, max {max(values)}"
              + (f" (budget {ORDINARY_CALLS_BUDGET})" if kind == "ordinary" else ""))
        if args.by_function:
            where: collections.Counter[str] = collections.Counter()
            for b in counts.of_kind(kind, first=SETTLED):
                where.update(counts.where.get(b, {}))
            for name, n in where.most_common(args.top):
                print(f"      {n / len(values):8.2f}  {name}")
    ordinary = list(counts.of_kind("ordinary", first=SETTLED).values())
    return 0 if ordinary and max(ordinary) <= ORDINARY_CALLS_BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
