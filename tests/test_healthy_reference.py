"""The rules behind a healthy reference, on synthetic sequences: the level is made only of a healthy stretch before
the trouble (or there is none), a finite divergence is an alarm once, the LR story, recovery and the lower-LR and
shape verdicts. Pure: no torch, no Lightning."""

from __future__ import annotations

import pytest
from test_machine import alarms, fp16_machine, loss_run, replay

from lightning_ampwatch.machine import AmpStateMachine, Observation, PrecisionMode
from lightning_ampwatch.taxonomy import Finding
from lightning_ampwatch.verdicts import (
    LowerLrKind,
    Outcome,
    TrajectoryKind,
    TrajectoryResult,
    judge_lower_lr,
    judge_recovery,
    judge_trajectory,
)

HEALTHY = [2.0 * 0.97**step for step in range(24)]  # a run that trains down, gently


def fp32_run(losses: list[float], lrs: list[float] | None = None) -> list[Observation]:
    return [Observation(step=i, loss=v, loss_finite=True, lrs=(lrs[i],) if lrs else (0.1,))
            for i, v in enumerate(losses)]


def test_there_is_no_level_when_the_trouble_starts_at_the_first_steps() -> None:
    machine = AmpStateMachine(PrecisionMode.FP32)
    replay(machine, fp32_run([3.4, 19.0, 20.0, 30.0]))
    assert machine.loss_level is None  # 19, 20, 30 are the trouble itself, not a level
    ev = machine.reference_evidence(1)
    assert ev["loss_reference"] is None and "no healthy loss level before step 1" in ev["loss_reference_why"]
    assert ev["loss_at_start"] == 3.4


def test_the_level_is_a_healthy_stretch_and_a_slow_build_does_not_move_it() -> None:
    machine = AmpStateMachine(PrecisionMode.FP32)
    replay(machine, fp32_run(HEALTHY))
    level = machine.loss_level
    assert level is not None and min(HEALTHY) <= level <= max(HEALTHY[-16:])
    # a slow build (each step 10% up: under the 4x climb ratio for a while) never becomes the level
    build = [HEALTHY[-1] * 1.1**i for i in range(1, 12)]
    replay(machine, [Observation(step=24 + i, loss=v, loss_finite=True, lrs=(0.1,)) for i, v in enumerate(build)])
    assert machine.loss_level == pytest.approx(level, rel=0.2)


def test_a_finite_divergence_is_one_alarm_whose_episode_lasts_while_the_loss_stays_up() -> None:
    machine = AmpStateMachine(PrecisionMode.FP32)
    diverged = [40.0 + (i % 3) for i in range(30)]
    found = replay(machine, fp32_run(HEALTHY + diverged))
    found += machine.take_pending()
    [d] = alarms(found)
    assert d.finding is Finding.FP32_UNSTABLE and d.evidence["pattern"] == "finite_divergence"
    assert d.step == len(HEALTHY) and d.evidence["loss_reference"] == pytest.approx(machine.loss_level)
    assert machine.episode is not None  # still open: the loss never came back


def test_a_few_hard_batches_are_not_a_divergence() -> None:
    machine = AmpStateMachine(PrecisionMode.FP32)
    spikes = HEALTHY + [20.0, 15.0, 12.0] + HEALTHY[-1:] * 20
    assert alarms(replay(machine, fp32_run(spikes)) + machine.take_pending()) == []


def test_a_warmup_still_rising_at_the_onset_is_an_increase_with_its_ramp_start_apart() -> None:
    lrs = [0.001 + 0.999 * min(step, 40) / 40 for step in range(60)]  # peaks at step 40
    found = replay(fp16_machine(), loss_run([1.0] * 36 + [None] * 6, nonfinite=range(36, 42), lrs=lrs))
    d = alarms(found)[0]
    assert d.step == 36 and d.finding is Finding.LR_SCHEDULE
    assert d.evidence["lr_event"] == "lr_increase"  # warmup had not ended
    assert d.evidence["lr_before"] > 0.5 and d.evidence["lr_ramp_start"] == pytest.approx(0.001)


def test_a_climbing_loss_is_never_recovered_and_no_reference_is_not_verified() -> None:
    climbing = judge_recovery([30.0, 35.0, 50.0, 70.0, 90.0, 110.0], steps=6, skipped=0, reference=60.0,
                              reference_from="the level")
    assert climbing.outcome is Outcome.NOT_RECOVERED and "still climbing" in climbing.reason
    none = judge_recovery([1.0, 0.9, 0.8], steps=3, skipped=0, reference=None,
                          reference_from="nothing: there was no healthy loss level before the episode")
    assert none.outcome is Outcome.NOT_VERIFIED and "no healthy reference" in none.reason


def _result(losses: list[float], skipped: list[bool] | None = None, precision: str = "fp32") -> TrajectoryResult:
    return TrajectoryResult(precision=precision, from_step=-1, steps=list(range(len(losses))), losses=list(losses),
                            skipped=skipped or [False] * len(losses), params_finite=True)


def test_without_a_level_the_fp32_trajectory_is_judged_by_its_own_shape() -> None:
    fp32 = _result([3.4, 19.0, 30.0, 47.0, 48.0, 60.0])
    amp = _result([3.4, 19.0, float("nan"), 20.0, 30.0, 60.0], precision="amp")
    verdict = judge_trajectory(fp32, amp, None, 4.0)
    assert verdict.kind is TrajectoryKind.FP32_DIVERGES and "its own shape" in verdict.reason
    falling = judge_trajectory(_result([1.6, 1.2, 1.0, 0.7, 0.6]), amp, None, 4.0)
    assert falling.kind is TrajectoryKind.AMP_CONFIRMED


FULL_LR_CLIMBS = _result([3.4, 5.0, 9.0, 14.0, 20.0])  # the same steps at the full LR, in FP32


def test_the_lower_lr_replay_says_whether_the_lr_is_the_cause() -> None:
    def judge(lower: list[float]) -> LowerLrKind:
        return judge_lower_lr(_result(lower), 0.1, full=FULL_LR_CLIMBS, margin=0.2).kind

    assert judge([3.4, 2.9, 3.0, 2.6, 2.4]) is LowerLrKind.LR_IS_THE_CAUSE
    assert judge([3.4, float("nan"), 3.0]) is LowerLrKind.STILL_FAULTS
    assert judge([3.4, 5.0, 9.0, 20.0]) is LowerLrKind.DOES_NOT_FALL
    assert judge([3.4, 3.0]) is LowerLrKind.TOO_SHORT


def test_under_ddp_a_finite_divergence_is_reported_once_and_opens_no_episode() -> None:
    machine = AmpStateMachine(PrecisionMode.FP32)
    machine.divergence_opens_episode = False  # each rank's own losses: the ranks must keep meeting agreed alarms
    found = replay(machine, fp32_run(HEALTHY + [40.0] * 30)) + machine.take_pending()
    [d] = alarms(found)
    assert d.evidence["pattern"] == "finite_divergence" and machine.episode is None and machine.quiet
