"""The overhead benchmark reports what the trajectory control costs: the snapshot's per-step share (one copy's
time over the steps between snapshots), with snapshots on and off, on a real healthy fp16 run. Fields and
printed lines are asserted, never timings: the budget is shown by the benchmark itself, on a quiet machine."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator

import lightning.pytorch as pl
import pytest
import torch

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "overhead.py"
VERDICTS = ("within the budget", "over the budget", "inconclusive")


@pytest.fixture(scope="module")
def overhead() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("ampwatch_overhead_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(scope="module")
def toy_cost(overhead: ModuleType) -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        overhead._quiet()
        # after the scale settles (skips at first: no snapshot then), 60 timed steps hold snapshots after steps
        # 40, 60 and 80 (or fewer, the cadence lengthening the interval) and the log step 49; 6 pairs of 10 steps
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
    outcome = overhead.print_summary([cost], None, [])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "the snapshot's per-step share" in x)
    assert f"one copy {cost.snapshot_copy_ms:.3f} ms" in line and f"every {cost.snapshot_every} steps" in line
    assert f"{cost.snapshot_us_per_step:.1f} us per step = {cost.snapshot_share:.2%} of a bare step" in line
    assert outcome == cost.verdict() and outcome.startswith(VERDICTS)


def test_snapshots_on_and_off_each_get_a_verdict(toy_cost: object) -> None:
    cost = toy_cost
    assert len(cost.snapshots_on.wall) == len(cost.snapshots_on.cpu) == 6
    assert len(cost.snapshots_off.wall) == len(cost.snapshots_off.cpu) == 6
    assert all(r > 0 for r in cost.snapshots_on.wall + cost.snapshots_off.wall)
    lines = "\n".join(cost.lines())
    for label in ("snapshots on ", "snapshots off"):
        assert f"  {label}" in lines
    assert lines.count("verdict ") == 2 and cost.verdict(False).startswith(VERDICTS)
    assert cost.hooks_us > cost.ordinary_us > 0 and cost.saw_log_step  # log and snapshot steps spread in


def test_only_takes_the_names_with_or_without_parentheses(overhead: ModuleType) -> None:
    assert overhead.configuration_name("AmpWatch") == overhead.configuration_name("AmpWatch()") == "AmpWatch()"
    assert overhead.configuration_name("detect_anomaly") == "detect_anomaly=True"
    with pytest.raises(argparse.ArgumentTypeError, match="'AmpWatch\\(\\)'"):
        overhead.configuration_name("ampwatch")


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
