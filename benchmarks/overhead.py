"""How much does ``AmpWatch()`` cost a healthy fp16 run? Set beside ``detect_anomaly`` and ``SpikeDetection``.

Run it from the repository root, on a quiet machine (other load inflates every wall-clock number)::

    python benchmarks/overhead.py             # the toy and the mlp workloads (a few minutes on 2 CPU cores)
    python benchmarks/overhead.py --quick     # a smoke run: the toy, few pairs, rarely a verdict
    python benchmarks/overhead.py --pairs 300 --strict  # more pairs; exit 1 if over budget, 2 if inconclusive
    python benchmarks/overhead.py --workloads mlp --verdict-seconds 1200 --verdicts on  # a verdict on the slow step
    python benchmarks/overhead.py --model mypkg.train:Net   # your own LightningModule (its own train_dataloader)

Every run trains with real float16 autocast and a real default GradScaler on the CPU (``--device cuda`` on a
GPU), from the same seed, one torch thread, with a logger that writes nothing (``DummyLogger``), so that every
log step does all its work: a healthy run, whose scale settles in the warm-up, so this is the price a user pays
on every step while nothing is wrong. The workloads (``--workloads``): ``toy``, the small MLP of
``scenarios.Regressor`` (about 1 ms a step), and ``mlp``, 3 Linear layers of width 256, batch 64, AdamW (several
ms a step); ``--model`` adds yours.

The budget (decided in issue 29):

- a step of ``RATIO_STEP_MS`` (5 ms) or more: watched/bare at most ``BUDGET`` (1.01), judged from on/off blocks of
  one run, with the verdict "within the budget" only when the 95% interval lies below it on both clocks;
- a shorter step (the toy's): absolute figures, an ordinary step's hooks at most 8 us, a log step's extra at most
  400 us (a hand-over step's too: the same bookkeeping between log steps), the snapshot's share at ``"auto"`` at most 0.5% of a bare step; its ratio is printed for information.
  The Python calls per step, which no load can change, are counted by ``benchmarks/step_counts.py`` (at most 25
  on an ordinary step, held by ``tests/test_step_counts.py``).

What it prints, from the least to the most robust on a busy machine:

1. A table of separate runs of the toy, interleaved (round 1: A B C D, round 2: B C D A, ...), each run's
   per-step time over the bare run's in the same round, by wall clock and by the process's CPU time. Separate
   runs on a shared 2-core machine drift by tens of percent, so the table compares configurations; no verdict.
2. Per workload, the on/off blocks: one run in which AmpWatch is switched on and off every 50 steps (Lightning's
   logging interval, so each block holds one log step), in pairs ordered on/off, off/on, ...; once with its
   defaults (snapshots on) and once with ``snapshot_every=0`` (snapshots off). Each pair gives a ratio of
   neighbouring blocks, which drift barely touches. The median ratio comes with its quartiles and a 95%
   confidence interval (order statistics, no assumption about the noise). A third run, the null run, has both
   sides of every pair bare: how far this machine alone spreads the ratios. Each run takes about 15 s of blocks
   (``--verdict-seconds``; ``--pairs`` fixes the count instead); on a several-millisecond step that leaves the
   interval about three points wide, and a verdict against a 1% budget needs about ten minutes, which
   ``--verdicts on`` spends on the defaults' run alone.
3. Per workload, AmpWatch's hooks timed inside the training loop: their own time per healthy step, an ordinary
   step's, a log step's extra, a hand-over step's extra (a step between two log steps where the watch takes in the
   healthy steps it held back, at most 64), and the snapshot's per-step share (a snapshot step's hooks over an
   ordinary step's, divided by the interval in force, as a share of a bare step). Load from elsewhere inflates a median
   call far less than a whole step: the robust numbers. With ``snapshot_every="auto"`` nothing is timed until
   the cadence has chosen its interval, so that its measure of the first snapshots sees a plain run.
4. Host reads: the reads AmpWatch adds to each step (``aten::_local_scalar_dense`` and whole-tensor
   ``tolist``/``numpy``, counted with torch.profiler by ``tests/_reads.py``), per log step and per other step.

The last block of the output sums it all up in a few lines that can be quoted as they are.
``benchmarks/FINDINGS.md`` says where the time goes. What one snapshot costs per model size and strategy:
``benchmarks/snapshot_cost.py``.

To compare another set-up (say, AmpWatch with probes armed), add an entry to ``CONFIGURATIONS``: a name mapped
to a function of the run's directory that returns a ``Setup`` (callbacks and extra ``Trainer`` arguments).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.spike import SpikeDetection
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.plugins import MixedPrecision
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.steps.cadence import MAX_INTERVAL
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin
from lightning_ampwatch.signals import StepTaken
from lightning_ampwatch import steps as ampwatch_steps

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the one host-read counter
from _reads import added_reads, reads_per_step  # noqa: E402

BATCH_SIZE = 32
LOG_EVERY_N_STEPS = 50  # Lightning's default, set explicitly: AmpWatch logs its metrics at these steps
DATASET_ROWS = 32 * 1024  # the same data whatever --steps says; longer runs go round it again
SETTLE_STEPS = 700  # at most this many steps for the "auto" cadence to choose, before anything is timed
#: at most this many steps for the hooks' timer to wait for the "auto" cadence's interval to be final (checked against
#: the steady run's snapshot steps, again at each longer interval it chooses: ``SnapshotCadence.observe_steady``)
FINAL_STEPS = 3000
BUDGET = 1.01  # AmpWatch() on a healthy step of RATIO_STEP_MS or more: at most 1% slower than the bare run
CONFIDENCE = 0.95  # of the interval around the median pair ratio that the verdict rests on
#: With no ``--pairs``: as many on/off pairs per verdict as take about this many seconds of blocks at the workload's
#: step (the watched run's median step, as the hooks' timer saw it), at least ``MIN_PAIRS`` and at most ``MAX_PAIRS``.
#: The interval of the median narrows as one over the square root of the pairs: on the toy's sub-millisecond step
#: thirty pairs left it about 4 points wide, two hundred about 1.5.
PAIR_SECONDS = 15.0
MIN_PAIRS, MAX_PAIRS = 30, 300
#: The paired runs a verdict block can hold: ``on`` (AmpWatch's defaults against bare: the verdict, always made),
#: ``off`` (snapshots off against bare) and ``null`` (both sides bare: the machine's own spread). ``--verdicts``
#: picks among them, so that a long verdict on a slow step (``--verdict-seconds``) need not be paid three times.
VERDICT_RUNS = ("on", "off", "null")
DEFAULT_VERDICTS = ("on", "off", "null")
#: The step from which the ratio is judged (ms); a shorter step is judged by the absolute budgets below.
RATIO_STEP_MS = 5.0
ORDINARY_BUDGET_US = 8.0  # an ordinary step's hooks, their own time
LOG_STEP_BUDGET_US = 400.0  # what a log step adds to them
SNAPSHOT_SHARE_BUDGET = 0.005  # the snapshot's per-step share at "auto", of a bare step
BASELINE = "bare"
WATCHED = "AmpWatch()"


@dataclass
class Setup:
    """What one configuration adds to the bare run: callbacks, and ``Trainer`` arguments."""

    callbacks: list[pl.Callback] = field(default_factory=list)
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)


def _spike_detection(root_dir: str) -> Setup:
    # Lightning's defaults (window 10, rtol 2.0); the file it would write on a spike goes to the run's directory.
    return Setup([SpikeDetection(exclude_batches_path=f"{root_dir}/skip_batches.json")])


# The extension point: a name mapped to a function of the run's directory that builds a fresh Setup.
# Runs go in this order within a round (rotated from round to round); BASELINE must stay.
CONFIGURATIONS: dict[str, Callable[[str], Setup]] = {
    BASELINE: lambda root_dir: Setup(),
    WATCHED: lambda root_dir: Setup([AmpWatch(verbose=False)]),
    "detect_anomaly=True": lambda root_dir: Setup(trainer_kwargs={"detect_anomaly": True}),
    "SpikeDetection()": _spike_detection,
}


def healthy_trainer(root_dir: str, max_steps: int, callbacks: list[pl.Callback],
                    log_every_n_steps: int = LOG_EVERY_N_STEPS, **overrides: Any) -> pl.Trainer:
    """The benchmark's trainer: true fp16 (CPU unless ``--device cuda``), a logger that writes nothing, no
    checkpoints or progress bar."""
    kwargs: dict[str, Any] = dict(
        accelerator=DEVICE["type"], devices=1, max_steps=max_steps, plugins=[fp16_plugin()], logger=DummyLogger(),
        default_root_dir=root_dir, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=log_every_n_steps, callbacks=callbacks,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


DEVICE = {"type": "cpu"}  # --device: where every run trains (set once in main)


def fp16_plugin(**scaler_kwargs: Any) -> MixedPrecision:
    """Real float16 autocast with a real default GradScaler, on the benchmark's device."""
    if DEVICE["type"] == "cpu":
        return true_fp16_plugin(**scaler_kwargs)
    return MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", **scaler_kwargs))


def healthy_data(seed: int) -> DataLoader:
    return DataLoader(regression_data(n=DATASET_ROWS, seed=seed), batch_size=BATCH_SIZE, shuffle=False)


# ---------------------------------------------------------------- workloads: what a healthy step trains


class WideMLP(pl.LightningModule):
    """The several-millisecond step: ``depth`` Linear layers of width ``width`` (ReLU between), AdamW."""

    def __init__(self, width: int = 256, depth: int = 3, lr: float = 1e-3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()] if i < depth - 1 else [nn.Linear(width, width)]
        self.net = nn.Sequential(*layers)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def wide_data(seed: int, width: int = 256, batch: int = 64, rows: int = 64 * 128) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    w = torch.randn(width, width, generator=g) / width**0.5
    y = torch.tanh(x @ w) + 0.1 * torch.randn(rows, width, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


@dataclass(frozen=True)
class Workload:
    """A model and its data: what every configuration trains."""

    name: str
    describe: str
    module: Callable[[], pl.LightningModule]
    data: Callable[[int], DataLoader] | None = None  # None: the module's own ``train_dataloader()``

    def fit(self, trainer: pl.Trainer, seed: int) -> None:
        module = self.module()
        if self.data is None:
            trainer.fit(module)
        else:
            trainer.fit(module, self.data(seed))


WORKLOADS: dict[str, Workload] = {
    "toy": Workload("toy", "scenarios.Regressor: 16-32-16-1 MLP, batch 32, SGD (about 1 ms a step)",
                    Regressor, healthy_data),
    "mlp": Workload("mlp", "3 Linear layers of width 256, batch 64, AdamW (several ms a step)",
                    WideMLP, wide_data),
}
TOY = WORKLOADS["toy"]


def user_workload(spec: str) -> Workload:
    """``--model package.module:attr``: a LightningModule, its class, or a function that returns one. The module
    brings its own data (``train_dataloader``); an instance is deep-copied for every run, so each starts alike."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: use the form package.module:attr (attr: a LightningModule, its class, "
                         "or a function of no arguments that returns one)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # python benchmarks/overhead.py --model mymodel:Net, run from the user's tree
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, pl.LightningModule):
        instance = obj
        factory: Callable[[], pl.LightningModule] = lambda: copy.deepcopy(instance)  # noqa: E731
    elif callable(obj):
        def factory() -> pl.LightningModule:
            made = obj()
            if not isinstance(made, pl.LightningModule):
                raise TypeError(f"--model {spec!r} returned a {type(made).__name__}, not a LightningModule")
            return made
    else:
        raise TypeError(f"--model {spec!r} is a {type(obj).__name__}: expected a LightningModule, its class, or a "
                        "function that returns one")
    return Workload(spec, "your LightningModule, on its own train_dataloader()", factory, None)


class StepClock(pl.Callback):
    """Stamps the start of every training batch and counts the optimizer steps really taken.

    The same object, doing the same thing, in every configuration. GradScaler calls the optimizer's ``step``
    only when nothing overflowed, so an optimizer post-hook counts the steps that were not skipped.
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []  # wall clock
        self.cpu_stamps: list[float] = []  # CPU time of this process: what load from elsewhere barely touches
        self.taken_before: list[int] = []  # optimizer steps taken before each batch began
        self.taken = 0
        self._handle: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._handle = trainer.optimizers[0].register_step_post_hook(self._count)

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.taken += 1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        self.taken_before.append(self.taken)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._handle.remove()


@dataclass
class RunResult:
    """One run's figures."""

    seconds_per_step: float  # wall clock
    cpu_seconds_per_step: float  # CPU time
    skipped: int  # optimizer steps the GradScaler threw away inside the measured window (healthy: 0)


def train_once(name: str, steps: int, warmup: int, seed: int, root_dir: str,
               instrument: Callable[[Setup, StepClock], None] | None = None, workload: Workload = TOY,
               setup: Setup | None = None) -> RunResult:
    """One training with configuration ``name``; the per-step time over ``steps`` full iterations after warm-up."""
    setup = setup if setup is not None else CONFIGURATIONS[name](root_dir)
    clock = StepClock()
    if instrument is not None:
        instrument(setup, clock)
    total_steps = warmup + steps + 1  # the stamp of batch ``warmup + steps`` closes the window
    pl.seed_everything(seed, verbose=False)
    trainer = healthy_trainer(root_dir, total_steps, [clock, *setup.callbacks], **setup.trainer_kwargs)
    gc.collect()
    workload.fit(trainer, seed)
    if len(clock.stamps) < total_steps:
        raise RuntimeError(f"configuration {name!r} stopped after {len(clock.stamps)} batches of {total_steps}; "
                           "a benchmark run must train to the end (did a callback stop it?)")
    start, end = warmup, warmup + steps
    return RunResult(per_step_time(clock.stamps[start: end + 1], LOG_EVERY_N_STEPS),
                     per_step_time(clock.cpu_stamps[start: end + 1], LOG_EVERY_N_STEPS),
                     steps - (clock.taken_before[end] - clock.taken_before[start]))


def per_step_time(stamps: Sequence[float], block: int) -> float:
    """The fastest of consecutive blocks of ``block`` steps, as time per step.

    A block as long as the logging interval holds exactly one log step, so periodic costs are counted in full.
    Load from elsewhere on the machine only ever adds time, so (as ``timeit`` does) the fastest block is the
    best estimate of what the configuration itself costs.
    """
    steps = len(stamps) - 1
    if steps < 2 * block:
        return (stamps[-1] - stamps[0]) / steps
    return min((stamps[i + block] - stamps[i]) / block for i in range(0, steps - block + 1, block))


def measure(steps: int, rounds: int, warmup: int, seed: int, names: Sequence[str],
            console: Console) -> dict[str, list[RunResult]]:
    """Every configuration once per round, interleaved, the order rotated each round."""
    results: dict[str, list[RunResult]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="ampwatch-bench-") as root:
        for r in range(rounds):
            order = list(names[r % len(names):]) + list(names[: r % len(names)])
            for name in order:
                results[name].append(train_once(name, steps, warmup, seed, root))
            console.print(f"[dim]round {r + 1}/{rounds} done[/dim]")
    return results


def ratios(results: dict[str, list[RunResult]], cpu: bool = False) -> dict[str, list[float]]:
    """Per round: each configuration's per-step time over the bare run's in the same round."""

    def per_step(r: RunResult) -> float:
        return r.cpu_seconds_per_step if cpu else r.seconds_per_step

    base = [per_step(r) for r in results[BASELINE]]
    return {name: [per_step(r) / b for r, b in zip(runs, base)] for name, runs in results.items()}


def print_table(results: dict[str, list[RunResult]], steps: int, rounds: int, console: Console) -> None:
    """The comparison of separate runs (no verdict: they drift with the machine)."""
    wall, cpu = ratios(results), ratios(results, cpu=True)
    table = Table(title=f"Per-step time against the bare run ({rounds} rounds x {steps} steps, true fp16 on CPU)")
    table.add_column("configuration", no_wrap=True)
    table.add_column("ms/step", justify="right")  # median over rounds, wall clock
    table.add_column("ratio", justify="right")  # wall clock, median over rounds
    table.add_column("min..max", justify="right")
    table.add_column("CPU ratio", justify="right")  # CPU time, median over rounds
    table.add_column("best/best", justify="right")  # fastest run over the bare run's fastest: least disturbed
    table.add_column("skipped", justify="right")
    best_bare = min(x.seconds_per_step for x in results[BASELINE])
    for name, runs in results.items():
        ms = statistics.median(x.seconds_per_step for x in runs) * 1e3
        best = min(x.seconds_per_step for x in runs) / best_bare
        table.add_row(name, f"{ms:.3f}",
                      f"{statistics.median(wall[name]):.3f}", f"{min(wall[name]):.3f}..{max(wall[name]):.3f}",
                      f"{statistics.median(cpu[name]):.3f}", f"{best:.3f}", str(sum(x.skipped for x in runs)))
    console.print(table)
    if WATCHED in wall:
        console.print(f"{WATCHED}: median ratio {statistics.median(wall[WATCHED]):.3f} (wall clock), "
                      f"{statistics.median(cpu[WATCHED]):.3f} (CPU time) over separate runs; no verdict from these, "
                      "which drift with the machine: the verdict compares neighbouring blocks of one run.")


# ---------------------------------------------------------------- the verdict: paired blocks in one run


class BlockToggle(pl.Callback):
    """Switches one AmpWatch on and off every ``block`` steps within a single run, timing each block.

    Neighbouring blocks of one run see the same machine, so each on/off pair gives a ratio that drift barely
    touches; the order inside a pair alternates (on/off, off/on, ...) so that neither side always runs first.
    "Off" is AmpWatch absent: out of the trainer's callbacks (so Lightning's dispatch to its hooks is counted as
    its cost), its optimizer and clipping hooks removed; switching on again re-reads the scaler (as at train start), so it watches a healthy run correctly,
    and keeps its snapshot ring, whose host buffers are reused as in a long run (not allocated afresh per block).
    A block is timed from after its switch to before the next one: the switching itself is not AmpWatch's cost.

    With ``snapshot_every="auto"`` the watch stays on, and no block is timed, until the cadence has chosen the
    interval (:func:`cadence_settled`): it times the first snapshots against the steps between them, and blocks
    switched off among those steps stretched its spans over steps it did not watch (and put its decision at a
    step where the watch was off); at most ``SETTLE_STEPS`` steps. ``settled_at``: the step the first block starts
    at. ``blocks``: once that many blocks are timed, the run is asked to stop.
    """

    def __init__(self, watch: Any, block: int, blocks: int | None = None, null: bool = False,
                 switch: Callable[[Any, pl.Trainer, pl.LightningModule, bool], None] | None = None,
                 settled: Callable[[Any], bool] | None = None) -> None:
        self.watch, self.block, self.blocks = watch, block, blocks
        self.null = null  # the null run: the "on" blocks are switched off too (both sides of each pair bare)
        # how the watch is switched, and whether its cadences have chosen: AmpWatch's (switch_watch,
        # cadence_settled, unless told otherwise)
        self._switch = switch if switch is not None else switch_watch
        self._settled = settled if settled is not None else cadence_settled
        self.steps = 0
        self.settled_at: int | None = None
        self.starts: list[tuple[float, float]] = []  # per block: (wall clock, CPU time) after its switch
        self.ends: list[tuple[float, float]] = []  # per block: the same before the next block's switch
        self.on: list[bool] = []  # per block: was AmpWatch on
        #: Python's garbage collections during the timed blocks, by side (on, off): how many, and the seconds they
        #: took. AmpWatch's hooks time none of them: a collection runs wherever an allocation crosses the threshold,
        #: mostly in Lightning's and torch's code, but the objects a watched step keeps bring it on sooner.
        self.gc_runs = {True: 0, False: 0}
        self.gc_s = {True: 0.0, False: 0.0}
        self._gc_start: float | None = None

    def _set(self, trainer: pl.Trainer, pl_module: pl.LightningModule, on: bool) -> None:
        self._switch(self.watch, trainer, pl_module, on and not self.null)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step, self.steps = self.steps, self.steps + 1
        if self.settled_at is None:
            if step < SETTLE_STEPS and not self._settled(self.watch):
                return  # (a run that stays unsettled that long, with skips say, is timed as it is)
            self.settled_at = step
        step -= self.settled_at
        if step % self.block:
            return
        if self.starts:
            self.ends.append((time.perf_counter(), time.process_time()))
            if self.blocks is not None and len(self.ends) >= self.blocks:
                trainer.should_stop = True  # every block timed: the run ends after this batch
        pair, second = divmod(step // self.block, 2)
        on = (second == 0) if pair % 2 == 0 else (second == 1)  # on/off, then off/on, ...
        self._set(trainer, pl_module, on)
        self.on.append(on)
        self.starts.append((time.perf_counter(), time.process_time()))

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """A ``gc.callbacks`` entry: counts and times each collection in a timed block, for the block's side."""
        if not self.on or len(self.ends) >= len(self.starts) or (self.blocks is not None
                                                                 and len(self.ends) >= self.blocks):
            return  # not inside a timed block (the run's last, begun as it stops, is never timed)
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            side = self.on[-1]
            self.gc_runs[side] += 1
            self.gc_s[side] += time.perf_counter() - self._gc_start
            self._gc_start = None

    def pair_ratios(self, skip_blocks: int, clock: int) -> list[float]:
        """Watched block time over its neighbour's, per pair; ``clock`` 0 is the wall clock, 1 CPU time."""
        times = [(end[clock] - start[clock], on) for start, end, on in zip(self.starts, self.ends, self.on)]
        out = []
        for i in range(skip_blocks - skip_blocks % 2, len(times) - 1, 2):
            (t1, on1), (t2, _) = times[i], times[i + 1]
            watched, bare = (t1, t2) if on1 else (t2, t1)
            out.append(watched / bare)
        return out


@dataclass
class PairedRatios:
    """The per-pair ratios of one on/off run, by wall clock and by CPU time."""

    wall: list[float]
    cpu: list[float]
    bare_step_s: float = float("nan")  # the median off block's time per step (wall clock)
    bare_cpu_step_s: float = float("nan")  # the same by the process's CPU time, which load from elsewhere barely moves
    #: garbage collections per 1000 steps and their time per step (seconds), in the on blocks and in the off blocks
    gc_per_1000: tuple[float, float] = (float("nan"), float("nan"))
    gc_s_per_step: tuple[float, float] = (float("nan"), float("nan"))


def switch_watch(watch: AmpWatch, trainer: pl.Trainer, pl_module: pl.LightningModule, on: bool) -> None:
    """AmpWatch off (out of the trainer's callbacks, its watcher's calls returning at once, its optimizer and clipping
    hooks removed) or on again (back in the callbacks, hooks back, the scaler re-read, the LRs re-read; the snapshot
    ring and its buffers kept). The toggle must come before it in the callbacks (it is appended when switched on). The benchmark's only
    reach into the watcher's insides (with :func:`watch_snapshots`): where they move, these functions follow."""
    watcher = watch.watcher
    ledger, host = watcher.ledger, watcher.host
    assert ledger is not None and host is not None
    callbacks = trainer.callbacks
    if on and watcher.disabled:
        watcher.disabled = False
        watcher._attach_guards()
        ledger.start(host, watcher.route.judge_every)
        if watch not in callbacks:
            callbacks.append(watch)
    elif not on and not watcher.disabled:
        watcher.disabled = True
        ledger.taken.detach()
        watcher.guards.detach()
        # out of the trainer's callbacks too: Lightning's dispatch to a callback's hooks (a profiler context and a
        # call per hook, per step) is a cost of adding it, which a bare run does not pay
        if watch in callbacks:
            callbacks.remove(watch)


def cadence_settled(watch: AmpWatch) -> bool:
    """Whether the snapshot interval is settled: chosen by the ``"auto"`` cadence (which may lengthen it once more,
    after its first snapshot steps of the steady run: the window holds snapshots at the interval in force at its
    end), or fixed (a number, snapshots
    off, no trajectory control). Before the fit starts (no control yet): not settled."""
    watcher = watch.watcher
    if watcher.ledger is None:
        return False
    control = watcher.trajectory
    cadence = getattr(control, "cadence", None)
    snapshots = cadence is None or cadence.decided or not control.ring.enabled
    log_cadence = watcher.route.log_cadence
    return snapshots and (log_cadence is None or log_cadence.decided)


def interval_final(watch: AmpWatch) -> bool:
    """:func:`cadence_settled`, and the ``"auto"`` interval checked against the steady run's snapshot steps: the
    snapshot steps the hooks' timer sees are then at the interval of the rest of a run."""
    cadence = getattr(watch.watcher.trajectory, "cadence", None)
    return cadence_settled(watch) and (cadence is None or cadence.checked or not watch.watcher.trajectory.ring.enabled)


def judge_interval(watch: AmpWatch) -> int:
    """The steps between two log steps that do the log step's work: the framework's log interval, or the longer one
    the log cadence chose (the other log steps log the metrics only)."""
    return int(watch.watcher.route.judge_every or LOG_EVERY_N_STEPS)


def watch_snapshots(watch: AmpWatch) -> tuple[int, list[tuple[int, int]]]:
    """The snapshot interval in force and the snapshots held, as ``(step, bytes)``; ``(0, [])`` when off."""
    ring = getattr(watch.watcher.trajectory, "ring", None)
    if ring is None or not ring.enabled:
        return 0, []
    return int(ring.every), [(s.step, s.nbytes) for s in ring.snapshots]


def paired_blocks(pairs: int, seed: int, block: int = LOG_EVERY_N_STEPS, workload: Workload = TOY,
                  make_watch: Callable[[], AmpWatch] = lambda: AmpWatch(verbose=False),
                  null: bool = False) -> PairedRatios:
    """AmpWatch on against off in alternating blocks of one healthy run; also the bare blocks' time per step.
    ``null``: the same run with AmpWatch off in every block after the settling (a bare/bare run: how far the pair
    ratios of this machine spread when nothing differs between the two sides)."""
    warm_blocks = 2
    watch = make_watch()
    toggle = BlockToggle(watch, block, 2 * pairs + warm_blocks, null=null)
    # the cadence's choice first (about 80 steps of a healthy run), then the blocks; the toggle stops the run
    total = (2 * pairs + warm_blocks) * block + 1 + SETTLE_STEPS
    pl.seed_everything(seed, verbose=False)
    with tempfile.TemporaryDirectory(prefix="ampwatch-pairs-") as root:
        trainer = healthy_trainer(root, total, [toggle, watch], log_every_n_steps=block)
        gc.collect()
        gc.callbacks.append(toggle.on_gc)
        try:
            workload.fit(trainer, seed)
        finally:
            gc.callbacks.remove(toggle.on_gc)
    off = [(end[0] - start[0]) / block for start, end, on in zip(toggle.starts, toggle.ends, toggle.on)
           if not on][warm_blocks // 2:]
    off_cpu = [(end[1] - start[1]) / block for start, end, on in zip(toggle.starts, toggle.ends, toggle.on)
               if not on][warm_blocks // 2:]
    timed = {side: block * sum(on == side for on in toggle.on[: len(toggle.ends)]) for side in (True, False)}
    per_1000 = tuple(1000 * toggle.gc_runs[side] / timed[side] if timed[side] else float("nan")
                     for side in (True, False))
    per_step = tuple(toggle.gc_s[side] / timed[side] if timed[side] else float("nan") for side in (True, False))
    return PairedRatios(toggle.pair_ratios(warm_blocks, 0), toggle.pair_ratios(warm_blocks, 1),
                        statistics.median(off) if off else float("nan"),
                        statistics.median(off_cpu) if off_cpu else float("nan"),
                        per_1000, per_step)  # type: ignore[arg-type]


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free confidence interval for the median: the k-th smallest and k-th largest value, with k
    the largest for which a Binomial(n, 1/2) falls below k with probability at most (1 - confidence) / 2.
    None when there are too few values for any such interval (fewer than 6 at 95%)."""
    n, tail = len(values), (1 - confidence) / 2
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def verdict(intervals: Sequence[tuple[float, float] | None]) -> str:
    """What the intervals (one per clock) support about the budget, and nothing more."""
    known = [ci for ci in intervals if ci is not None]
    if len(known) < len(intervals):
        return "inconclusive (too few pairs for a confidence interval)"
    if all(high <= BUDGET for _, high in known):
        return "within the budget"
    if any(low > BUDGET for low, _ in known):
        return "over the budget"
    return "inconclusive on this machine (spread too wide)"


def describe_ratios(values: Sequence[float]) -> str:
    """Median, its confidence interval and the quartiles of a list of ratios, in one phrase."""
    median = statistics.median(values)
    ci = median_interval(values)
    interval = f"{CONFIDENCE:.0%} CI {ci[0]:.3f}..{ci[1]:.3f}" if ci else f"no {CONFIDENCE:.0%} CI"
    quartiles = statistics.quantiles(values, n=4) if len(values) >= 2 else [median, median, median]
    return f"median {median:.3f}, {interval}, quartiles {quartiles[0]:.3f}..{quartiles[-1]:.3f}"


# ---------------------------------------------------------------- host reads per step

READS_LOG_EVERY = 10  # a shorter interval than the timing's: more log steps in a short profiled run
READS_STEPS = 4 * READS_LOG_EVERY + 1
# A scale these gradients never overflow and no growth inside the run: not one skipped step from the first on
# (a skipped step is an anomaly, and AmpWatch reads on anomalies by design).
READS_SCALER = {"init_scale": 2.0**10, "growth_interval": 1000}


@dataclass
class HostReads:
    """The reads AmpWatch adds: per log step (each one) and in total over the other steps (step 0 left out)."""

    log_steps: list[Counter[str]]
    other_steps: int
    other_total: Counter[str]


def host_reads(seed: int) -> HostReads:
    """The same seeded healthy run with and without AmpWatch under torch.profiler; the difference, step by step.

    Step 0 is left out: once per fit AmpWatch reads the first loss (its loss level and loss-graph check). The watched
    run takes the accelerator's path (``steps.losses.HOST_TAPE_DEVICES`` emptied, as the read-count tests do): on the CPU
    each step's loss is taken as a float at once, an ``item()`` that waits for no device, which is why it is done."""

    def fit(callbacks: list[pl.Callback]) -> Callable[[list[pl.Callback]], None]:
        def run(marks: list[pl.Callback]) -> None:
            pl.seed_everything(seed, verbose=False)
            with tempfile.TemporaryDirectory(prefix="ampwatch-reads-") as root:
                trainer = healthy_trainer(root, READS_STEPS, [*marks, *callbacks], READS_LOG_EVERY,
                                          plugins=[true_fp16_plugin(**READS_SCALER)])
                trainer.fit(Regressor(), healthy_data(seed))
        return run

    host_tape = ampwatch_steps.losses.HOST_TAPE_DEVICES
    ampwatch_steps.losses.HOST_TAPE_DEVICES = frozenset()
    try:
        watched, _ = reads_per_step(fit([AmpWatch(verbose=False)]))
    finally:
        ampwatch_steps.losses.HOST_TAPE_DEVICES = host_tape
    bare, _ = reads_per_step(fit([]))
    added = added_reads(watched, bare)
    log_steps = [added[s] for s in sorted(added) if s >= 1 and (s + 1) % READS_LOG_EVERY == 0]
    others = [added[s] for s in sorted(added) if s >= 1 and (s + 1) % READS_LOG_EVERY]
    return HostReads(log_steps, len(others), sum(others, Counter()))


def describe_reads(reads: HostReads) -> str:
    per_log = sorted({sum(c.values()) for c in reads.log_steps})
    kinds = sum(reads.log_steps, Counter())
    mix = ", ".join(f"{count / len(reads.log_steps):g} {kind}" for kind, count in sorted(kinds.items()))
    log_part = f"{per_log[0]}" if len(per_log) == 1 else f"{per_log[0]}..{per_log[-1]}"
    return (f"{log_part} per log step ({mix or 'none'}), "
            f"{sum(reads.other_total.values())} in {reads.other_steps} other steps")


# ---------------------------------------------------------------- where AmpWatch's time goes

# Lightning's hooks that run on every training step; those AmpWatch overrides are the ones timed.
PER_STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                  "on_before_zero_grad", "on_train_batch_end")


# a log step: (batch + 1) % the log cadence's interval == 0 (it does the log step's work); a metrics step: any other
# (batch + 1) % log_every == 0 (the metrics only); a snapshot step: one was taken; a hand-over step: any other step in
# which the watch took in what it held back (a run of healthy steps, the ring of losses read), at most every 64 steps
STEP_KINDS = ("ordinary", "log", "metrics", "snapshot", "handover")


def hook_times(steps: int, warmup: int, seed: int, workload: Workload = TOY,
               make_watch: Callable[[], AmpWatch] | None = None, settled: bool = False,
               min_snapshots: int = 0) -> "_HookTimer":
    """AmpWatch's per-step hooks (and the optimizer step hooks it registers) timed inside one watched run.
    ``settled``: the window starts only once the snapshot interval is settled (:func:`cadence_settled`), so that
    its snapshot steps are the ones of the rest of a run (the ``"auto"`` cadence's first snapshots are timed step
    by step). ``min_snapshots``: the window goes on past ``steps`` until it holds that many snapshot steps (at most
    ``min_snapshots`` times the longest interval the cadence picks)."""
    timer = _HookTimer(warmup, steps, settled, min_snapshots)
    watch = (make_watch or (lambda: AmpWatch(verbose=False)))()
    try:
        with tempfile.TemporaryDirectory(prefix="ampwatch-hooks-") as root:
            if not settled and not min_snapshots:
                train_once(WATCHED, steps, warmup, seed, root, timer.instrument, workload, Setup([watch]))
            else:  # as long as the window needs: the timer asks the run to stop
                clock = StepClock()
                setup = Setup([watch, _StopWhen(timer)])
                timer.instrument(setup, clock)
                total = warmup + FINAL_STEPS + steps + min_snapshots * MAX_INTERVAL + 1
                pl.seed_everything(seed, verbose=False)
                trainer = healthy_trainer(root, total, [clock, *setup.callbacks])
                gc.collect()
                workload.fit(trainer, seed)
    finally:
        timer.restore()
    return timer


def empty_call_s(calls: int = 5000) -> float:
    """The median time the hook timer measures around a hook that does nothing (a Python call and the clock's own
    reads): about 0.1 us on a quiet machine, more under load, and six hooks a step."""

    def empty(*args: Any, **kwargs: Any) -> None:
        return None

    samples = []
    clock = time.perf_counter
    for _ in range(calls):
        t0 = clock()
        try:
            empty(None, None)
        finally:
            samples.append(clock() - t0)
    return statistics.median(samples)


class _StopWhen(pl.Callback):
    """Asks the run to stop once the hook timer's window is complete."""

    def __init__(self, timer: "_HookTimer") -> None:
        self.timer = timer

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.timer.done:
            trainer.should_stop = True


class _HookTimer:
    """Wraps AmpWatch's per-step hooks on one instance, and the optimizer step hooks it registers: wall time per call.

    Only the measured window counts (warm-up steps are left out; with ``settled``, also the steps before the
    snapshot interval is settled). Medians per call, for ordinary steps, log steps and snapshot steps apart, are
    robust to load from elsewhere on the machine. A snapshot step's extra time is the snapshot's as the hooks pay
    it: the copy, and the bookkeeping of the clean steps taken in there.
    """

    def __init__(self, warmup: int, steps: int, settled: bool = False, min_snapshots: int = 0) -> None:
        self.warmup, self.steps = warmup, steps
        self.settled, self.min_snapshots = settled, min_snapshots
        self.start: int | None = None if settled else warmup  # the window's first batch
        self.end: int | None = None if settled or min_snapshots else warmup + steps  # one past its last
        self.calls: dict[str, list[tuple[int, float]]] = {}  # hook -> (batch index, seconds) per call
        self.clock: StepClock | None = None
        self.watch: AmpWatch | None = None
        self.snapshot_batches: set[int] = set()  # batches whose on_train_batch_end took a snapshot
        self.handover_batches: set[int] = set()  # batches whose on_train_batch_end took in what the ledger held back
        self.every = 0  # the snapshot interval in force at the end of the run (0: off)
        self.snapshots: list[tuple[int, int]] = []  # (step, bytes) of the snapshots held at the end
        self._newest = -1
        self._judge: int | None = None  # the log cadence's interval when the window started
        self.empty_s = 0.0  # what timing an empty hook measures (the call and the clock): taken off every median
        self._saved: list[tuple[Any, str, Any]] = []

    def _batch(self) -> int:
        assert self.clock is not None
        return len(self.clock.stamps) - 1

    def step_s(self) -> float:
        """The watched run's median step (wall clock, batch start to batch start) over the window; NaN if none."""
        if self.clock is None or self.start is None:
            return float("nan")
        stamps = self.clock.stamps[self.start: self.end]
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        return statistics.median(steps) if steps else float("nan")

    def _in_window(self, batch: int) -> bool:
        if self.start is None:
            if batch < self.warmup or self.watch is None or (
                    batch < self.warmup + FINAL_STEPS and not interval_final(self.watch)):
                return False
            self.start = batch
            self.judge_every()  # read now, while the watch holds it
        if batch < self.start:
            return False
        if self.end is None and batch >= self.start + max(self.steps, 4 * self.judge_every()) and (
                len(self.snapshot_batches - {-1}) >= self.min_snapshots):
            self.end = batch  # the window is complete before this batch
        return self.end is None or batch < self.end

    @property
    def done(self) -> bool:
        """The window is complete (the run may stop)."""
        return self.end is not None and self._batch() >= self.end

    def kind(self, batch: int) -> str:
        if batch in self.snapshot_batches:
            return "snapshot"
        if (batch + 1) % LOG_EVERY_N_STEPS:
            return "handover" if batch in self.handover_batches else "ordinary"
        return "metrics" if (batch + 1) % self.judge_every() else "log"

    def _held(self) -> tuple[int, int]:
        """What the watch's ledger holds back now: healthy steps to take in later, and losses not read yet."""
        ledger = self.watch.watcher.ledger if self.watch is not None else None
        return (0, 0) if ledger is None else (len(ledger.runs.deferred), len(ledger.losses.entries))

    def judge_every(self) -> int:
        """The steps between two log steps that do the log step's work (the log cadence's interval), as it was when
        the window started (the cadence has decided by then; the watch forgets it at the fit's end)."""
        if self._judge is None and self.start is not None and self.watch is not None:
            self._judge = judge_interval(self.watch)
        return self._judge or LOG_EVERY_N_STEPS

    def _took_snapshot(self, batch: int) -> None:
        if self.watch is None:
            return
        every, held = watch_snapshots(self.watch)
        if every:  # kept while the run holds them (AmpWatch lets its snapshots go at the fit's end)
            self.every, self.snapshots = every, held
        newest = held[-1][0] if held else -1
        if newest != self._newest:
            self._newest = newest
            self.snapshot_batches.add(batch)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            batch = self._batch()
            if not self._in_window(batch):
                try:
                    return fn(*args, **kwargs)
                finally:
                    if name == "on_train_batch_end":
                        self._took_snapshot(-1)
            held = self._held() if name == "on_train_batch_end" else (0, 0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                if name == "on_train_batch_end":
                    self._took_snapshot(batch)
                    after = self._held()
                    if after[0] < held[0] or after[1] < held[1]:  # a run handed over, or the losses read
                        self.handover_batches.add(batch)
                self.calls.setdefault(name, []).append((batch, elapsed))
        return timed

    def step_count(self, kind: str) -> int:
        """Steps of ``kind`` in the window."""
        return len({b for calls in self.calls.values() for b, _ in calls if self.kind(b) == kind})

    def medians(self) -> dict[str, dict[str, float]]:
        """Per hook: the median call on each kind of step (an ordinary step's where a kind has no call), less what
        timing an empty hook measures (:func:`empty_call_s`): the framework calls a hook whether or not AmpWatch
        does anything in it, so that part is no cost of AmpWatch's."""
        out: dict[str, dict[str, float]] = {}
        empty = self.empty_s
        for hook, calls in self.calls.items():
            by_kind: dict[str, list[float]] = {k: [] for k in STEP_KINDS}
            for b, s in calls:
                by_kind[self.kind(b)].append(s)
            plain = statistics.median(by_kind["ordinary"]) if by_kind["ordinary"] else 0.0
            out[hook] = {k: max((statistics.median(v) if v else plain) - empty, 0.0) for k, v in by_kind.items()}
        return out

    def per_step(self) -> tuple[float, bool]:
        """Seconds per step, log steps and snapshot steps spread over their intervals; and whether a log step was
        in the window."""
        medians = self.medians()
        every = self.snapshot_interval()
        judge = self.judge_every()
        logged = any(self.kind(b) == "log" for calls in self.calls.values() for b, _ in calls)
        total = 0.0
        for t in medians.values():
            total += t["ordinary"] + (t["log"] - t["ordinary"]) / judge
            if judge != LOG_EVERY_N_STEPS:
                total += (t["metrics"] - t["ordinary"]) * (1 / LOG_EVERY_N_STEPS - 1 / judge)
            if every:
                total += (t["snapshot"] - t["ordinary"]) / every
            total += (t["handover"] - t["ordinary"]) * self.handover_share()
        return total, logged

    def handover_share(self) -> float:
        """The share of the window's steps that are hand-over steps (0: none)."""
        steps = {b for calls in self.calls.values() for b, _ in calls}
        return sum(self.kind(b) == "handover" for b in steps) / len(steps) if steps else 0.0

    def snapshot_interval(self) -> int:
        """The interval in force at the end of the window; else (none seen) the snapshots' median spacing in it.
        (The median spacing mixed the ``"auto"`` cadence's first snapshots, 20 steps apart, with the interval it
        then chose, in a window that started before the choice: 20, 20, 40, 120 gave "every 30".)"""
        if self.every:
            return self.every
        steps = sorted(self.snapshot_batches - {-1})
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        return int(statistics.median(gaps)) if gaps else 0

    def snapshot_copy_s(self) -> float | None:
        """One snapshot as the hooks pay it (the copy, the ring's bookkeeping, the clean steps taken in there): a
        snapshot step's ``on_train_batch_end`` over an ordinary step's; median. None when no snapshot was taken in
        the window."""
        t = self.medians().get("on_train_batch_end")
        own = [s for b, s in self.calls.get("on_train_batch_end", []) if self.kind(b) == "snapshot"]
        if t is None or not own:
            return None
        return max(statistics.median(own) - self.empty_s - t["ordinary"], 0.0)

    def instrument(self, setup: Setup, clock: StepClock) -> None:
        self.clock = clock
        self.empty_s = empty_call_s()
        for cb in setup.callbacks:
            if isinstance(cb, AmpWatch):
                self.watch = cb
                for hook in PER_STEP_HOOKS:
                    if getattr(type(cb), hook) is not getattr(pl.Callback, hook):
                        setattr(cb, hook, self._wrap(hook, getattr(cb, hook)))
        # the optimizer step pre/post hooks and the recipe guard's step pre-hook, made at fit start, so timed at their
        # class (this process runs one benchmark at a time); put back by ``restore``
        self._saved = [(StepTaken, n, StepTaken.__dict__[n]) for n in ("_pre", "_post")]
        self._saved.append((RecipeGuards, "_before_optimizer_step", RecipeGuards.__dict__["_before_optimizer_step"]))
        for owner, name, fn in self._saved:
            label = f"optimizer step {name}" if owner is StepTaken else "recipe guard step pre-hook"
            setattr(owner, name, self._wrap(label, fn))

    def restore(self) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        self._saved = []


# ---------------------------------------------------------------- the summary


@dataclass
class WorkloadCost:
    """What AmpWatch costs a healthy step of one workload: the answer the benchmark gives, in its parts."""

    workload: str
    describe: str
    bare_step_ms: float  # the bare blocks' median time per step, in the run with snapshots on
    hooks_us: float  # the hooks' own time per step, log and snapshot steps spread over their intervals
    ordinary_us: float  # the hooks' own time on an ordinary step (no log, no snapshot)
    log_step_extra_us: float  # what a log step that does its work adds to the hooks, once per judge_every steps
    log_every: int
    snapshot_every: int  # the interval in force (0: snapshots off or never taken)
    snapshot_copy_ms: float | None  # one snapshot as the hooks pay it; None: none taken
    snapshot_bytes: int | None
    snapshots_on: PairedRatios  # AmpWatch() with its defaults against off, in one run
    snapshots_off: PairedRatios | None  # AmpWatch(snapshot_every=0) against off, in another; None: not run
    saw_log_step: bool
    #: the steps between two log steps that do the work (the log cadence's interval; ``log_every`` when unchanged),
    #: and what one of the other log steps (the metrics only) adds to the hooks
    judge_every: int = LOG_EVERY_N_STEPS
    metrics_step_extra_us: float = 0.0
    #: what a hand-over step adds to the hooks (it takes in the healthy steps held back, or reads the losses' ring,
    #: outside a log or snapshot step), and the share of the steps that are one (0: none in the window)
    handover_extra_us: float = 0.0
    handover_share: float = 0.0
    #: the null run (both sides of every pair bare): the machine's own spread of the pair ratios; None: not run
    null: PairedRatios | None = None
    #: the bare step by the process's CPU time (ms): what tells a short step from a long one (the wall clock of a
    #: loaded machine made the toy's 1 ms step 6 ms); NaN: not measured, the wall clock's is used
    bare_cpu_step_ms: float = float("nan")

    @property
    def snapshot_us_per_step(self) -> float | None:
        """The snapshot's per-step share: one copy's time over the steps between two snapshots."""
        if self.snapshot_copy_ms is None or not self.snapshot_every:
            return None
        return self.snapshot_copy_ms * 1e3 / self.snapshot_every

    @property
    def snapshot_share(self) -> float | None:
        """The same as a fraction of a bare step."""
        us = self.snapshot_us_per_step
        return None if us is None else us / (self.bare_step_ms * 1e3)

    @property
    def hooks_share(self) -> float:
        return self.hooks_us / (self.bare_step_ms * 1e3)

    @property
    def judged_by_ratio(self) -> bool:
        """A step of ``RATIO_STEP_MS`` or more (by CPU time, which load from elsewhere barely moves) is judged by its
        watched/bare ratio; a shorter one by the absolute budgets (its ratio is printed for information)."""
        step_ms = self.bare_cpu_step_ms if math.isfinite(self.bare_cpu_step_ms) else self.bare_step_ms
        return step_ms >= RATIO_STEP_MS

    def over_absolute(self) -> list[str]:
        """The absolute budgets this workload's figures exceed, in words (empty: within them all)."""
        over = []
        if self.ordinary_us > ORDINARY_BUDGET_US:
            over.append(f"an ordinary step's hooks take {self.ordinary_us:.1f} us (budget {ORDINARY_BUDGET_US:g})")
        if self.log_step_extra_us > LOG_STEP_BUDGET_US:
            over.append(f"a log step adds {self.log_step_extra_us:.0f} us (budget {LOG_STEP_BUDGET_US:g})")
        # a hand-over step does the log step's bookkeeping (the held steps taken in) between log steps: the same budget
        if self.handover_share and self.handover_extra_us > LOG_STEP_BUDGET_US:
            over.append(f"a hand-over step adds {self.handover_extra_us:.0f} us (budget {LOG_STEP_BUDGET_US:g}, as a "
                        "log step's)")
        share = self.snapshot_share
        if share is not None and share > SNAPSHOT_SHARE_BUDGET:
            over.append(f"the snapshot's share is {share:.2%} (budget {SNAPSHOT_SHARE_BUDGET:.1%})")
        return over

    def ratio_verdict(self, snapshots: bool = True) -> str:
        """What the on/off blocks support about the ratio budget (snapshots on, or off)."""
        paired = self.snapshots_on if snapshots else self.snapshots_off
        if paired is None:
            return "not measured (--verdicts)"
        return verdict([median_interval(paired.wall), median_interval(paired.cpu)])

    def verdict(self, snapshots: bool = True) -> str:
        """The workload's verdict: by ratio on a step of ``RATIO_STEP_MS`` or more, else by the absolute budgets
        (``snapshots=False``: the run with snapshots off, judged the same way without the snapshot's share)."""
        if self.judged_by_ratio:
            return self.ratio_verdict(snapshots)
        if not snapshots and self.snapshots_off is None:
            return "not measured (--verdicts)"
        over = [o for o in self.over_absolute() if snapshots or "snapshot" not in o]
        return "over the budget: " + "; ".join(over) if over else "within the budget"

    def lines(self) -> list[str]:
        """The workload's block of the summary: plain lines that can be quoted as they are."""
        cpu = f" ({self.bare_cpu_step_ms:.2f} ms of CPU time)" if math.isfinite(self.bare_cpu_step_ms) else ""
        lines = [f"{self.workload}: {self.describe}; bare step {self.bare_step_ms:.2f} ms{cpu}",
                 f"  hooks' own time   {self.hooks_us:.1f} us per step = {self.hooks_share:.2%} of a bare step "
                 f"(an ordinary step {self.ordinary_us:.1f} us; a log step adds {self.log_step_extra_us:.0f} us, "
                 f"once in {self.judge_every}" + ("" if self.saw_log_step else ", none in the window")
                 + ("" if self.judge_every == self.log_every else
                    f", the log cadence's interval; the other log steps, one in {self.log_every}, log the metrics "
                    f"only and add {self.metrics_step_extra_us:.0f} us")
                 + (f"; a step that takes in what was held back, one in {1 / self.handover_share:.0f}, adds "
                    f"{self.handover_extra_us:.0f} us" if self.handover_share else "")
                 + ("; and the snapshot's share below" if self.snapshot_share is not None else "") + ")"]
        share = self.snapshot_share
        if share is None:
            lines.append("  snapshot          none taken in the measured window (snapshots off, or the window "
                         "shorter than the interval)")
        else:
            size = f", {_size(self.snapshot_bytes)}" if self.snapshot_bytes else ""
            lines.append(f"  snapshot          one copy {self.snapshot_copy_ms:.3f} ms{size}, every "
                         f"{self.snapshot_every} steps: {self.snapshot_us_per_step:.1f} us per step = {share:.2%} "
                         "of a bare step (the snapshot's per-step share)")
        if not self.judged_by_ratio:
            lines.append(f"  budgets           a step under {RATIO_STEP_MS:g} ms is judged by absolute figures: an "
                         f"ordinary step's hooks at most {ORDINARY_BUDGET_US:g} us, a log step's extra (and a "
                         f"hand-over step's) at most {LOG_STEP_BUDGET_US:g} us, the snapshot's share at most {SNAPSHOT_SHARE_BUDGET:.1%} "
                         f"(the calls per step: benchmarks/step_counts.py)")
            lines.append(f"    verdict         {self.verdict()}")
        for label, paired, snapshots in (("snapshots on", self.snapshots_on, True),
                                         ("snapshots off", self.snapshots_off, False)):
            if paired is None:
                continue
            lines += [f"  {label:<17} {len(paired.wall)} pairs of on/off blocks, watched/bare:",
                      f"    wall clock      {describe_ratios(paired.wall)}",
                      f"    CPU time        {describe_ratios(paired.cpu)}"]
            if self.judged_by_ratio:
                lines.append(f"    verdict         {self.ratio_verdict(snapshots)} (budget {BUDGET:.2f}; "
                             f"{CONFIDENCE:.0%} CI, both clocks)")
            else:
                lines.append(f"    ratio           for information only (a step under {RATIO_STEP_MS:g} ms): "
                             f"{self.ratio_verdict(snapshots)} against {BUDGET:.2f}")
            (runs_on, runs_off), (gc_on, gc_off) = paired.gc_per_1000, paired.gc_s_per_step
            if math.isfinite(runs_on) and math.isfinite(runs_off):
                lines.append(f"    garbage         Python's collections: {runs_on:.1f} per 1000 steps on, "
                             f"{runs_off:.1f} off; {gc_on * 1e6:.2f} against {gc_off * 1e6:.2f} us a step (in the "
                             "blocks' times above; no hook's own: they run where an allocation tips the count)")
        if self.null is not None:
            null_cis = [median_interval(self.null.wall), median_interval(self.null.cpu)]
            lines += [f"  {'null run':<17} {len(self.null.wall)} pairs of blocks, both bare (what the machine "
                      "alone spreads):",
                      f"    wall clock      {describe_ratios(self.null.wall)}",
                      f"    CPU time        {describe_ratios(self.null.cpu)}"]
            if any(ci is None for ci in null_cis):
                pass
            elif any(ci[1] > BUDGET for ci in null_cis):  # type: ignore[index]
                lines.append(f"    so              with both sides bare the {CONFIDENCE:.0%} CI still reaches past "
                             f"{BUDGET:.2f}: here even a watch that cost nothing could not be found \"within the "
                             "budget\", only \"over\" can be told; the parts above say where the time goes")
            elif any(ci[0] < 2 - BUDGET for ci in null_cis):  # type: ignore[index]
                low = min(ci[0] for ci in null_cis)  # type: ignore[index]
                lines.append(f"    so              with both sides bare the {CONFIDENCE:.0%} CI reaches down to "
                             f"{low:.3f}: the blocks alone differ by more than the budget's {BUDGET - 1:.0%} here, so "
                             "the ratios above can be off by as much either way; the parts above say where the time "
                             "goes")
        if self.judged_by_ratio and self.hooks_share > BUDGET - 1:  # a lower bound on the cost, whatever the blocks say
            lines.append(f"  note              the hooks' own time alone is more than the budget's {BUDGET - 1:.0%}")
        return lines


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} kB"


def auto_pairs(step_s: float, block: int = LOG_EVERY_N_STEPS, seconds: float = PAIR_SECONDS) -> int:
    """The on/off pairs per verdict when ``--pairs`` is not given: about ``seconds`` of blocks (``--verdict-seconds``)
    at a step of ``step_s`` seconds, at least ``MIN_PAIRS`` and at most ``MAX_PAIRS`` per ``PAIR_SECONDS`` asked for
    (``MIN_PAIRS`` when the step is unknown)."""
    if not (math.isfinite(step_s) and step_s > 0):
        return MIN_PAIRS
    most = max(MIN_PAIRS, round(MAX_PAIRS * seconds / PAIR_SECONDS))
    return max(MIN_PAIRS, min(most, round(seconds / (2 * block * step_s))))


def measure_workload(workload: Workload, pairs: int | None, steps: int, warmup: int, seed: int,
                     block: int = LOG_EVERY_N_STEPS, seconds: float = PAIR_SECONDS,
                     verdicts: Sequence[str] = DEFAULT_VERDICTS) -> tuple[WorkloadCost, "_HookTimer"]:
    """AmpWatch() on ``workload``: on/off blocks with snapshots on and off, and the hooks timed per kind of step.
    ``pairs``: on/off pairs per verdict; None: :func:`auto_pairs` over ``seconds`` at the step the hooks' timer
    saw. ``verdicts``: the paired runs made besides the defaults' (``"on"``, always made): ``"off"`` (snapshots
    off) and ``"null"`` (both sides bare)."""
    # the window starts once "auto" has chosen its interval, and holds at least three snapshots at it
    timer = hook_times(steps, warmup, seed, workload=workload, settled=True, min_snapshots=3)
    if pairs is None:
        pairs = auto_pairs(timer.step_s(), block, seconds)
    hooks_s, saw_log = timer.per_step()
    end = timer.medians().get("on_train_batch_end", {"ordinary": 0.0, "log": 0.0, "metrics": 0.0, "handover": 0.0})
    ordinary = sum(t["ordinary"] for t in timer.medians().values())
    on = paired_blocks(pairs, seed, block, workload)
    off = (paired_blocks(pairs, seed, block, workload, lambda: AmpWatch(verbose=False, snapshot_every=0))
           if "off" in verdicts else None)
    null = paired_blocks(pairs, seed, block, workload, null=True) if "null" in verdicts else None
    copy_s = timer.snapshot_copy_s()
    every = timer.snapshot_interval()
    sizes = [nbytes for _, nbytes in timer.snapshots]
    bare = on.bare_step_s if math.isfinite(on.bare_step_s) or off is None else off.bare_step_s
    bare_cpu = on.bare_cpu_step_s if math.isfinite(on.bare_cpu_step_s) or off is None else off.bare_cpu_step_s
    cost = WorkloadCost(workload.name, workload.describe, bare * 1e3, hooks_s * 1e6, ordinary * 1e6,
                        (end["log"] - end["ordinary"]) * 1e6, LOG_EVERY_N_STEPS, every if copy_s is not None else 0,
                        None if copy_s is None else copy_s * 1e3, sizes[-1] if sizes else None, on, off, saw_log,
                        judge_every=timer.judge_every(), metrics_step_extra_us=(end["metrics"] - end["ordinary"]) * 1e6,
                        null=null, bare_cpu_step_ms=bare_cpu * 1e3,
                        handover_extra_us=(end["handover"] - end["ordinary"]) * 1e6,
                        handover_share=timer.handover_share())
    return cost, timer


def print_summary(costs: Sequence[WorkloadCost], reads: HostReads | None) -> str:
    """The closing block, plain lines the README can quote as they are; returns the worst verdict with the
    defaults (snapshots on)."""
    lines = [f"AmpWatch() on a healthy fp16 run: {DEVICE['type'].upper()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} thread(s)",
             f"(a step of {RATIO_STEP_MS:g} ms or more: watched/bare, the per-step time with AmpWatch over that "
             f"without it, in neighbouring {LOG_EVERY_N_STEPS}-step blocks of one run, budget {BUDGET:.2f}; a "
             "shorter step: the absolute budgets)"]
    for cost in costs:
        lines += cost.lines()
    if reads is not None:
        lines.append(f"host reads (toy)    {describe_reads(reads)}, on the accelerator's path (on the CPU each "
                     "loss is taken as a float at once: no device to wait for)")
    print("\n".join(["", "-" * 30 + " summary " + "-" * 30, *lines]))
    order = ("over the budget", "inconclusive", "within the budget")
    outcomes = [cost.verdict() for cost in costs]
    return min(outcomes, key=lambda o: next(i for i, p in enumerate(order) if o.startswith(p)))


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_ampwatch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def configuration_name(text: str) -> str:
    """``--only``'s argument: a configuration's exact name, or that name without its ``()`` or ``=True``."""
    for name in CONFIGURATIONS:
        if text in (name, name.split("(")[0].split("=")[0]):
            return name
    raise argparse.ArgumentTypeError(f"{text!r} is not a configuration; use one of "
                                     + ", ".join(repr(n) for n in CONFIGURATIONS))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="AmpWatch's per-step overhead on a healthy fp16 run.")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 300; --quick 40)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out at the start of each run "
                        "(default 30; --quick 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer steps, rounds and pairs, the toy "
                        "workload only, the defaults' blocks only; rarely a verdict")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None,
                        help="built-in workloads to measure AmpWatch() on: " + "; ".join(
                            f"{w.name}: {w.describe}" for w in WORKLOADS.values())
                        + " (default: all; --quick: toy; with --model: none unless named); the table of separate "
                        "runs and the host reads come with the toy")
    parser.add_argument("--model", metavar="MODULE:ATTR", default=None,
                        help="measure your own LightningModule (the built-in workloads too only if --workloads "
                        "names them): MODULE:ATTR names an instance, its class or a function of no arguments "
                        "returning one (imported from the current directory or the path); it trains on its own "
                        "train_dataloader()")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every run trains, in true fp16 with a default GradScaler (default cpu)")
    parser.add_argument("--only", nargs="+", type=configuration_name, default=None, metavar="NAME",
                        help="compare only these configurations in the table of separate runs: "
                        + ", ".join(repr(n) for n in CONFIGURATIONS)
                        + f" (the name with or without its '()' or '=True'; {BASELINE!r} is always included)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a verdict is 'over the budget', 2 when "
                        "one is inconclusive (the defaults' verdicts, snapshots on)")
    parser.add_argument("--pairs", type=int, default=None, help="on/off block pairs for each verdict (default: about "
                        f"--verdict-seconds of blocks per verdict at the workload's step, {MIN_PAIRS} to {MAX_PAIRS} "
                        f"pairs per {PAIR_SECONDS:.0f} s; --quick 6)")
    parser.add_argument("--verdict-seconds", type=float, default=PAIR_SECONDS, metavar="S",
                        help=f"seconds of on/off blocks per verdict when --pairs is not given (default "
                        f"{PAIR_SECONDS:.0f}); the interval narrows as one over the square root of the time: on a "
                        "several-millisecond step a verdict against a 1%% budget needs about ten minutes")
    parser.add_argument("--verdicts", nargs="+", choices=VERDICT_RUNS, default=None, metavar="RUN",
                        help="the paired runs to make per workload: 'on' (the defaults against bare: the verdict, "
                        "always made), 'off' (snapshots off against bare), 'null' (both sides bare: what the "
                        "machine alone spreads) (default: on, off, null; --quick: on)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (40 if args.quick else 300)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (20 if args.quick else 30)
    pairs = args.pairs if args.pairs is not None else (6 if args.quick else None)  # None: per workload
    for flag, value, low in (("--steps", steps, 1), ("--rounds", rounds, 1), ("--warmup", warmup, 0),
                             ("--pairs", 1 if pairs is None else pairs, 1)):
        if value < low:
            parser.error(f"{flag}={value} is not valid; use an integer >= {low}")
    if not (math.isfinite(args.verdict_seconds) and args.verdict_seconds > 0):
        parser.error(f"--verdict-seconds={args.verdict_seconds} is not valid; use a number of seconds above 0")
    asked = args.verdicts if args.verdicts is not None else (["on"] if args.quick else list(DEFAULT_VERDICTS))
    verdicts = ["on", *(run for run in VERDICT_RUNS if run != "on" and run in asked)]
    names = list(CONFIGURATIONS) if args.only is None else [BASELINE] + [n for n in args.only if n != BASELINE]
    if args.workloads is not None:
        workloads = [WORKLOADS[n] for n in args.workloads]
    else:
        workloads = [] if args.model else [TOY] if args.quick else list(WORKLOADS.values())
    if args.model:
        try:
            workloads.append(user_workload(args.model))
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            parser.error(str(err))
    DEVICE["type"] = args.device
    # the hooks' timer needs a snapshot or two and a log step inside its window
    hook_steps = max(steps, 3 * LOG_EVERY_N_STEPS)

    _quiet()
    torch.set_num_threads(1)  # one thread: less scheduling noise, and the same for every configuration
    console = Console(width=120, highlight=False)
    console.print(f"torch {torch.__version__}, lightning {pl.__version__}, 1 thread, {args.device}; "
                  f"{len(names)} configurations, {rounds} rounds x {steps} steps (+{warmup} warm-up); "
                  f"{pairs or f'about {args.verdict_seconds:.0f} s of'} on/off pairs per verdict "
                  f"({', '.join(verdicts)}); workloads: {', '.join(w.name for w in workloads)}")
    with_toy = TOY in workloads  # the separate runs' table and the host reads are the toy's
    if with_toy:
        results = measure(steps, rounds, warmup, args.seed, names, console)
        print_table(results, steps, rounds, console)
    costs = []
    for workload in workloads:
        cost, _ = measure_workload(workload, pairs, hook_steps, warmup, args.seed, seconds=args.verdict_seconds,
                                   verdicts=verdicts)
        costs.append(cost)
        console.print(f"[dim]{workload.name} measured[/dim]")
    reads = host_reads(args.seed) if with_toy and args.device == "cpu" else None
    outcome = print_summary(costs, reads)
    if not args.strict or outcome == "within the budget":
        return 0
    return 1 if outcome == "over the budget" else 2


if __name__ == "__main__":
    sys.exit(main())
