"""The snapshot cadence: an interval chosen from a snapshot's measured cost, at most a fixed share of the steps it
spans. The policy is pure (unit tests); one real run checks that AmpWatch's default ``snapshot_every="auto"``
applies what the policy decides from the times it measured, and leaves an explicit interval alone."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.steps.cadence import MAX_INTERVAL, SNAPSHOT_FRACTION, SnapshotCadence, snapshot_interval
from lightning_ampwatch.scenarios import Regressor, regression_data
from lightning_ampwatch.trajectory import control as control_module
from lightning_ampwatch.trajectory.control import TrajectoryControl
from lightning_ampwatch.trajectory.ring import SnapshotRing
from lightning_ampwatch.trajectory.state import TrainState

from conftest import make_trainer


def test_the_interval_spreads_a_copy_over_enough_steps() -> None:
    # 2 ms a copy, 1 ms a step, 0.25%: the copy must be spread over 800 steps; a multiple of 20 is 800
    assert snapshot_interval(2e-3, 1e-3, 20) == 800
    assert snapshot_interval(2.1e-3, 1e-3, 20) == 840  # 840 steps: the next multiple of 20
    assert 2.1e-3 / (840 * 1e-3) <= SNAPSHOT_FRACTION < 2.1e-3 / (820 * 1e-3)
    # the fraction is a parameter: at 0.5% the same copy needs half the steps
    assert snapshot_interval(2e-3, 1e-3, 20, fraction=0.005) == 400


def test_a_cheap_copy_keeps_the_interval_asked_for() -> None:
    assert snapshot_interval(1e-5, 1e-3, 20) == 20  # 0.05% at every 20 steps: nothing to lengthen
    assert snapshot_interval(0.0, 1e-3, 20) == 20
    assert snapshot_interval(float("nan"), 1e-3, 20) == 20 and snapshot_interval(1e-3, float("inf"), 20) == 20


def test_the_interval_is_capped() -> None:
    assert snapshot_interval(10.0, 1e-3, 20) == MAX_INTERVAL  # 2,000,000 steps wanted; the cap holds
    assert snapshot_interval(10.0, 1e-3, 20, max_interval=130) == 120  # a multiple of 20 within the cap
    assert snapshot_interval(10.0, 1e-3, 50, max_interval=30) == 50  # never shorter than asked
    with pytest.raises(ValueError, match="every"):
        snapshot_interval(1e-3, 1e-3, 0)


def test_the_cadence_decides_once_from_the_fastest_measures() -> None:
    cadence = SnapshotCadence(20)
    assert cadence.observe(5e-3, None, 0) is None  # the first: buffers allocated, no span yet
    assert cadence.observe(4e-3, 20 * 1e-3 + 4e-3, 20) is None and not cadence.decided
    said = cadence.observe(2e-3, 20 * 1.5e-3 + 2e-3, 20)  # steps of 1 ms and 1.5 ms: the faster counts
    assert cadence.decided and cadence.every == 800  # 2 ms / (0.25% x 1 ms)
    assert said is not None and "every 800 steps instead of every 20" in said and "0.25%" in said
    assert cadence.observe(1.0, 1.0, 800) is None and cadence.every == 800  # decided for the run


def test_the_cadence_says_nothing_when_the_interval_stays() -> None:
    cadence = SnapshotCadence(20)
    for span in (None, 0.02, 0.02):
        said = cadence.observe(1e-5, span, 0 if span is None else 20)
    assert cadence.decided and cadence.every == 20 and said is None


def test_the_memory_budget_bounds_the_interval() -> None:
    cadence = SnapshotCadence(20)
    for span in (None, 0.03, 0.03):  # 20 steps of 1 ms, and the 10 ms copy
        said = cadence.observe(1e-2, span, 0 if span is None else 20, room_steps=100)
    assert cadence.every == 100  # 10 ms a copy on 1 ms steps wants 2000 steps; the batches of 100 fit
    assert said is not None and "still take 10.00%" in said and "snapshot_every=0" in said


def test_the_cadence_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="every"):
        SnapshotCadence(0)
    with pytest.raises(ValueError, match="fraction"):
        SnapshotCadence(20, fraction=1.5)


class _KeepControl(Callback):
    """Keeps AmpWatch's trajectory control at train end (the fit's end lets it go)."""

    def __init__(self, watch: AmpWatch) -> None:
        self.watch, self.control = watch, None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.control = self.watch.watcher.trajectory


def _fit(tmp_path: Path, watch: AmpWatch, steps: int) -> Any:
    keep = _KeepControl(watch)
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [watch, keep], "fp16", {"init_scale": 2.0**10, "growth_interval": 1000},
                           max_steps=steps)
    trainer.fit(Regressor(), DataLoader(regression_data(n=2048), batch_size=32))
    assert watch.diagnoses == []
    return keep.control


def test_auto_applies_the_policy_to_the_times_it_measured(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):  # where Lightning's rank-zero lines go
        control = _fit(tmp_path, AmpWatch(verbose=False), 61)  # snapshots after steps 0, 20, 40: then decided
    cadence = control.cadence
    assert cadence is not None and cadence.decided and len(cadence.copies) == 3 and len(cadence.steps) == 2
    expected = snapshot_interval(min(cadence.copies), min(cadence.steps), 20)
    assert cadence.every == control.ring.every == expected
    said = [r.getMessage() for r in caplog.records if "A snapshot takes" in r.getMessage()]
    assert said == ([] if expected == 20 else [said[0]])  # said once, when the interval changes
    if said:
        assert said[0].startswith("AmpWatch: A snapshot takes ")
        assert f"every {expected} steps instead of every 20" in said[0]


def test_an_explicit_interval_is_kept(tmp_path: Path) -> None:
    control = _fit(tmp_path, AmpWatch(verbose=False, snapshot_every=5), 31)
    assert control.cadence is None and control.ring.every == 5
    assert [s.step for s in control.ring.snapshots] == [25, 30]


def test_auto_times_the_whole_snapshot_step_over_an_ordinary_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control's clock scripted: ordinary steps of 1 ms, and steps that end in a snapshot 5 ms longer although
    the copy itself takes no time on that clock (a cold cache, the allocations that follow it). The cadence counts
    the 5 ms, not the copy alone; the first snapshot (no ordinary step before it) only starts the span."""
    now, said, control = _scripted_control(monkeypatch)
    for step in range(61):
        now[0] += 1e-3 + (5e-3 if step and step % 20 == 0 else 0.0)
        control.note_step(step, [(torch.zeros(4), step)], True, True)
    cadence = control.cadence
    assert cadence is not None and cadence.decided
    assert cadence.copies == pytest.approx([5e-3] * 3)
    assert cadence.steps == pytest.approx([1e-3] * 2)  # the spans' steps, the snapshot's extra taken off
    assert cadence.every == control.ring.every == snapshot_interval(5e-3, 1e-3, 20) == 1000
    assert said and "every 1000 steps instead of every 20" in said[0]


def test_a_longer_interval_keeps_the_snapshots_until_the_next_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the cadence lengthens the interval, the ring holds the batches of as many steps as the new interval
    needs: its bound on held steps was the first interval's (20 x 4), so a healthy run's snapshots were let go 80
    steps after each one ("a long stretch of trouble") and the FP32 control had none to replay from."""
    now, _, control = _scripted_control(monkeypatch)
    for step in range(1201):
        now[0] += 1e-3 + (5e-3 if step and step % 20 == 0 and step <= 60 else 0.0)
        control.note_step(step, [(torch.zeros(4), step)], True, True)
        if step == 999:  # the longest wait: the newest snapshot is the one taken before the interval changed
            assert control.ring.dropped is None and [s.step for s in control.ring.snapshots] == [40, 60]
    assert control.ring.every == 1000
    assert control.ring.dropped is None
    assert [s.step for s in control.ring.snapshots] == [60, 1000]
    assert [step for step, _ in control.ring.batches(61, 1200)] == list(range(61, 1201))


def test_auto_sets_the_copy_against_the_median_step_not_a_mean_that_load_inflates(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The control's clock scripted: ordinary steps of 1 ms but for one step in each span that load from elsewhere
    stretched to 41 ms (the mean step of a 20-step span is then 3 ms), and snapshot steps 2 ms longer. The
    healthy step is the span's median, 1 ms: the copy of 2 ms is spread over 800 steps (2 ms / (0.25% x 1 ms)).
    Against the inflated mean the interval would be 280 steps, and snapshots would take 0.71% of a quiet run."""
    now, said, control = _scripted_control(monkeypatch)
    for step in range(61):
        now[0] += 1e-3 + (2e-3 if step and step % 20 == 0 else 0.0) + (40e-3 if step % 20 == 7 else 0.0)
        control.note_step(step, [(torch.zeros(4), step)], True, True)
    cadence = control.cadence
    assert cadence is not None and cadence.decided
    assert cadence.copies == pytest.approx([2e-3] * 3)
    assert cadence.steps == pytest.approx([1e-3] * 2)
    assert snapshot_interval(2e-3, 3e-3, 20) == 280  # what the spans' mean step would give
    assert cadence.every == control.ring.every == snapshot_interval(2e-3, 1e-3, 20) == 800
    assert said and "every 800 steps instead of every 20" in said[0]


def _scripted_control(monkeypatch: pytest.MonkeyPatch) -> tuple[list[float], list[str], TrajectoryControl]:
    """A trajectory control with ``"auto"`` snapshots every 20 steps to start with, whose clock is ``now[0]`` (the
    test moves it) and whose sentences go to ``said``."""
    now = [0.0]
    monkeypatch.setattr(control_module.time, "perf_counter", lambda: now[0])
    net = nn.Linear(4, 2)
    state = TrainState(module=net, optimizers=[torch.optim.SGD(net.parameters(), lr=0.1)])
    said: list[str] = []
    control = TrajectoryControl(SnapshotRing(2**30, every=20), state, 10.0, said.append, adaptive=True)
    control.start(0)
    return now, said, control


def test_the_steady_run_checks_the_interval_until_it_holds_and_only_lengthens_it() -> None:
    """Once decided, three snapshot steps of the steady run (the copy with the healthy steps it takes in) check the
    interval: their median, when it costs more than the first snapshots did, lengthens it, and three more at the new
    interval check it again; once a check leaves it as it is, it is final, said in one sentence; a cheaper one
    leaves it as it is; after that, nothing moves it."""
    cadence = SnapshotCadence(20)
    assert cadence.observe_steady(1.0) is None and cadence.steady == []  # not decided yet: nothing to check
    cadence.observe(0.1e-3, None, 0)
    cadence.observe(0.1e-3, 20.1e-3, 20)  # healthy steps of 1 ms
    said = cadence.observe(0.1e-3, 20.1e-3, 20)
    assert cadence.decided and cadence.every == 40 and said is not None  # 0.1 ms over 0.25% of 1 ms: 40 steps
    assert cadence.observe_steady(0.5e-3) is None and cadence.observe_steady(2.0e-3) is None and not cadence.checked
    assert cadence.observe_steady(0.45e-3) is None  # their median: 0.5 ms spread over 200 steps of 1 ms ...
    assert not cadence.checked and cadence.every == 200 == snapshot_interval(0.5e-3, 1e-3, 20)
    assert cadence.observe_steady(0.4e-3) is None and cadence.observe_steady(0.5e-3) is None
    said = cadence.observe_steady(0.45e-3)  # ... checked again at 200: it holds
    assert cadence.checked and cadence.every == 200
    # (what it says is what it measured at the interval that stays: 0.45 ms at 200, not the 0.5 ms that chose it)
    assert said == ("A snapshot step takes 0.45 ms at this interval once the healthy steps are taken in by the run "
                    "against a healthy step of 1.00 ms: one is taken every 200 steps instead of every 40, so that "
                    "snapshots take 0.22% of the training time (at most 0.25%).")
    assert cadence.observe_steady(10.0) is None and cadence.every == 200  # final

    cheap = SnapshotCadence(20)
    for span in (None, 20.1e-3, 20.1e-3):
        cheap.observe(0.1e-3, span, 20 if span else 0)
    assert [cheap.observe_steady(c) for c in (0.01e-3, 0.02e-3, 0.03e-3)] == [None] * 3
    assert cheap.checked and cheap.every == 40  # never shortened

    steady = SnapshotCadence(20)  # the steady run's steps, 0.8 ms, quicker than the first snapshots' warm-up ones
    for span in (None, 20.1e-3, 20.1e-3):
        steady.observe(0.1e-3, span, 20 if span else 0)
    for cost, step in ((0.4e-3, None), (0.4e-3, 0.8e-3), (0.4e-3, None)):
        assert steady.observe_steady(cost, step) is None
    assert steady.every == 200  # 0.4 ms over 0.25% of 0.8 ms
    for _ in range(3):
        assert steady.observe_steady(0.5e-3) is None
    assert steady.every == 260 == snapshot_interval(0.5e-3, 0.8e-3, 20)  # 0.5 ms at 200: checked again at 260
    steady.observe_steady(0.5e-3)
    steady.observe_steady(0.5e-3)
    said = steady.observe_steady(0.5e-3) or ""  # the third check, the last made: said once, from the first interval
    assert steady.checked and "healthy step of 0.80 ms" in said and "every 260 steps instead of every 40" in said


def test_auto_times_the_steady_run_s_snapshot_steps_whole_in_the_route(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Once "auto" and the log cadence have decided, the route times the next snapshot steps whole, from the
    ledger's close (which hands over the healthy steps held back) to the snapshot, on its own clock: scripted here to move 5 ms between two
    reads, so each such step costs 5 ms, and the interval becomes the one the policy picks for that. (The first
    decision is pinned to the interval asked for, as a fast machine makes it, so that the check comes early.)"""
    from lightning_ampwatch.steps import cadence as cadence_module
    from lightning_ampwatch.steps import route as route_module

    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 5e-3
        return ticks[0]

    policy = cadence_module.snapshot_interval
    monkeypatch.setattr(route_module, "_clock", clock)
    # (the first decision times real copies, which a loaded machine makes slow: pinned whatever they took, so that
    # only the route's scripted 5 ms reach the policy)
    monkeypatch.setattr(cadence_module, "snapshot_interval", lambda copy_s, step_s, every, *args, **kwargs:
                        every if abs(copy_s - 5e-3) > 1e-12 else policy(copy_s, step_s, every, *args, **kwargs))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        control = _fit(tmp_path, AmpWatch(verbose=False), 401)  # (the log cadence decides at step 320)
    cadence = control.cadence
    assert cadence is not None and cadence.decided and cadence.checked
    assert cadence.steady == pytest.approx([5e-3] * 3)
    expected = policy(5e-3, min(cadence.steps), 20, SNAPSHOT_FRACTION, cadence._longest)
    assert expected > 20 and cadence.every == control.ring.every == expected
    said = [r.getMessage() for r in caplog.records if "A snapshot step t" in r.getMessage()]
    # timed at the interval that stays ("takes"), or at the longest interval allowed straight away, where no
    # second timing could move it ("took", with a floor on the share, never a ceiling)
    assert len(said) == 1 and said[0].startswith(("AmpWatch: A snapshot step takes 5.00 ms at this interval",
                                                  "AmpWatch: A snapshot step took 5.00 ms")), said
    assert f"every {expected} steps instead of every 20" in said[0]
