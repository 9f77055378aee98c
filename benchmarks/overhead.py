"""How much does ``AmpWatch()`` cost a healthy fp16 run? Set beside ``detect_anomaly`` and ``SpikeDetection``.

Run it from the repository root::

    python benchmarks/overhead.py             # the full comparison (about a minute on 2 CPU cores)
    python benchmarks/overhead.py --quick     # a smoke run (well under a minute): few pairs, rarely a verdict
    python benchmarks/overhead.py --pairs 60 --strict   # more pairs; exit 1 if over budget, 2 if inconclusive
    python benchmarks/overhead.py --profile   # also: each hook's time, and where it goes (cProfile)
    python benchmarks/overhead.py --snapshots # also: what one in-memory snapshot of a run's state costs

Every configuration trains the same small MLP (``scenarios.Regressor``) on the CPU with real float16 autocast
and a real default GradScaler (``scenarios.true_fp16_plugin``), from the same seed, one torch thread, with a
logger that writes nothing (``DummyLogger``), so that every log step does all its work: a healthy run, whose
scale settles in the warm-up, so this is the price a user pays on every step while nothing is wrong.

What it prints, from the least to the most robust on a busy machine:

1. A table of separate runs, interleaved (round 1: A B C D, round 2: B C D A, ...), each run's per-step time
   over the bare run's in the same round, by wall clock and by the process's CPU time. Separate runs on a
   shared 2-core machine drift by tens of percent, so the table compares configurations; it gives no verdict.
2. The verdict: one run in which AmpWatch is switched on and off every 50 steps (Lightning's logging interval,
   so each block holds one log step), in pairs ordered on/off, off/on, ... Each pair gives a ratio of
   neighbouring blocks, which drift barely touches. The median ratio comes with its quartiles and a 95%
   confidence interval (order statistics, no assumption about the noise); the verdict is "within the budget"
   only when the interval lies below the budget on both clocks, "over the budget" when it lies above it on
   either, and otherwise "inconclusive on this machine (spread too wide)".
3. AmpWatch's hooks timed inside the training loop: their own time per healthy step, log steps spread over
   the interval. Load from elsewhere inflates a median call far less than a whole step: the robust number.
4. Host reads: the reads AmpWatch adds to each step (``aten::_local_scalar_dense`` and whole-tensor
   ``tolist``/``numpy``, counted with torch.profiler by ``tests/_reads.py``), per log step and per other step.

The budget for ``AmpWatch()`` is a median ratio of at most 1.01. The last block of the output sums it all up
in a few lines that can be quoted as they are.

To compare another set-up (say, AmpWatch with probes armed), add an entry to ``CONFIGURATIONS``: a name mapped
to a function of the run's directory that returns a ``Setup`` (callbacks and extra ``Trainer`` arguments).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import math
import pstats
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
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.investigate import Investigator
from lightning_ampwatch.machine import PrecisionMode
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin
from lightning_ampwatch.signals import StepTaken

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the one host-read counter
from _reads import added_reads, reads_per_step  # noqa: E402

BATCH_SIZE = 32
LOG_EVERY_N_STEPS = 50  # Lightning's default, set explicitly: AmpWatch logs its metrics at these steps
DATASET_ROWS = 32 * 1024  # the same data whatever --steps says; longer runs go round it again
BUDGET = 1.01  # AmpWatch() on a healthy run: at most 1% slower per step than the bare run
CONFIDENCE = 0.95  # of the interval around the median pair ratio that the verdict rests on
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
    """The benchmark's trainer: CPU, true fp16, a logger that writes nothing, no checkpoints or progress bar."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, plugins=[true_fp16_plugin()], logger=DummyLogger(),
        default_root_dir=root_dir, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=log_every_n_steps, callbacks=callbacks,
    )
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def healthy_data(seed: int) -> DataLoader:
    return DataLoader(regression_data(n=DATASET_ROWS, seed=seed), batch_size=BATCH_SIZE, shuffle=False)


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
               instrument: Callable[[Setup, StepClock], None] | None = None) -> RunResult:
    """One training with configuration ``name``; the per-step time over ``steps`` full iterations after warm-up."""
    setup = CONFIGURATIONS[name](root_dir)
    clock = StepClock()
    if instrument is not None:
        instrument(setup, clock)
    total_steps = warmup + steps + 1  # the stamp of batch ``warmup + steps`` closes the window
    pl.seed_everything(seed, verbose=False)
    trainer = healthy_trainer(root_dir, total_steps, [clock, *setup.callbacks], **setup.trainer_kwargs)
    gc.collect()
    trainer.fit(Regressor(), healthy_data(seed))
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
    "Off" is AmpWatch absent in all but name: its hooks return at once and its optimizer and clipping hooks are
    removed; switching on again re-reads the scaler (as at train start), so it watches a healthy run correctly.
    A block is timed from after its switch to before the next one: the switching itself is not AmpWatch's cost.
    """

    def __init__(self, watch: AmpWatch, block: int) -> None:
        self.watch, self.block = watch, block
        self.steps = 0
        self.starts: list[tuple[float, float]] = []  # per block: (wall clock, CPU time) after its switch
        self.ends: list[tuple[float, float]] = []  # per block: the same before the next block's switch
        self.on: list[bool] = []  # per block: was AmpWatch on

    def _set(self, trainer: pl.Trainer, pl_module: pl.LightningModule, on: bool) -> None:
        watch = self.watch
        watcher = watch.watcher
        if on and watcher.disabled:
            watcher.disabled = False
            watcher._attach_guards()
            watcher.begin_training()  # attaches the step hooks again and re-reads the scaler
        elif not on and not watcher.disabled:
            watcher.disabled = True
            watcher.ledger.taken.detach()  # type: ignore[union-attr]
            watcher.guards.detach()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step, self.steps = self.steps, self.steps + 1
        if step % self.block:
            return
        if self.starts:
            self.ends.append((time.perf_counter(), time.process_time()))
        pair, second = divmod(step // self.block, 2)
        on = (second == 0) if pair % 2 == 0 else (second == 1)  # on/off, then off/on, ...
        self._set(trainer, pl_module, on)
        self.on.append(on)
        self.starts.append((time.perf_counter(), time.process_time()))

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


def paired_blocks(pairs: int, seed: int, block: int = LOG_EVERY_N_STEPS) -> PairedRatios:
    """AmpWatch on against off in alternating blocks of one healthy run."""
    watch = AmpWatch(verbose=False)
    toggle = BlockToggle(watch, block)
    warm_blocks = 2
    total = (2 * pairs + warm_blocks) * block + 1
    pl.seed_everything(seed, verbose=False)
    with tempfile.TemporaryDirectory(prefix="ampwatch-pairs-") as root:
        trainer = healthy_trainer(root, total, [toggle, watch])
        gc.collect()
        trainer.fit(Regressor(), healthy_data(seed))
    return PairedRatios(toggle.pair_ratios(warm_blocks, 0), toggle.pair_ratios(warm_blocks, 1))


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


def armed_cost(seed: int, repeats: int = 5) -> tuple[float, float]:
    """What one armed episode costs: the probes' replay under autocast plus the FP32 control on one batch (ms),
    against one training step (ms). It runs at most once per episode, never on a healthy step."""
    from lightning_ampwatch.probes import MicroBatch

    watch = AmpWatch(verbose=False)
    clock = StepClock()
    pl.seed_everything(seed, verbose=False)
    data = healthy_data(seed)
    with tempfile.TemporaryDirectory(prefix="ampwatch-armed-") as root:
        trainer = healthy_trainer(root, 60, [clock, watch])
        trainer.fit(Regressor(), data)
        module = trainer.lightning_module
        investigator = Investigator(module, trainer.precision_plugin.forward_context, module.device,
                                    PrecisionMode.FP16, localize=True, control=True, automatic=True)
        batch = next(iter(data))
        timings = []
        for _ in range(repeats):
            start = time.perf_counter()
            investigator.collect([MicroBatch(batch, 0)], scale=2.0**16, fault_ranks=[0],
                                 weights_stepped=False, loss_level=None, agree=False)
            timings.append(time.perf_counter() - start)
    step = per_step_time(clock.stamps[10:], 25)
    return statistics.median(timings) * 1e3, step * 1e3


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

    Step 0 is left out: once per fit AmpWatch reads the first loss (its loss level and loss-graph check)."""

    def fit(callbacks: list[pl.Callback]) -> Callable[[list[pl.Callback]], None]:
        def run(marks: list[pl.Callback]) -> None:
            pl.seed_everything(seed, verbose=False)
            with tempfile.TemporaryDirectory(prefix="ampwatch-reads-") as root:
                trainer = healthy_trainer(root, READS_STEPS, [*marks, *callbacks], READS_LOG_EVERY,
                                          plugins=[true_fp16_plugin(**READS_SCALER)])
                trainer.fit(Regressor(), healthy_data(seed))
        return run

    watched, _ = reads_per_step(fit([AmpWatch(verbose=False)]))
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

# Lightning's hooks that run on every training step; those AmpWatch overrides are the ones profiled.
PER_STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                  "on_before_zero_grad", "on_train_batch_end")


def hook_times(steps: int, warmup: int, seed: int, profiler: cProfile.Profile | None = None) -> "_HookTimer":
    """AmpWatch's per-step hooks (and the optimizer step hooks it registers) timed inside one watched run."""
    timer = _HookTimer(warmup, steps, profiler)
    with tempfile.TemporaryDirectory(prefix="ampwatch-hooks-") as root:
        train_once(WATCHED, steps, warmup, seed, root, timer.instrument)
    return timer


def print_hook_table(timer: "_HookTimer", steps: int, warmup: int) -> None:
    print(f"\nAmpWatch's hooks, wall clock without a profiler, {steps} steps after {warmup} warm-up "
          f"(median us per call):")
    print(f"  {'hook':<30} {'ordinary step':>14} {'log step':>10}")
    for hook, (ordinary, logged) in timer.medians().items():
        print(f"  {hook:<30} {ordinary * 1e6:14.1f} {logged * 1e6:10.1f}")


def print_cprofile(steps: int, warmup: int, seed: int, top: int = 30) -> None:
    """The same hooks under cProfile (which inflates everything): where their time goes."""
    profiler = cProfile.Profile()
    hook_times(steps, warmup, seed, profiler)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_callees("on_train_batch_end|on_before_optimizer_step|_resolve")
    print(f"\ncProfile of the same hooks (inflated by the profiler):\n{out.getvalue()}")


class _HookTimer:
    """Wraps AmpWatch's per-step hooks on one instance: wall time per call, and cProfile switched on inside.

    Only the measured window counts (warm-up steps are left out). Medians per call, for ordinary steps and for
    log steps apart, are robust to load from elsewhere on the machine.
    """

    def __init__(self, warmup: int, steps: int, profiler: cProfile.Profile | None) -> None:
        self.warmup, self.steps, self.profiler = warmup, steps, profiler
        self.calls: dict[str, list[tuple[int, float]]] = {}  # hook -> (batch index, seconds) per call
        self.clock: StepClock | None = None

    def _batch(self) -> int:
        assert self.clock is not None
        return len(self.clock.stamps) - 1

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            batch = self._batch()
            if not self.warmup <= batch < self.warmup + self.steps:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            if self.profiler is not None:
                self.profiler.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.profiler is not None:
                    self.profiler.disable()
                self.calls.setdefault(name, []).append((batch, time.perf_counter() - t0))
        return timed

    def medians(self) -> dict[str, tuple[float, float]]:
        """Per hook: the median call on ordinary steps and on log steps (Lightning logs when (batch+1) % N == 0)."""
        out: dict[str, tuple[float, float]] = {}
        for hook, calls in self.calls.items():
            ordinary = [s for b, s in calls if (b + 1) % LOG_EVERY_N_STEPS]
            logged = [s for b, s in calls if not (b + 1) % LOG_EVERY_N_STEPS]
            plain = statistics.median(ordinary) if ordinary else 0.0
            out[hook] = (plain, statistics.median(logged) if logged else plain)
        return out

    def per_step(self) -> tuple[float, bool]:
        """Seconds per step, log steps spread over the interval; and whether a log step was in the window."""
        medians = self.medians()
        logged = any(not (b + 1) % LOG_EVERY_N_STEPS for calls in self.calls.values() for b, _ in calls)
        return sum(o + (lg - o) / LOG_EVERY_N_STEPS for o, lg in medians.values()), logged

    def instrument(self, setup: Setup, clock: StepClock) -> None:
        self.clock = clock
        for cb in setup.callbacks:
            if isinstance(cb, AmpWatch):
                for hook in PER_STEP_HOOKS:
                    if getattr(type(cb), hook) is not getattr(pl.Callback, hook):
                        setattr(cb, hook, self._wrap(hook, getattr(cb, hook)))
        # internal: the optimizer step pre/post hooks and the recipe guard's step pre-hook, made at fit start, so
        # timed at their class (this process runs one benchmark at a time)
        for name in ("_pre", "_post"):
            setattr(StepTaken, name, self._wrap(f"optimizer step {name}", getattr(StepTaken, name)))
        RecipeGuards._before_optimizer_step = self._wrap("recipe guard step pre-hook",
                                                         RecipeGuards._before_optimizer_step)


# ---------------------------------------------------------------- what one in-memory snapshot costs

SNAPSHOT_SIZES = (1_000_000, 10_000_000, 50_000_000)  # parameters, each trained with AdamW
SNAPSHOT_EVERY = (50, 100)
SNAPSHOT_WIDTH = 1000  # the models are stacks of 1000x1000 linear layers (about 1M parameters each)


@dataclass
class SnapshotCost:
    """One model's snapshot: its size and the time of one host copy, against a training step of that model."""

    params: int
    bytes: int
    copy_ms: float
    step_ms: float


def snapshot_cost(params: int, repeats: int = 5) -> SnapshotCost:
    """Bytes and time of one snapshot the way a ring of them would take it: ``copy_`` of every parameter, buffer
    and optimizer state tensor into host buffers allocated once, plus the scaler's state and the RNG state.

    The model is trained five float32 AdamW steps first (batch 32), so the optimizer state is real; the
    median of the last four is the step it is set beside. On an accelerator the buffers would be pinned host memory and
    the copy would cross the bus: this measures the CPU's memory bandwidth, one thread."""
    torch.manual_seed(0)
    layers = max(1, round(params / (SNAPSHOT_WIDTH * (SNAPSHOT_WIDTH + 1))))
    model = nn.Sequential(nn.BatchNorm1d(SNAPSHOT_WIDTH),  # buffers too, as a real model has
                          *[nn.Linear(SNAPSHOT_WIDTH, SNAPSHOT_WIDTH) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(BATCH_SIZE, SNAPSHOT_WIDTH)
    step_times = []
    for _ in range(5):
        start = time.perf_counter()
        scaler.scale(model(x).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
    sources = [*model.parameters(), *model.buffers(),
               *[t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]]
    buffers = [torch.empty_like(t, device="cpu") for t in sources]
    copies = []
    for _ in range(repeats):
        start = time.perf_counter()
        for dst, src in zip(buffers, sources):
            dst.copy_(src)
        rng, scaler_state = torch.get_rng_state(), scaler.state_dict()
        copies.append(time.perf_counter() - start)
    size = sum(t.numel() * t.element_size() for t in buffers) + rng.numel() * rng.element_size()
    size += 8 * len(scaler_state)  # a handful of Python numbers
    return SnapshotCost(sum(p.numel() for p in model.parameters()), size, statistics.median(copies) * 1e3,
                        statistics.median(step_times[1:]) * 1e3)


def print_snapshots(costs: Sequence[SnapshotCost], console: Console) -> None:
    table = Table(title="One snapshot: params, buffers, AdamW state, scaler, RNG")
    table.add_column("params", justify="right")
    table.add_column("MB", justify="right")
    table.add_column("copy ms", justify="right")
    table.add_column("step ms", justify="right")  # one float32 AdamW training step of that model, batch 32
    for every in SNAPSHOT_EVERY:
        table.add_column(f"every {every}: ms/step", justify="right")
    for c in costs:
        table.add_row(f"{c.params / 1e6:.1f}M", f"{c.bytes / 1e6:.0f}", f"{c.copy_ms:.1f}", f"{c.step_ms:.1f}",
                      *[f"{c.copy_ms / every:.2f} ({c.copy_ms / every / c.step_ms:.1%})" for every in SNAPSHOT_EVERY])
    console.print(table)


# ---------------------------------------------------------------- the summary


def print_summary(bare_ms: float, paired: PairedRatios, hooks: tuple[float, bool], reads: HostReads,
                  snapshots: Sequence[SnapshotCost]) -> str:
    """The closing block, plain lines the README can quote as they are; returns the verdict."""
    outcome = verdict([median_interval(paired.wall), median_interval(paired.cpu)])
    hook_s, saw_log_step = hooks
    share = hook_s * 1e3 / bare_ms
    spread = f"log steps spread over {LOG_EVERY_N_STEPS}" if saw_log_step else "no log step in the window"
    lines = [
        f"AmpWatch() on a healthy fp16 run: CPU, torch {torch.__version__}, 1 thread, bare step {bare_ms:.2f} ms",
        f"  hooks' own time  {hook_s * 1e6:.1f} us per step = {share:.1%} of a bare step ({spread})",
        f"  on/off blocks    {len(paired.wall)} pairs of {LOG_EVERY_N_STEPS}-step blocks in one run, watched/bare:",
        f"    wall clock     {describe_ratios(paired.wall)}",
        f"    CPU time       {describe_ratios(paired.cpu)}",
        f"  verdict          {outcome} (budget {BUDGET:.2f}; {CONFIDENCE:.0%} CI, both clocks)",
    ]
    if share > BUDGET - 1:  # a lower bound on the cost, whatever the blocks say
        lines.append(f"  note             the hooks' own time alone is more than the budget's {BUDGET - 1:.0%}")
    lines.append(f"  host reads       {describe_reads(reads)}")
    for c in snapshots:
        every = ", ".join(f"{c.copy_ms / n:.2f} ms/step every {n}" for n in SNAPSHOT_EVERY)
        name = f"snapshot {c.params / 1e6:.0f}M"
        lines.append(f"  {name:<16} {c.bytes / 1e6:.0f} MB, {c.copy_ms:.1f} ms a copy: {every} (a step: {c.step_ms:.0f} ms)")
    print("\n".join(["", "-" * 30 + " summary " + "-" * 30, *lines]))
    return outcome


def _quiet() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_ampwatch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="AmpWatch's per-step overhead on a healthy fp16 CPU run.")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default 300; --quick 40)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="steps left out at the start of each run "
                        "(default 30; --quick 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer steps, rounds and pairs")
    parser.add_argument("--profile", action="store_true", help="also each hook's time, and cProfile of the hooks")
    parser.add_argument("--snapshots", action="store_true", help="also what one in-memory snapshot costs "
                        f"({', '.join(f'{n // 1_000_000}M' for n in SNAPSHOT_SIZES)} parameters with AdamW)")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGURATIONS), default=None,
                        help=f"measure only these configurations ({BASELINE!r} is always included)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the verdict is 'over the budget', 2 when "
                        "it is inconclusive")
    parser.add_argument("--pairs", type=int, default=None, help="on/off block pairs for the verdict (default 30; "
                        "--quick 10)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (40 if args.quick else 300)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (20 if args.quick else 30)
    pairs = args.pairs if args.pairs is not None else (10 if args.quick else 30)
    for flag, value, low in (("--steps", steps, 1), ("--rounds", rounds, 1), ("--warmup", warmup, 0),
                             ("--pairs", pairs, 1)):
        if value < low:
            parser.error(f"{flag}={value} is not valid; use an integer >= {low}")
    names = list(CONFIGURATIONS) if args.only is None else [BASELINE] + [n for n in args.only if n != BASELINE]

    _quiet()
    torch.set_num_threads(1)  # one thread: less scheduling noise, and the same for every configuration
    console = Console(width=120, highlight=False)
    console.print(f"torch {torch.__version__}, lightning {pl.__version__}, 1 thread; {len(names)} configurations, "
                  f"{rounds} rounds x {steps} steps (+{warmup} warm-up); {pairs} on/off pairs")
    results = measure(steps, rounds, warmup, args.seed, names, console)
    print_table(results, steps, rounds, console)
    paired = paired_blocks(pairs, args.seed)
    timer = hook_times(steps, warmup, args.seed)
    if args.profile:
        print_hook_table(timer, steps, warmup)
        print_cprofile(steps, warmup, args.seed)
    reads = host_reads(args.seed)
    armed_ms, step_ms = armed_cost(args.seed)
    console.print(f"Armed probes: one episode's replay with probes plus the FP32 control costs {armed_ms:.2f} ms "
                  f"({armed_ms / step_ms:.1f} training steps of {step_ms:.2f} ms), once per episode, never on a "
                  "healthy step.")
    snapshots = [snapshot_cost(n) for n in SNAPSHOT_SIZES] if args.snapshots else []
    if snapshots:
        print_snapshots(snapshots, console)
    bare_ms = statistics.median(x.seconds_per_step for x in results[BASELINE]) * 1e3
    outcome = print_summary(bare_ms, paired, timer.per_step(), reads, snapshots)
    if not args.strict or outcome == "within the budget":
        return 0
    return 1 if outcome == "over the budget" else 2


if __name__ == "__main__":
    sys.exit(main())
