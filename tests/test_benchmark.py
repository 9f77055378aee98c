"""The overhead benchmark reports what the trajectory control costs: the snapshot's per-step share (one copy's
time over the steps between snapshots), with snapshots on and off, on a real healthy fp16 run. Fields and
printed lines are asserted, never timings: the budget is shown by the benchmark itself, on a quiet machine."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from types import ModuleType
from typing import Iterator

import lightning.pytorch as pl
import pytest
from _scripts import loaded_script
import torch

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "overhead.py"
VERDICTS = ("within the budget", "over the budget", "inconclusive")


@pytest.fixture(scope="module")
def overhead() -> Iterator[ModuleType]:
    with loaded_script(BENCHMARK, "ampwatch_overhead_benchmark") as module:
        yield module


@pytest.fixture(scope="module")
def toy_cost(overhead: ModuleType) -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        overhead._quiet()
        # the window starts once "auto" and the log cadence have decided, holds three snapshots and two log steps
        # that do their work; 6 pairs of 10 steps
        cost, _ = overhead.measure_workload(overhead.TOY, pairs=6, steps=60, warmup=25, seed=0, block=10)
    finally:
        torch.set_num_threads(threads)
    return cost


def test_the_snapshots_per_step_share_is_reported(overhead: ModuleType, toy_cost: object,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cost = toy_cost
    assert cost.snapshot_every >= 20 and cost.snapshot_every % 20 == 0  # "auto": 20, or lengthened by the cadence
    assert cost.snapshot_copy_ms is not None and cost.snapshot_copy_ms > 0 and cost.snapshot_bytes > 0
    assert cost.bare_step_ms > 0 and math.isfinite(cost.bare_step_ms)
    assert cost.snapshot_us_per_step == pytest.approx(cost.snapshot_copy_ms * 1e3 / cost.snapshot_every)
    assert cost.snapshot_share == pytest.approx(cost.snapshot_us_per_step / (cost.bare_step_ms * 1e3))
    outcome = overhead.print_summary([cost], None)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "the snapshot's per-step share" in x)
    assert f"one copy {cost.snapshot_copy_ms:.3f} ms" in line and f"every {cost.snapshot_every} steps" in line
    assert f"{cost.snapshot_us_per_step:.1f} us per step = {cost.snapshot_share:.2%} of a bare step" in line
    assert outcome == cost.verdict() and outcome.startswith(VERDICTS)


def test_snapshots_on_and_off_each_get_a_verdict(toy_cost: object) -> None:
    # the toy's step as on a quiet machine (a loaded one can stretch it past 5 ms, which the test must not see)
    cost = dataclasses.replace(toy_cost, bare_step_ms=1.0, bare_cpu_step_ms=1.0)
    assert len(cost.snapshots_on.wall) == len(cost.snapshots_on.cpu) == 6
    assert len(cost.snapshots_off.wall) == len(cost.snapshots_off.cpu) == 6
    assert all(r > 0 for r in cost.snapshots_on.wall + cost.snapshots_off.wall)
    lines = "\n".join(cost.lines())
    for label in ("snapshots on ", "snapshots off"):
        assert f"  {label}" in lines
    # the toy's step is under 5 ms: one verdict, by the absolute budgets; each block's ratio for information
    assert lines.count("verdict ") == 1 and cost.verdict(False).startswith(VERDICTS)
    assert lines.count("    ratio           for information only (a step under 5 ms): ") == 2
    # the garbage collections in each side's timed blocks, which no hook's own time includes
    for paired in (cost.snapshots_on, cost.snapshots_off):
        (on, off), (on_s, off_s) = paired.gc_per_1000, paired.gc_s_per_step
        assert min(on, off, on_s, off_s) >= 0
        assert f"collections: {on:.1f} per 1000 steps on, {off:.1f} off" in lines
    assert cost.hooks_us > cost.ordinary_us > 0 and cost.saw_log_step  # log and snapshot steps spread in


def test_the_null_run_shows_the_machines_own_spread(overhead: ModuleType, toy_cost: object) -> None:
    """Both sides of every pair bare: the ratios spread around 1 by the machine alone; when that spread reaches past
    the budget, the summary says the verdict could not find any watch within it here, and when it reaches below, that
    the ratios can be off by as much."""
    cost = toy_cost
    assert cost.null is not None and len(cost.null.wall) == len(cost.null.cpu) == 6
    lines = cost.lines()
    assert any(line.startswith("  null run          6 pairs of blocks, both bare") for line in lines)
    cis = [overhead.median_interval(cost.null.wall), overhead.median_interval(cost.null.cpu)]
    assert all(ci is not None for ci in cis)  # six pairs are enough for a 95% interval of the median
    high = any(ci[1] > overhead.BUDGET for ci in cis)
    low = not high and any(ci[0] < 2 - overhead.BUDGET for ci in cis)
    assert any("even a watch that cost nothing could not be found" in line for line in lines) == high
    assert any("the blocks alone differ by more than the budget's 1% here" in line for line in lines) == low


def test_the_log_step_is_reported_at_the_log_cadences_interval(toy_cost: object) -> None:
    cost = toy_cost
    line = next(x for x in cost.lines() if x.startswith("  hooks' own time"))
    assert f"a log step adds {cost.log_step_extra_us:.0f} us, once in {cost.judge_every}" in line
    # the timed window starts once the cadences have decided (the log cadence times log steps from step 300 on):
    # the interval they chose, a multiple of log_every, with the metrics-only steps named when it is longer
    assert cost.judge_every % cost.log_every == 0
    assert ("log the metrics only" in line) == (cost.judge_every != cost.log_every)


def test_only_takes_the_names_with_or_without_parentheses(overhead: ModuleType) -> None:
    assert overhead.configuration_name("AmpWatch") == overhead.configuration_name("AmpWatch()") == "AmpWatch()"
    assert overhead.configuration_name("detect_anomaly") == "detect_anomaly=True"
    with pytest.raises(argparse.ArgumentTypeError, match="'AmpWatch\\(\\)'"):
        overhead.configuration_name("ampwatch")


def test_pairs_default_to_about_the_same_time_per_verdict_on_any_step(overhead: ModuleType) -> None:
    # a sub-millisecond step gets enough pairs for an interval of about a point and a half; a slow step the floor
    assert overhead.auto_pairs(0.0007, 50) == 214
    assert overhead.auto_pairs(0.014, 50) == overhead.MIN_PAIRS == 30
    assert overhead.auto_pairs(0.00005, 50) == overhead.MAX_PAIRS
    assert overhead.auto_pairs(float("nan"), 50) == overhead.MIN_PAIRS
    with pytest.raises(SystemExit):  # an explicit count below one is refused, as before
        overhead.main(["--pairs", "0"])


def test_verdict_seconds_buy_a_longer_verdict_and_verdicts_pick_the_runs(overhead: ModuleType, toy_cost: object,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # ten minutes of blocks on a 15.5 ms step: the 400-odd pairs a verdict against 1% needs there; the cap grows
    # with the time asked for, the floor does not move
    assert overhead.auto_pairs(0.0155, 50, seconds=600) == 387
    assert overhead.auto_pairs(0.00005, 50, seconds=600) == 40 * overhead.MAX_PAIRS
    assert overhead.auto_pairs(0.014, 50, seconds=1) == overhead.MIN_PAIRS
    for bad in (["--verdict-seconds", "0"], ["--verdict-seconds", "nan"], ["--verdicts", "bare"]):
        with pytest.raises(SystemExit):
            overhead.main(bad)
    assert "--verdict-seconds" in capsys.readouterr().err
    # a workload measured with the defaults' run alone: its block says nothing of the runs not made
    only_on = dataclasses.replace(toy_cost, snapshots_off=None, null=None)
    lines = "\n".join(only_on.lines())
    assert "  snapshots on " in lines and "snapshots off" not in lines and "null run" not in lines
    assert lines.count("verdict ") == 1 and only_on.verdict() == toy_cost.verdict()
    assert only_on.verdict(False) == "not measured (--verdicts)"
    assert overhead.print_summary([only_on], None) == toy_cost.verdict()


def test_model_takes_a_module_a_class_or_a_factory(overhead: ModuleType) -> None:
    cls = overhead.user_workload("lightning_ampwatch.scenarios:Regressor")
    assert isinstance(cls.module(), pl.LightningModule) and cls.data is None
    made = overhead.user_workload(f"{overhead.__name__}:WideMLP")
    first, second = made.module(), made.module()
    assert isinstance(first, pl.LightningModule) and first is not second
    with pytest.raises(ValueError, match="package.module:attr"):
        overhead.user_workload("lightning_ampwatch.scenarios")
    with pytest.raises(TypeError, match="expected a LightningModule"):
        overhead.user_workload("math:pi")
    with pytest.raises(TypeError, match="not a LightningModule"):
        overhead.user_workload("collections:OrderedDict").module()


def test_the_interval_reported_is_the_one_in_force_not_a_median_spacing(overhead: ModuleType) -> None:
    """"auto" snapshots 20 steps apart until it chooses, say 120: a window holding both used to report the median
    spacing of 20, 20, 40 and 120 steps, "every 30", an interval no run had."""
    timer = overhead._HookTimer(0, 300, None)
    timer.snapshot_batches = {-1, 40, 60, 80, 120, 240}
    timer.every = 120
    assert timer.snapshot_interval() == 120


def test_the_on_off_blocks_start_once_the_cadence_has_chosen(overhead: ModuleType) -> None:
    """The "auto" cadence times its first snapshots against the steps between them: the on/off run keeps the watch
    on until it has chosen (blocks switched off among those steps stretched its spans, the interval chosen then
    depended on the toggling), and only then starts its blocks."""
    from lightning_ampwatch import AmpWatch

    watch = AmpWatch(verbose=False)
    seen: list[tuple[int, bool, bool]] = []  # per batch: (batch, watch off, interval settled)

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            seen.append((len(seen), watch.watcher.disabled, overhead.cadence_settled(watch)))

    toggle = overhead.BlockToggle(watch, 10, blocks=6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pl.seed_everything(0, verbose=False)
        import tempfile
        with tempfile.TemporaryDirectory() as root:
            trainer = overhead.healthy_trainer(root, 400, [toggle, watch, Look()], log_every_n_steps=10)
            overhead.TOY.fit(trainer, 0)
    finally:
        torch.set_num_threads(threads)
    assert toggle.settled_at is not None and toggle.settled_at >= 60  # three timed snapshots, 20 steps apart
    assert not any(off for _, off, settled in seen if not settled)  # never off before the choice
    assert all(settled for batch, _, settled in seen if batch >= toggle.settled_at)
    assert any(off for _, off, _ in seen)  # and toggled after it
    assert len(toggle.ends) == 6 and len(seen) < 400  # the run stopped once its blocks were timed


def test_a_short_step_is_judged_by_the_absolute_budgets_a_long_one_by_its_ratio(toy_cost: object,
                                                                               overhead: ModuleType) -> None:
    """The arithmetic on recorded figures (no clock): under 5 ms a step is judged by an ordinary step's hooks (8 us),
    a log step's extra (400 us) and the snapshot's share (0.5%); from 5 ms on by the on/off blocks' ratio."""
    # the snapshot: 0.09 ms every 20 steps, 4.5 us a step, 0.45% of a 1 ms step
    short = dataclasses.replace(toy_cost, bare_step_ms=1.0, bare_cpu_step_ms=1.0, ordinary_us=7.9,
                                log_step_extra_us=399.0, snapshot_copy_ms=0.09, snapshot_every=20,
                                handover_share=1 / 64, handover_extra_us=350.0)  # every figure the verdict reads
    assert not short.judged_by_ratio and short.verdict() == "within the budget"
    over = dataclasses.replace(short, ordinary_us=9.25, log_step_extra_us=401.0, snapshot_copy_ms=0.2)
    assert over.verdict() == ("over the budget: an ordinary step's hooks take 9.2 us (budget 8); a log step adds "
                              "401 us (budget 400); the snapshot's share is 1.00% (budget 0.5%)")
    assert over.verdict(False) == ("over the budget: an ordinary step's hooks take 9.2 us (budget 8); a log step "
                                   "adds 401 us (budget 400)")  # snapshots off: no snapshot's share to judge
    # a hand-over step (the held steps taken in between log steps) is held to the log step's budget
    handed = dataclasses.replace(short, handover_extra_us=401.0)
    assert handed.verdict() == "over the budget: a hand-over step adds 401 us (budget 400, as a log step's)"
    assert dataclasses.replace(handed, handover_extra_us=399.0).verdict() == "within the budget"
    assert dataclasses.replace(handed, handover_share=0.0).verdict() == "within the budget"  # none in the window
    lines = "\n".join(over.lines())
    assert "  budgets           a step under 5 ms is judged by absolute figures" in lines
    assert f"    verdict         {over.verdict()}" in lines
    # a step of 5 ms or more: the ratio's verdict, whatever the absolute figures
    long = dataclasses.replace(over, bare_cpu_step_ms=5.0)
    assert long.judged_by_ratio and long.verdict() == long.ratio_verdict() and long.verdict().startswith(VERDICTS)
    lines = "\n".join(long.lines())
    assert "budgets" not in lines and "for information only" not in lines
    assert not dataclasses.replace(over, bare_step_ms=6.0, bare_cpu_step_ms=1.5).judged_by_ratio  # by CPU time
    assert lines.count(f"(budget {overhead.BUDGET:.2f}; 95% CI, both clocks)") == 2


def test_a_hand_over_step_is_a_kind_of_its_own_and_counts_in_the_hooks_time(overhead: ModuleType) -> None:
    """Between two log steps, the step where the watch takes in the healthy steps it held back (at most 64 of them)
    costs far more than an ordinary one: the timer tells it apart (an ordinary step's median would hide it) and
    spreads its extra over the steps, as it does a log step's."""
    timer = overhead._HookTimer(0, 300, None)
    timer.handover_batches = {63, 99, 127}  # (99 is a log step: a log step it stays)
    timer.calls = {"on_train_batch_end": [(b, 201e-6 if b in (63, 127) else 1e-6) for b in range(128)]}
    assert [timer.kind(b) for b in (62, 63, 99, 127)] == ["ordinary", "handover", "log", "handover"]
    assert timer.handover_share() == pytest.approx(2 / 128)
    total, logged = timer.per_step()
    assert logged and total == pytest.approx(1e-6 + 200e-6 * 2 / 128)
