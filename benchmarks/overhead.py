"""How much does ``AmpWatch()`` cost a healthy fp16 run? Set beside ``detect_anomaly`` and ``SpikeDetection``.

Run it from the repository root::

    python benchmarks/overhead.py             # the full comparison (about a minute on 2 CPU cores)
    python benchmarks/overhead.py --quick     # a smoke run (under 30 seconds): the table, too short for a verdict
    python benchmarks/overhead.py --steps 500 --rounds 7 --strict   # longer; exit 1 if AmpWatch is over budget
    python benchmarks/overhead.py --profile   # then: where AmpWatch's per-step time goes (wall clock, cProfile)

Every configuration trains the same small MLP (``scenarios.Regressor``) on the CPU with real float16 autocast
and a real default GradScaler (``scenarios.true_fp16_plugin``), from the same seed, one torch thread: a healthy
run, whose scale settles in the warm-up, so this is the price a user pays on every step while nothing is wrong.
The configurations run interleaved (round 1: A B C D, round 2: B C D A, ...) so that drift in the machine's
speed hits all of them alike.

One timing callback, identical in every configuration, stamps the start of every batch. After ``--warmup``
steps, ``--steps`` full iterations are measured (every hook of every callback included) in blocks of 50 steps,
Lightning's logging interval, so each block holds exactly one log step; a run's per-step time is its fastest
block's time per step (load from elsewhere on the machine only adds time, so the fastest block is the best
estimate of a configuration's own cost, as in ``timeit``).
No logger is attached (less file I/O noise); AmpWatch still logs its metrics through ``LightningModule.log`` at
each log step, so that cost is counted. The table gives, per configuration, the median over rounds of its
per-step time divided by the bare run's in the same round, by wall clock and by the process's CPU time (which
a busy machine disturbs far less: with one torch thread and no loader workers, the run is CPU-bound in this
process), the ratio of the fastest run of each configuration to the fastest bare run (the least disturbed
pair, for a busy machine), and the number of steps the scaler skipped inside the measured window (0 for a
healthy run). The budget for ``AmpWatch()`` is a median ratio of at most 1.01 on both clocks.

To compare another set-up (say, AmpWatch with probes armed), add an entry to ``CONFIGURATIONS``: a name mapped
to a function of the run's directory that returns a ``Setup`` (callbacks and extra ``Trainer`` arguments).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import logging
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks.spike import SpikeDetection
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin

BATCH_SIZE = 32
LOG_EVERY_N_STEPS = 50  # Lightning's default, set explicitly: AmpWatch logs its metrics at these steps
DATASET_ROWS = 32 * 1024  # the same data whatever --steps says; longer runs go round it again
BUDGET = 1.01  # AmpWatch() on a healthy run: at most 1% slower per step than the bare run
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
    model = Regressor()
    data = DataLoader(regression_data(n=DATASET_ROWS, seed=seed), batch_size=BATCH_SIZE, shuffle=False)
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=total_steps, plugins=[true_fp16_plugin()], logger=False,
        default_root_dir=root_dir, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, log_every_n_steps=LOG_EVERY_N_STEPS, callbacks=[clock, *setup.callbacks],
    )
    kwargs.update(setup.trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    gc.collect()
    trainer.fit(model, data)
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


def print_table(results: dict[str, list[RunResult]], steps: int, rounds: int, console: Console) -> bool:
    """The result table; returns whether AmpWatch() kept to its budget (by wall clock and by CPU time)."""
    wall, cpu = ratios(results), ratios(results, cpu=True)
    table = Table(title=f"Per-step time against the bare run ({rounds} rounds x {steps} steps, true fp16 on CPU)")
    table.add_column("configuration", no_wrap=True)
    table.add_column("ms/step", justify="right")  # median over rounds, wall clock
    table.add_column("ratio", justify="right")  # wall clock, median over rounds: the figure the budget is about
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
    ok = True
    if WATCHED in wall:
        by_wall, by_cpu = statistics.median(wall[WATCHED]), statistics.median(cpu[WATCHED])
        ok = by_wall <= BUDGET and by_cpu <= BUDGET
        verdict = "within" if ok else "OVER"
        console.print(f"{WATCHED}: median ratio {by_wall:.3f} (wall clock), {by_cpu:.3f} (CPU time); "
                      f"{verdict} the budget of {BUDGET:.2f}.")
    return ok


# ---------------------------------------------------------------- the verdict: paired blocks in one run


class BlockToggle(pl.Callback):
    """Switches one AmpWatch on and off every ``block`` steps within a single run, stamping each batch.

    Separate runs on a shared 2-core machine drift by tens of percent from run to run, far more than the 1% this
    budget is about. Neighbouring blocks of one run see the same machine, so each on/off pair gives a ratio that
    drift barely touches; the order inside a pair alternates so that neither side always runs first. "Off" is
    AmpWatch absent in all but name: its hooks return at once and its optimizer and clipping hooks are removed;
    switching on again re-reads the scaler (as at train start), so it watches a healthy run correctly.
    """

    def __init__(self, watch: AmpWatch, block: int) -> None:
        self.watch, self.block = watch, block
        self.stamps: list[float] = []
        self.on: list[bool] = []  # per block: was AmpWatch on

    def _set(self, trainer: pl.Trainer, pl_module: pl.LightningModule, on: bool) -> None:
        watch = self.watch
        if on and watch._disabled:
            watch._disabled = False
            watch._steps.attach(trainer.optimizers)
            watch._attach_guards(trainer, pl_module)
            watch.on_train_start(trainer, pl_module)
        elif not on and not watch._disabled:
            watch._disabled = True
            watch._steps.detach()
            watch._guards.detach()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = len(self.stamps)
        self.stamps.append(time.perf_counter())
        if step % self.block == 0:
            index = step // self.block
            pair, second = divmod(index, 2)
            on = (second == 0) if pair % 2 == 0 else (second == 1)  # on/off, then off/on, ...
            self.on.append(on)
            self._set(trainer, pl_module, on)

    def pair_ratios(self, skip_blocks: int) -> list[float]:
        times = [(self.stamps[(i + 1) * self.block] - self.stamps[i * self.block], on)
                 for i, on in enumerate(self.on) if (i + 1) * self.block < len(self.stamps)]
        out = []
        for i in range(skip_blocks - skip_blocks % 2, len(times) - 1, 2):
            (t1, on1), (t2, _) = times[i], times[i + 1]
            watched, bare = (t1, t2) if on1 else (t2, t1)
            out.append(watched / bare)
        return out


def paired_blocks(pairs: int, seed: int, block: int = LOG_EVERY_N_STEPS) -> list[float]:
    """AmpWatch on against off in alternating blocks of one healthy run; the per-pair time ratios."""
    watch = AmpWatch(verbose=False)
    toggle = BlockToggle(watch, block)
    warm_blocks = 2
    total = (2 * pairs + warm_blocks) * block + 1
    pl.seed_everything(seed, verbose=False)
    with tempfile.TemporaryDirectory(prefix="ampwatch-pairs-") as root:
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=total, plugins=[true_fp16_plugin()], logger=False,
            default_root_dir=root, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, log_every_n_steps=LOG_EVERY_N_STEPS, callbacks=[toggle, watch],
        )
        gc.collect()
        trainer.fit(Regressor(), DataLoader(regression_data(n=DATASET_ROWS, seed=seed), batch_size=BATCH_SIZE))
    return toggle.pair_ratios(warm_blocks)


def print_paired(ratios_: list[float], console: Console) -> bool:
    median = statistics.median(ratios_)
    quartiles = statistics.quantiles(ratios_, n=4) if len(ratios_) >= 4 else [min(ratios_), median, max(ratios_)]
    ok = median <= BUDGET
    console.print(f"{WATCHED} against no AmpWatch, {len(ratios_)} pairs of {LOG_EVERY_N_STEPS}-step blocks in one "
                  f"run: median ratio [bold]{median:.4f}[/bold] (quartiles {quartiles[0]:.4f}..{quartiles[-1]:.4f}); "
                  f"{'within' if ok else 'OVER'} the budget of {BUDGET:.2f}.")
    return ok


def armed_cost(seed: int, repeats: int = 5) -> tuple[float, float]:
    """What one armed episode costs: the probes' replay under autocast plus the FP32 control on one batch (ms),
    against one training step (ms). It runs at most once per episode, never on a healthy step."""
    from lightning_ampwatch.probes import MicroBatch

    watch = AmpWatch(verbose=False)
    clock = StepClock()
    pl.seed_everything(seed, verbose=False)
    data = DataLoader(regression_data(n=DATASET_ROWS, seed=seed), batch_size=BATCH_SIZE)
    with tempfile.TemporaryDirectory(prefix="ampwatch-armed-") as root:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=60, plugins=[true_fp16_plugin()], logger=False,
                             default_root_dir=root, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[clock, watch])
        trainer.fit(Regressor(), data)
        assert watch._investigator is not None
        batch = next(iter(data))
        timings = []
        for _ in range(repeats):
            start = time.perf_counter()
            watch._investigator.collect([MicroBatch(batch, 0)], scale=2.0**16, fault_ranks=[0],
                                        weights_stepped=False, loss_level=None)
            timings.append(time.perf_counter() - start)
    step = per_step_time(clock.stamps[10:], 25)
    return statistics.median(timings) * 1e3, step * 1e3


# ---------------------------------------------------------------- where AmpWatch's time goes

# Lightning's hooks that run on every training step; those AmpWatch overrides are the ones profiled.
PER_STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                  "on_before_zero_grad", "on_train_batch_end")


def profile_watch(steps: int, warmup: int, seed: int, top: int = 30) -> None:
    """Where AmpWatch's time goes: its per-step hooks timed by wall clock, then the same run under cProfile.

    Only the measured window counts (warm-up steps are left out, as in the timing). Every per-step Lightning
    hook AmpWatch overrides is included, and so are the optimizer step hooks it registers (``StepTaken``). The
    wall-clock pass gives the hooks' own cost per call, as medians (robust to load from elsewhere), for ordinary
    steps and for log steps apart; the cProfile pass (which inflates everything) says where that time goes.
    """
    with tempfile.TemporaryDirectory(prefix="ampwatch-profile-") as root:
        bare = train_once(BASELINE, steps, warmup, seed, root)
        timing = _HookTimer(warmup, steps, None)
        train_once(WATCHED, steps, warmup, seed, root, timing.instrument)
        profiler = cProfile.Profile()
        train_once(WATCHED, steps, warmup, seed, root, _HookTimer(warmup, steps, profiler).instrument)
    print(f"\nAmpWatch's hooks, wall clock without a profiler, {steps} steps after {warmup} warm-up "
          f"(median us per call):")
    print(f"  {'hook':<30} {'ordinary step':>14} {'log step':>10}")
    estimate = 0.0
    for hook, (ordinary, logged) in timing.medians().items():
        estimate += ordinary + (logged - ordinary) / LOG_EVERY_N_STEPS
        print(f"  {hook:<30} {ordinary * 1e6:14.1f} {logged * 1e6:10.1f}")
    print(f"  per step, log steps spread over {LOG_EVERY_N_STEPS}: {estimate * 1e6:.1f} us = "
          f"{estimate / bare.seconds_per_step:.2%} of a bare step ({bare.seconds_per_step * 1e6:.0f} us)")
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_callees("on_train_batch_end|on_before_optimizer_step|_resolve")
    print(f"\ncProfile of the same hooks (inflated by the profiler):\n{out.getvalue()}")


class _HookTimer:
    """Wraps AmpWatch's per-step hooks on one instance: wall time per call, and cProfile switched on inside."""

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

    def instrument(self, setup: Setup, clock: StepClock) -> None:
        self.clock = clock
        for cb in setup.callbacks:
            if isinstance(cb, AmpWatch):
                for hook in PER_STEP_HOOKS:
                    if getattr(type(cb), hook) is not getattr(pl.Callback, hook):
                        setattr(cb, hook, self._wrap(hook, getattr(cb, hook)))
                step_hooks = getattr(cb, "_steps", None)  # internal: the optimizer step pre/post hooks
                for name in ("_pre", "_post"):
                    if step_hooks is not None and hasattr(step_hooks, name):
                        setattr(step_hooks, name, self._wrap(f"optimizer step {name}", getattr(step_hooks, name)))
                guards = getattr(cb, "_guards", None)  # internal: the recipe guard's optimizer step pre-hook
                if guards is not None and hasattr(guards, "_before_optimizer_step"):
                    guards._before_optimizer_step = self._wrap("recipe guard step pre-hook",
                                                               guards._before_optimizer_step)


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
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, two rounds, no verdict")
    parser.add_argument("--profile", action="store_true", help="then profile AmpWatch's hooks with cProfile")
    parser.add_argument("--only", nargs="+", choices=list(CONFIGURATIONS), default=None,
                        help=f"measure only these configurations ({BASELINE!r} is always included)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when AmpWatch() is over its budget")
    parser.add_argument("--pairs", type=int, default=None, help="on/off block pairs for the verdict (default 24; "
                        "--quick 2)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (40 if args.quick else 300)
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (20 if args.quick else 30)
    for flag, value, low in (("--steps", steps, 1), ("--rounds", rounds, 1), ("--warmup", warmup, 0)):
        if value < low:
            parser.error(f"{flag}={value} is not valid; use an integer >= {low}")
    names = list(CONFIGURATIONS) if args.only is None else [BASELINE] + [n for n in args.only if n != BASELINE]

    _quiet()
    torch.set_num_threads(1)  # one thread: less scheduling noise, and the same for every configuration
    console = Console(width=120, highlight=False)
    console.print(f"torch {torch.__version__}, lightning {pl.__version__}, 1 thread; {len(names)} configurations, "
                  f"{rounds} rounds x {steps} steps (+{warmup} warm-up)")
    results = measure(steps, rounds, warmup, args.seed, names, console)
    print_table(results, steps, rounds, console)
    console.print("[dim](separate runs drift with the machine; the verdict below compares neighbouring blocks of "
                  "one run)[/dim]")
    pairs = args.pairs if args.pairs is not None else (2 if args.quick else 24)
    ok = print_paired(paired_blocks(pairs, args.seed), console)
    armed_ms, step_ms = armed_cost(args.seed)
    console.print(f"Armed probes: one episode's replay with probes plus the FP32 control costs {armed_ms:.2f} ms "
                  f"({armed_ms / step_ms:.1f} training steps of {step_ms:.2f} ms), once per episode, never on a "
                  "healthy step.")
    if args.quick:
        console.print("[dim](--quick: too few steps for a verdict on the budget)[/dim]")
    if args.profile:
        profile_watch(steps, warmup, args.seed)
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    sys.exit(main())
