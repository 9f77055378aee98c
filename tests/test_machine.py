"""The state machine alone, fed synthetic observation sequences, plus ScaleMirror against a real GradScaler."""

from __future__ import annotations

import itertools
import json
import math
import tracemalloc
from typing import Iterable, Iterator, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_ampwatch import Diagnosis, Finding, Thresholds
from lightning_ampwatch.machine import SCALE_HISTORY, AmpStateMachine, BatchStats, Observation, PrecisionMode
from lightning_ampwatch.signals import ScaleMirror

DEFAULT_SCALER = {"growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def scaled_run(skips: Iterable[int], steps: int, init_scale: float = 2.0**16, growth_interval: int = 2000,
               lrs: Sequence[float] | None = None, start: int = 0, mirror: ScaleMirror | None = None,
               loss: float = 1.0) -> list[Observation]:
    """Observations of a scaler run: the scale comes from a ScaleMirror fed the same skips, as in the callback."""
    mirror = mirror or ScaleMirror(init_scale, growth_interval=growth_interval)
    skip_set = set(skips)
    out = []
    for step in range(start, start + steps):
        skipped = step in skip_set
        scale = mirror.scale
        grew = mirror.update(skipped)
        lr = (lrs[step - start],) if lrs is not None else (0.01,)
        out.append(Observation(step=step, skipped=skipped, loss=loss, loss_finite=True, scale=scale, grew=grew,
                               lrs=lr))
    return out


def replay(machine: AmpStateMachine, observations: Iterable[Observation]) -> list[Diagnosis]:
    """Feed a whole sequence, collecting what the machine returns."""
    out: list[Diagnosis] = []
    for obs in observations:
        out.extend(machine.observe(obs))
    return out


def alarms(diagnoses: Iterable[Diagnosis]) -> list[Diagnosis]:
    return [d for d in diagnoses if d.is_alarm]


def fp16_machine(**thresholds: float) -> AmpStateMachine:
    return AmpStateMachine(PrecisionMode.FP16, Thresholds(**thresholds) if thresholds else None, DEFAULT_SCALER)


# ----------------------------------------------------------------------------- GRADIENT_OVERFLOW


def test_startup_overflow_names_the_scale_that_proved_safe() -> None:
    # 2**16 .. 2**11 overflow (6 skips from step 0), 2**10 goes through
    found = replay(fp16_machine(), scaled_run(range(6), 30))
    assert len(found) == 1
    diagnosis = found[0]
    assert diagnosis.finding is Finding.GRADIENT_OVERFLOW
    assert diagnosis.step == 0
    assert diagnosis.evidence["pattern"] == "startup"
    assert diagnosis.evidence["safe_scale"] == 1024.0
    assert diagnosis.evidence["init_scale"] == 65536.0
    assert diagnosis.evidence["skipped_in_row"] == 6
    assert "init_scale=2**10" in diagnosis.advice


def test_short_startup_streak_is_normal_scaling_not_an_alarm() -> None:
    found = replay(fp16_machine(), scaled_run(range(2), 30))
    assert [d.finding for d in found] == [Finding.NORMAL_SCALING]
    assert found[0].step == 0


def test_collapse_after_a_healthy_start() -> None:
    machine = fp16_machine()
    found = replay(machine, scaled_run(range(20, 26), 40))
    assert [d.finding for d in found] == [Finding.GRADIENT_OVERFLOW]
    assert found[0].step == 20
    assert found[0].evidence["pattern"] == "collapse"
    assert found[0].evidence["safe_scale"] == 65536.0
    assert machine.episode is not None or machine.closed_episodes  # it opened an episode


def test_burst_of_skips_not_in_a_row() -> None:
    found = replay(fp16_machine(), scaled_run([20, 21, 23, 25], 40))
    assert [d.finding for d in found] == [Finding.GRADIENT_OVERFLOW]
    assert found[0].step == 20
    assert found[0].evidence["pattern"] == "burst"


def test_persistent_skipping_at_a_steady_rate() -> None:
    skips = [s for s in range(10, 60) if s % 3 == 0]  # one step in three, never 4 within 8 steps
    found = replay(fp16_machine(), scaled_run(skips, 60))
    assert [d.finding for d in found] == [Finding.GRADIENT_OVERFLOW]
    assert found[0].evidence["pattern"] == "persistent"
    assert found[0].evidence["skip_rate"] >= 0.25
    assert 10 <= found[0].step <= 30


def test_overflow_below_scale_one_blames_the_gradients_not_the_scale() -> None:
    machine = fp16_machine()
    found = replay(machine, scaled_run(range(40), 40))  # 2**16 halved 40 times: far below 1
    assert [d.finding for d in found] == [Finding.GRADIENT_OVERFLOW]
    diagnosis = found[0]
    assert diagnosis.step == 0
    assert diagnosis.evidence["pattern"] == "unscaled_overflow"
    assert diagnosis.evidence["scale"] < 1.0
    assert "init_scale" not in diagnosis.advice and "bf16-mixed" in diagnosis.advice


# ----------------------------------------------------------------------------- GROWTH_OVERFLOW


def ceiling_run(steps: int, ceiling: float, growth_interval: int, init_scale: float,
                lrs: Sequence[float] | None = None) -> list[Observation]:
    """A scaler whose gradients overflow above ``ceiling``: each growth past it is skipped at once."""
    mirror = ScaleMirror(init_scale, growth_interval=growth_interval)
    out = []
    for step in range(steps):
        scale = mirror.scale
        skipped = scale > ceiling
        grew = mirror.update(skipped)
        out.append(Observation(step=step, skipped=skipped, loss=1.0, loss_finite=True, scale=scale, grew=grew,
                               lrs=(lrs[step] if lrs else 0.01,)))
    return out


def test_growth_overflow_when_every_growth_is_skipped() -> None:
    machine = AmpStateMachine(PrecisionMode.FP16, None, {**DEFAULT_SCALER, "growth_interval": 3})
    found = replay(machine, ceiling_run(60, ceiling=1024.0, growth_interval=3, init_scale=1024.0))
    assert [d.finding for d in found] == [Finding.GROWTH_OVERFLOW]
    diagnosis = found[0]
    assert diagnosis.evidence["pattern"] == "growth_overflow"
    assert len(diagnosis.evidence["growth_steps"]) == 3
    assert diagnosis.step <= 4  # the first growth happens at step 2 and is skipped at step 3
    assert diagnosis.evidence["safe_scale"] == 1024.0
    assert "growth_interval=30" in diagnosis.advice
    assert diagnosis.evidence["init_scale"] == 1024.0
    assert "init_scale=" not in diagnosis.advice  # 2**10 is the scale in use already: never advised
    assert "(2**10) holds" in diagnosis.advice


def test_growth_overflow_episode_stays_open_while_growths_keep_failing() -> None:
    machine = AmpStateMachine(PrecisionMode.FP16, None, {**DEFAULT_SCALER, "growth_interval": 3})
    found = replay(machine, ceiling_run(300, ceiling=1024.0, growth_interval=3, init_scale=1024.0))
    assert len(alarms(found)) == 1


def test_growth_overflow_closes_once_growths_survive_and_is_announced_again() -> None:
    machine = AmpStateMachine(PrecisionMode.FP16, None, {**DEFAULT_SCALER, "growth_interval": 3})
    mirror = ScaleMirror(1024.0, growth_interval=3)
    observations = []
    for step in range(120):
        ceiling = 1024.0 if step < 40 else 2.0**14  # the gradients shrink: four growths survive, then it fails again
        scale = mirror.scale
        skipped = scale > ceiling
        observations.append(Observation(step=step, skipped=skipped, loss=1.0, loss_finite=True, scale=scale,
                                        grew=mirror.update(skipped), lrs=(0.01,)))
    found = replay(machine, observations)
    assert [d.finding for d in found] == [Finding.GROWTH_OVERFLOW, Finding.GROWTH_OVERFLOW]
    assert len(machine.closed_episodes) == 1
    closed = machine.closed_episodes[0]
    assert closed["finding"] == "GROWTH_OVERFLOW" and closed["onset"] == found[0].step
    assert found[0].step < 40 < closed["end"] < found[1].step
    assert found[1].evidence["safe_scale"] == 2.0**14


# ----------------------------------------------------------------------------- LR_SCHEDULE


def test_lr_increase_before_the_onset_is_blamed_before_the_scaler() -> None:
    lrs = [0.01] * 30 + [0.4] * 30
    found = replay(fp16_machine(), scaled_run(range(32, 38), 60, lrs=lrs))
    assert [d.finding for d in found] == [Finding.LR_SCHEDULE]
    diagnosis = found[0]
    assert diagnosis.step == 32
    assert diagnosis.evidence["lr_event"] == "lr_increase"
    assert diagnosis.evidence["lr_before"] == 0.01 and diagnosis.evidence["lr_after"] == 0.4
    assert diagnosis.evidence["lr_change_step"] == 30
    assert "the learning rate jumped in one step (0.01 -> 0.4)" in diagnosis.advice


def test_same_skips_without_the_lr_change_blame_the_scaler() -> None:
    found = replay(fp16_machine(), scaled_run(range(32, 38), 60, lrs=[0.01] * 60))
    assert [d.finding for d in found] == [Finding.GRADIENT_OVERFLOW]


def test_warmup_end_with_lr_before_and_after() -> None:
    warmup = [0.001 + 0.009 * min(step, 20) / 20 for step in range(60)]  # peaks at step 20, then flat
    found = replay(fp16_machine(), scaled_run(range(22, 28), 60, lrs=warmup))
    assert [d.finding for d in found] == [Finding.LR_SCHEDULE]
    ev = found[0].evidence
    assert ev["lr_event"] == "warmup_end"
    assert ev["lr_before"] == pytest.approx(0.001) and ev["lr_after"] == pytest.approx(0.01)
    assert ev["lr_change_step"] == 20
    assert "warmup reached its peak (0.001 -> 0.01)" in found[0].advice


def test_end_of_a_long_warmup_is_blamed_although_its_last_steps_rise_little() -> None:
    # 200 warmup steps: the LR rises only ~2.5% over the last five, but 100x over the whole climb
    warmup = [1e-4 + (1e-2 - 1e-4) * min(step, 200) / 200 for step in range(260)]
    found = replay(fp16_machine(), scaled_run(range(202, 208), 260, lrs=warmup))
    assert [d.finding for d in found] == [Finding.LR_SCHEDULE]
    assert found[0].evidence["lr_event"] == "warmup_end"
    assert found[0].evidence["lr_before"] == pytest.approx(1e-4)


@pytest.mark.parametrize("delay", [1, 2, 4])
def test_a_single_lr_jump_is_an_increase_not_a_warmup_whatever_the_delay(delay: int) -> None:
    lrs = [0.01] * 30 + [0.4] * 30
    found = replay(fp16_machine(), scaled_run(range(30 + delay, 36 + delay), 60, lrs=lrs))
    assert [d.finding for d in found] == [Finding.LR_SCHEDULE]
    assert found[0].evidence["lr_event"] == "lr_increase"


def test_lr_rise_long_before_the_onset_is_not_blamed() -> None:
    lrs = [0.01] * 10 + [0.4] * 50
    found = replay(fp16_machine(), scaled_run(range(40, 46), 60, lrs=lrs))
    assert [d.finding for d in found] == [Finding.GRADIENT_OVERFLOW]


def test_lr_rise_takes_precedence_over_forward_overflow() -> None:
    machine = fp16_machine()
    replay(machine, scaled_run([], 10, lrs=[0.01] * 8 + [0.5] * 2))
    found = machine.observe(Observation(step=10, skipped=True, loss=float("inf"), loss_finite=False, scale=65536.0,
                                        lrs=(0.5,), batch=BatchStats(absmax=3.0)))
    assert [d.finding for d in found] == [Finding.LR_SCHEDULE]



def test_a_batch_past_float16s_range_goes_before_an_lr_rise_which_stays_beside_it() -> None:
    # the batch's own values are measured; the rise's timing is not: INPUT_RANGE, the rise kept in its evidence (a
    # user's glitching sensor hit the first batch after a 5-step warmup, and was called LR_SCHEDULE)
    machine = fp16_machine()
    replay(machine, scaled_run([], 10, lrs=[0.01] * 8 + [0.5] * 2))
    found = machine.observe(Observation(step=10, skipped=True, loss=float("inf"), loss_finite=False, scale=65536.0,
                                        lrs=(0.5,), batch=BatchStats(absmax=1e5, absmax_where="batch[0]")))
    assert [d.finding for d in found] == [Finding.INPUT_RANGE]
    assert found[0].evidence["input_absmax"] == 1e5 and found[0].evidence["lr_event"] == "lr_increase"
    # values large but inside float16's range: the rise is still looked at first (the replays decide between them)
    machine = fp16_machine()
    replay(machine, scaled_run([], 10, lrs=[0.01] * 8 + [0.5] * 2))
    found = machine.observe(Observation(step=10, skipped=True, loss=float("inf"), loss_finite=False, scale=65536.0,
                                        lrs=(0.5,), batch=BatchStats(absmax=2e4, absmax_where="batch[0]")))
    assert [d.finding for d in found] == [Finding.LR_SCHEDULE]


def test_the_scalers_start_up_skips_are_not_the_first_sign_of_a_later_fault() -> None:
    # the scaler lowers its first scale once at step 0 (finite loss), then 7 clean steps; step 8's loss goes inf:
    # the fault began at 8 (it was dated 0, and its replays 'stopped at the fault at step 0', the start-up skip)
    machine = fp16_machine()
    found = replay(machine, scaled_run([0], 8))
    found += machine.observe(anomalous(8, BatchStats(absmax=3.0)))
    [alarm] = alarms(found)
    assert alarm.finding is Finding.FORWARD_OVERFLOW and alarm.step == 8
    # a skip after the start-up, as close, is still the first sign of it
    machine = fp16_machine()
    found = replay(machine, scaled_run([0, 5], 8))
    found += machine.observe(anomalous(8, BatchStats(absmax=3.0)))
    assert [d.step for d in alarms(found)] == [5]


# ----------------------------------------------------------------------------- NORMAL_SCALING


def test_normal_scaling_is_reported_once_and_never_opens_an_episode() -> None:
    machine = fp16_machine()
    found = replay(machine, scaled_run([10, 50, 90, 130], 160))
    assert [d.finding for d in found] == [Finding.NORMAL_SCALING]
    assert found[0].step == 10
    assert not found[0].is_alarm
    assert machine.episode is None and machine.closed_episodes == []
    assert "Nothing to fix" in found[0].advice


# ----------------------------------------------------------------------------- loss-based findings


def anomalous(step: int, batch: BatchStats | None, loss: float = float("nan"), skipped: bool = True) -> Observation:
    return Observation(step=step, skipped=skipped, loss=loss, loss_finite=False, scale=65536.0, lrs=(0.01,),
                       batch=batch)


def test_nonfinite_batch_is_a_data_problem_in_any_precision() -> None:
    for mode in PrecisionMode:
        machine = AmpStateMachine(mode)
        replay(machine, scaled_run([], 5))
        found = machine.observe(anomalous(5, BatchStats(nonfinite=True, nonfinite_where="batch[0] rows [8]",
                                                        absmax=2.0e5)))
        assert [d.finding for d in found] == [Finding.DATA_NONFINITE], mode
        assert found[0].step == 5
        assert found[0].evidence["nonfinite_where"] == "batch[0] rows [8]"
        assert "batch[0] rows [8]" in found[0].advice


def test_huge_batch_values_under_fp16_are_input_range() -> None:
    machine = fp16_machine()
    found = machine.observe(anomalous(0, BatchStats(absmax=1.0e5, absmax_where="batch[0]"), loss=float("inf")))
    assert [d.finding for d in found] == [Finding.INPUT_RANGE]
    assert found[0].evidence["input_absmax"] == 1.0e5
    assert "1e+05 in batch[0]" in found[0].advice


def test_huge_batch_values_with_a_finite_loss_overflow_streak_are_input_range() -> None:
    machine = fp16_machine()
    replay(machine, scaled_run([], 10))
    big = BatchStats(absmax=5.0e4, absmax_where="batch[1]")
    found = []
    for step in range(10, 14):
        found += machine.observe(Observation(step=step, skipped=True, loss=2.0, loss_finite=True, scale=1024.0,
                                             lrs=(0.01,), batch=big))
    assert [d.finding for d in found] == [Finding.INPUT_RANGE]


def test_nonfinite_loss_with_finite_data_under_fp16_is_forward_overflow() -> None:
    found = fp16_machine().observe(anomalous(0, BatchStats(absmax=10.0)))
    assert [d.finding for d in found] == [Finding.FORWARD_OVERFLOW]
    assert found[0].location is None  # a later issue localises it
    assert "autocast" in found[0].advice


def test_bf16_never_blames_input_range() -> None:
    found = AmpStateMachine(PrecisionMode.BF16).observe(anomalous(0, BatchStats(absmax=1.0e6), skipped=False))
    assert [d.finding for d in found] == [Finding.FORWARD_OVERFLOW]
    assert "bfloat16" in found[0].advice


def test_nonfinite_loss_under_fp32_is_fp32_unstable() -> None:
    machine = AmpStateMachine(PrecisionMode.FP32)
    clean = [Observation(step=s, loss=1.0, loss_finite=True, lrs=(0.01,)) for s in range(5)]
    replay(machine, clean)
    found = machine.observe(anomalous(5, BatchStats(absmax=1.0e6), skipped=False))
    assert [d.finding for d in found] == [Finding.FP32_UNSTABLE]
    assert found[0].step == 5
    assert "full precision" in found[0].advice and "learning rate" in found[0].advice


# ----------------------------------------------------------------------------- episodes


def test_one_alarm_per_episode() -> None:
    machine = fp16_machine()
    found = replay(machine, scaled_run(range(10, 200), 200))  # never recovers
    assert len(alarms(found)) == 1


def test_repeated_nonfinite_loss_is_one_episode() -> None:
    machine = fp16_machine()
    found = replay(machine, [anomalous(s, BatchStats(absmax=1.0)) for s in range(20)])
    assert [d.finding for d in found] == [Finding.FORWARD_OVERFLOW]


def test_episode_closes_after_recovery_and_a_later_fault_is_announced_again() -> None:
    machine = fp16_machine()
    t = machine.thresholds
    first = replay(machine, scaled_run(range(20, 26), 40))
    assert machine.episode is None  # 14 clean steps after the burst
    assert machine.closed_episodes == [{"finding": "GRADIENT_OVERFLOW", "onset": 20, "end": 25 + t.recovery_steps}]
    mirror = ScaleMirror(1024.0)
    second = replay(machine, scaled_run(range(70, 76), 60, start=40, mirror=mirror))
    assert [d.step for d in alarms(first)] == [20]
    assert [d.step for d in alarms(second)] == [70]


def test_episode_stays_open_until_enough_clean_steps() -> None:
    machine = fp16_machine()
    replay(machine, scaled_run(range(20, 26), 26 + machine.thresholds.recovery_steps - 1))
    assert machine.episode is not None and machine.episode.onset == 20


def test_state_dict_round_trip_does_not_reannounce() -> None:
    sequence = scaled_run(range(20, 60), 80)  # a long streak: the resume lands inside the episode
    before, after = sequence[:30], sequence[30:]
    original = fp16_machine()
    announced = replay(original, before)
    assert [d.finding for d in announced] == [Finding.GRADIENT_OVERFLOW]

    state = json.loads(json.dumps(original.state_dict()))
    resumed = fp16_machine()
    resumed.load_state_dict(state)
    assert resumed.episode == original.episode
    assert resumed.steps_seen == 30 and resumed.skipped_total == 10
    assert replay(resumed, after) == replay(original, after)
    assert resumed.state_dict() == original.state_dict()


def test_resumed_machine_does_not_reannounce_normal_scaling() -> None:
    original = fp16_machine()
    assert [d.finding for d in replay(original, scaled_run([5], 30))] == [Finding.NORMAL_SCALING]
    resumed = fp16_machine()
    resumed.load_state_dict(original.state_dict())
    assert replay(resumed, scaled_run([40], 30, start=30)) == []


def test_alarm_imminent_when_one_more_skip_completes_a_startup_streak() -> None:
    machine = fp16_machine()
    run = scaled_run(range(6), 7)  # the streak is judged on its first clean step, step 6
    imminent = []
    for obs in run:
        imminent.append(machine.alarm_imminent)
        machine.observe(obs)
    # before step 3 the streak holds 3 skips (startup_streak - 1): the 4th would complete it
    assert [i for i, flag in enumerate(imminent) if flag] == [3]
    assert machine.episode is not None and not machine.alarm_imminent


def test_alarm_imminent_is_false_while_an_episode_is_open() -> None:
    machine = fp16_machine()
    replay(machine, scaled_run(range(20, 26), 26))
    assert machine.episode is not None
    assert not machine.alarm_imminent


def test_state_dict_is_plain_json_and_restores_every_entry() -> None:
    machine = AmpStateMachine(PrecisionMode.FP16, None, {**DEFAULT_SCALER, "growth_interval": 3})
    replay(machine, ceiling_run(40, ceiling=1024.0, growth_interval=3, init_scale=1024.0,
                                lrs=[0.001 * (1 + min(s, 10)) for s in range(40)]))
    state = machine.state_dict()
    assert json.loads(json.dumps(state)) == state
    resumed = fp16_machine()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.state == machine.state
    assert resumed.state.growths.maxlen == machine.state.growths.maxlen  # bounds survive the round trip


@pytest.mark.parametrize("state, names", [
    ([1, 2], "must be a dict, got list"),
    ({"episode": {"finding": "NOT_A_FINDING", "onset": 3}}, "machine state.episode.finding: 'NOT_A_FINDING'"),
    ({"steps_seen": "30"}, "machine state.steps_seen must be int, got '30'"),
    ({"steps_seen": True}, "machine state.steps_seen must be int, got True"),
    ({"recent_skips": [1, None]}, "machine state.recent_skips[1] must be int, got None"),
    ({"streak": {"count": 2}}, "machine state.streak: "),
    ({"lr_history": [[3, 0.1]]}, "machine state.lr_history[0] must be a dict, got list"),
])
def test_load_state_dict_rejects_a_bad_entry_by_name_and_keeps_the_machine(state: object, names: str) -> None:
    machine = fp16_machine()
    replay(machine, scaled_run([5], 30))
    before = machine.state_dict()
    with pytest.raises(ValueError) as err:
        machine.load_state_dict(state)  # type: ignore[arg-type]
    assert names in str(err.value)
    assert machine.state_dict() == before


def test_unknown_finding_error_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: DATA_NONFINITE, FP32_UNSTABLE"):
        fp16_machine().load_state_dict({"episode": {"finding": "OVERFLOW", "onset": 1}})


# ----------------------------------------------------------------------------- bounded memory


def stuck_run(steps: int, nonfinite: bool) -> Iterator[Observation]:
    """A run that never recovers: every step skipped (with a NaN loss, or a finite one at a collapsing scale)."""
    mirror = ScaleMirror(2.0**16)
    for step in range(steps):
        scale = mirror.scale
        mirror.update(True)
        yield Observation(step=step, skipped=True, loss=float("nan") if nonfinite else 1.0,
                          loss_finite=not nonfinite, scale=scale, lrs=(0.01,))


@pytest.mark.parametrize("nonfinite", [True, False])
def test_a_run_stuck_at_nan_keeps_bounded_state(nonfinite: bool) -> None:
    machine = fp16_machine()
    early = replay(machine, stuck_run(1_000, nonfinite))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        later = replay(machine, itertools.islice(stuck_run(50_000, nonfinite), 1_000, None))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes retained over 49k anomalous steps"
    assert machine.state.streak is not None and machine.state.streak.count == 50_000
    assert len(machine.state.streak.scales) == SCALE_HISTORY
    assert len(machine.state.recent_skips) <= machine.thresholds.window
    assert later == []  # one alarm for the whole episode, made early and not repeated
    expected = Finding.FORWARD_OVERFLOW if nonfinite else Finding.GRADIENT_OVERFLOW
    assert [(d.finding, d.step) for d in early] == [(expected, 0)]
    assert len(json.dumps(machine.state_dict())) < 4096


# ----------------------------------------------------------------------------- the trajectory of the loss


def loss_run(losses: Sequence[float | None], skips: Iterable[int] = (), lrs: Sequence[float] | None = None,
             nonfinite: Iterable[int] = ()) -> list[Observation]:
    """A scaler run with a loss on every step (NaN on the ``nonfinite`` steps, which are skipped too)."""
    nan_steps = set(nonfinite)
    skip_set = set(skips) | nan_steps
    mirror = ScaleMirror(2.0**16)
    out = []
    for step, loss in enumerate(losses):
        skipped = step in skip_set
        scale = mirror.scale
        grew = mirror.update(skipped)
        value = float("nan") if step in nan_steps else loss
        out.append(Observation(step=step, skipped=skipped, loss=value,
                               loss_finite=None if value is None else math.isfinite(value), scale=scale, grew=grew,
                               lrs=(lrs[step] if lrs else 0.5,)))
    return out


#: A loss that falls from 4.16 to a healthy ~0.82 over 30 steps.
SETTLING = [0.82 + 3.34 * 0.8**step for step in range(30)]


def test_loss_level_follows_the_run_not_its_first_step() -> None:
    machine = fp16_machine()
    assert machine.loss_level is None
    replay(machine, loss_run(SETTLING))
    assert machine.loss_level == pytest.approx(0.85, abs=0.03)  # the last steps' median, not 4.16


def test_loss_level_is_fed_by_the_fast_path_too() -> None:
    machine = fp16_machine()
    for step, loss in enumerate(SETTLING):
        machine.observe_clean(step, 2.0**16, False, (0.5,), loss)
    assert machine.loss_level == pytest.approx(0.85, abs=0.03)


def test_divergence_before_any_overflow_is_fp32_unstable_dated_at_the_climb() -> None:
    # the real case: healthy 0.82, then a climb to 30 at a constant (too high) LR, then skips and a NaN
    losses = SETTLING + [1.5, 3.5, 6.0, 12.0, 30.0, 31.0, None, None]
    found = replay(fp16_machine(), loss_run(losses, skips=[35], nonfinite=[36, 37]))
    assert [(d.finding, d.step) for d in found] == [(Finding.FP32_UNSTABLE, 31)]  # 3.5 is the first > 4x 0.85
    ev = found[0].evidence
    assert ev["loss_level"] == pytest.approx(0.85, abs=0.03)
    assert ev["loss_at_onset"] == 3.5
    assert ev["diverged_first"] is True
    assert ev["divergence"] == "loss 0.848 -> 30 over steps 31..34 before any overflow"
    assert "before any overflow" in found[0].headline() and "not AMP" in found[0].headline()
    assert "The loss climbed (loss 0.848 -> 30" in found[0].advice


def test_climb_losses_do_not_feed_the_level() -> None:
    machine = fp16_machine()
    replay(machine, loss_run(SETTLING + [10.0 * (1 + i) for i in range(40)]))
    assert machine.loss_level == pytest.approx(0.85, abs=0.03)


def test_one_hard_batch_is_not_a_climb() -> None:
    run = loss_run(SETTLING + [5.0, None, 0.8, 0.8], skips=[31])
    assert alarms(replay(fp16_machine(), run)) == []
    # the same step is a climb once a single high loss is allowed to make one
    assert [d.finding for d in alarms(replay(fp16_machine(climb_steps=1), run))] == [Finding.FP32_UNSTABLE]


def test_divergence_after_an_lr_rise_is_lr_schedule_dated_at_the_climb() -> None:
    lrs = [0.01] * 28 + [0.5] * 12
    losses = SETTLING + [6.0, 12.0, 30.0, 31.0, 33.0, None, None, None, None, None]
    found = replay(fp16_machine(), loss_run(losses, lrs=lrs, nonfinite=[35, 36]))
    assert [(d.finding, d.step) for d in found] == [(Finding.LR_SCHEDULE, 30)]
    ev = found[0].evidence
    assert ev["lr_change_step"] == 28 and ev["lr_before"] == 0.01 and ev["lr_after"] == 0.5
    assert ev["diverged_first"] is True and ev["loss_at_onset"] == 6.0


def test_a_skip_before_the_climb_dates_the_onset_at_the_skip() -> None:
    losses = SETTLING + [None, 0.9, 6.0, 12.0, 30.0, None]
    found = replay(fp16_machine(), loss_run(losses, skips=[30], nonfinite=[35]))
    assert [(d.finding, d.step) for d in found] == [(Finding.FORWARD_OVERFLOW, 30)]
    ev = found[0].evidence
    assert ev["diverged_first"] is False and ev["first_nonfinite_step"] == 35
    assert ev["divergence"].endswith("after the first skip at step 30")


def test_lr_jump_then_scattered_skips_then_nan_is_lr_schedule_at_the_first_skip() -> None:
    # the real case: LR up 100x at step 20, skips from 22, first NaN at 29
    lrs = [0.001] * 20 + [0.1] * 20
    found = replay(fp16_machine(), loss_run([1.0] * 40, skips=[22, 25, 28], lrs=lrs, nonfinite=[29]))
    assert [(d.finding, d.step) for d in found] == [(Finding.LR_SCHEDULE, 22)]
    ev = found[0].evidence
    assert ev["lr_change_step"] == 20 and ev["lr_before"] == 0.001 and ev["lr_after"] == 0.1
    assert ev["first_nonfinite_step"] == 29


def test_lr_jump_after_a_warmup_names_the_lr_just_before_the_jump() -> None:
    lrs = [0.001 + 0.019 * min(step, 10) / 10 if step < 50 else 0.5 for step in range(70)]
    found = replay(fp16_machine(), scaled_run(range(52, 58), 70, lrs=lrs))
    assert [(d.finding, d.step) for d in found] == [(Finding.LR_SCHEDULE, 52)]
    ev = found[0].evidence
    assert ev["lr_event"] == "lr_increase"
    assert ev["lr_before"] == pytest.approx(0.02) and ev["lr_after"] == 0.5 and ev["lr_change_step"] == 50


def test_collapse_advice_does_not_recommend_the_scale_already_in_use() -> None:
    found = replay(fp16_machine(), scaled_run(range(20, 26), 40))
    assert found[0].evidence["safe_scale"] == found[0].evidence["init_scale"] == 2.0**16
    assert "init_scale=2**16" not in found[0].advice
    assert "Steps went through at a scale of 2**16 before these skips began" in found[0].advice


# ----------------------------------------------------------------------------- NORMAL_SCALING withdrawn


def test_premature_normal_scaling_is_withdrawn_by_the_alarm_its_skip_began() -> None:
    # every growth (each 10 clean steps) overflows at once: the first skip looks normal until it repeats
    machine = AmpStateMachine(PrecisionMode.FP16, None, {**DEFAULT_SCALER, "growth_interval": 10})
    found = replay(machine, ceiling_run(80, ceiling=1024.0, growth_interval=10, init_scale=1024.0))
    assert [(d.finding, d.step, d.withdrawn) for d in found] == [
        (Finding.NORMAL_SCALING, 10, False), (Finding.GROWTH_OVERFLOW, 10, False), (Finding.NORMAL_SCALING, 10, True)]
    withdrawal = found[2]
    assert withdrawal.evidence["withdrawn_by"] == "GROWTH_OVERFLOW"
    assert withdrawal.evidence["withdrawn_at"] == 32 and withdrawal.evidence["alarm_onset"] == 10
    assert withdrawal.evidence["skipped_steps"] == found[0].evidence["skipped_steps"]  # the call it takes back
    assert "premature" in withdrawal.advice
    assert "withdrawn at step 32" in withdrawal.headline()


def test_normal_scaling_stands_when_the_alarm_comes_long_after() -> None:
    machine = fp16_machine()
    found = replay(machine, scaled_run([10, *range(100, 106)], 120))
    assert [(d.finding, d.step, d.withdrawn) for d in found] == [
        (Finding.NORMAL_SCALING, 10, False), (Finding.GRADIENT_OVERFLOW, 100, False)]


def test_withdrawal_survives_a_resume() -> None:
    machine = AmpStateMachine(PrecisionMode.FP16, None, {**DEFAULT_SCALER, "growth_interval": 10})
    run = ceiling_run(80, ceiling=1024.0, growth_interval=10, init_scale=1024.0)
    replay(machine, run[:25])
    resumed = AmpStateMachine(PrecisionMode.FP16, None, {**DEFAULT_SCALER, "growth_interval": 10})
    resumed.load_state_dict(json.loads(json.dumps(machine.state_dict())))
    assert [d.withdrawn for d in replay(resumed, run[25:])] == [False, True]


# ----------------------------------------------------------------------------- healthy runs: property test


@st.composite
def healthy_runs(draw: st.DrawFn) -> list[Observation]:
    steps = draw(st.integers(min_value=50, max_value=1500))
    gap = 40  # each skip isolated: well over recovery_steps and window apart
    max_skips = steps // 250  # skip rate at most 0.4%
    count = draw(st.integers(min_value=0, max_value=max_skips))
    gaps = draw(st.lists(st.integers(min_value=gap, max_value=4 * gap), min_size=count, max_size=count))
    skips: list[int] = []
    for g in gaps:  # the first skip lands anywhere in [gap, 4 * gap], each next one a gap later
        skips.append((skips[-1] if skips else 0) + g)
    skips = [s for s in skips if s < steps]
    groups = draw(st.integers(min_value=1, max_value=2))
    lr0 = draw(st.floats(min_value=1e-5, max_value=1.0))
    decay = draw(st.sampled_from(["constant", "step", "cosine", "exponential"]))
    def lr_at(step: int) -> float:
        if decay == "step":
            return lr0 * 0.1 ** (step // 100)
        if decay == "cosine":
            return lr0 * 0.5 * (1 + math.cos(math.pi * step / steps))
        if decay == "exponential":
            return lr0 * 0.999 ** step
        return lr0
    mirror = ScaleMirror(draw(st.sampled_from([2.0**10, 2.0**14, 2.0**16])),
                         tracker=draw(st.integers(min_value=0, max_value=1999)))
    out = []
    skip_set = set(skips)
    for step in range(steps):
        skipped = step in skip_set
        scale = mirror.scale
        grew = mirror.update(skipped)
        lr = lr_at(step)
        loss = draw(st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e3))) if step % 97 == 0 else 1.0
        out.append(Observation(step=step, skipped=skipped, loss=loss, loss_finite=None if loss is None else True,
                               scale=scale, grew=grew, lrs=tuple(lr for _ in range(groups))))
    return out


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(healthy_runs())
def test_rare_isolated_skips_never_raise_an_alarm(run: list[Observation]) -> None:
    machine = fp16_machine()
    found = replay(machine, run)
    assert alarms(found) == []
    assert len(found) <= 1  # NORMAL_SCALING at most once
    assert machine.episode is None


# ----------------------------------------------------------------------------- ScaleMirror vs GradScaler


def drive_real_scaler(found_infs: Sequence[bool], **scaler_kwargs: float) -> list[tuple[float, bool]]:
    """Step a real CPU GradScaler whose gradient is inf exactly when asked; returns (scale after, grew)."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    out = []
    previous = scaler.get_scale()
    for inf in found_infs:
        opt.zero_grad()
        factor = torch.tensor(float("inf") if inf else 1.0)
        scaler.scale((param * factor).sum()).backward()
        scaler.step(opt)
        scaler.update()
        now = scaler.get_scale()
        out.append((now, now > previous))
        previous = now
    return out


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(
    found_infs=st.lists(st.booleans(), min_size=1, max_size=40),
    growth_interval=st.integers(min_value=1, max_value=5),
    growth_factor=st.sampled_from([2.0, 1.5, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.25]),
    init_scale=st.sampled_from([1.0, 2.0**8, 2.0**16]),
)
def test_scale_mirror_follows_the_real_grad_scaler(found_infs: list[bool], growth_interval: int,
                                                   growth_factor: float, backoff_factor: float,
                                                   init_scale: float) -> None:
    kwargs = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                  growth_interval=growth_interval)
    real = drive_real_scaler(found_infs, **kwargs)
    mirror = ScaleMirror(init_scale, growth_factor, backoff_factor, growth_interval)
    for inf, (real_scale, real_grew) in zip(found_infs, real):
        grew = mirror.update(inf)
        assert mirror.scale == pytest.approx(real_scale, rel=1e-6)
        assert grew == real_grew


def test_scale_mirror_state_round_trip() -> None:
    mirror = ScaleMirror(1024.0, growth_interval=3, tracker=2)
    copy = ScaleMirror.from_state_dict(json.loads(json.dumps(mirror.state_dict())))
    assert [copy.update(False) for _ in range(4)] == [mirror.update(False) for _ in range(4)]
    assert copy.scale == mirror.scale == 4096.0


# ----------------------------------------------------------------------------- Thresholds


@pytest.mark.parametrize("field, value", [("streak", 0), ("window", -1), ("lr_rise", 0.0), ("recovery_steps", True),
                                          ("input_limit", "big"), ("window_skip_rate", 1.5),
                                          ("growth_skip_rate", 2.0)])
def test_thresholds_reject_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError) as err:
        Thresholds(**{field: value})  # type: ignore[arg-type]
    message = str(err.value)
    assert f"Thresholds.{field}" in message


@pytest.mark.parametrize("field, value, message", [
    ("window", 32.5, "Thresholds.window must be a positive integer, got 32.5"),
    ("recovery_steps", float("nan"), "Thresholds.recovery_steps must be a positive integer, got nan"),
    ("input_limit", float("inf"), "Thresholds.input_limit must be a positive finite number, got inf"),
    ("lr_rise", float("nan"), "Thresholds.lr_rise must be a positive finite number, got nan"),
    ("loss_window", True, "Thresholds.loss_window must be a positive integer, got True"),
    ("divergence_ratio", False, "Thresholds.divergence_ratio must be a positive finite number, got False"),
    ("divergence_ratio", 1.0, "Thresholds.divergence_ratio must be above 1"),
    ("window_skip_rate", 1.5, "Thresholds.window_skip_rate is a fraction in (0, 1], got 1.5"),
])
def test_thresholds_fail_at_construction_naming_field_value_and_what_is_valid(field: str, value: object,
                                                                              message: str) -> None:
    with pytest.raises(ValueError) as err:
        Thresholds(**{field: value})  # type: ignore[arg-type]
    assert str(err.value).startswith(message)


def test_thresholds_take_ints_for_float_fields() -> None:
    assert Thresholds(divergence_ratio=8, floor_scale=1).divergence_ratio == 8


def test_thresholds_name_the_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"Thresholds\.streak must be a positive integer, got 0"):
        Thresholds(streak=0)


def test_machine_rejects_unknown_precision_mode() -> None:
    with pytest.raises(ValueError):
        AmpStateMachine("fp8")


@st.composite
def _mixed_runs(draw: st.DrawFn) -> list[Observation]:
    """Runs with everything in them: skip bursts, growths, LR changes, climbs of the loss, non-finite losses and
    bad batches; the loss of a clean step is known on some steps only."""
    steps = draw(st.integers(min_value=20, max_value=160))
    mirror = ScaleMirror(2.0**16, growth_interval=draw(st.sampled_from([3, 7, 2000])))
    skip_p = draw(st.sampled_from([0.0, 0.02, 0.2, 0.6]))
    loss_p = draw(st.sampled_from([0.0, 0.5, 1.0]))
    out: list[Observation] = []
    lr, level = 0.01, 1.0
    for step in range(steps):
        if draw(st.floats(0, 1)) < 0.05:
            lr *= draw(st.sampled_from([0.5, 2.0, 40.0]))
        if draw(st.floats(0, 1)) < 0.05:
            level *= draw(st.sampled_from([0.25, 3.0, 10.0]))  # the loss falls, or climbs
        skipped = draw(st.floats(0, 1)) < skip_p
        nonfinite = skipped and draw(st.floats(0, 1)) < 0.2
        scale = mirror.scale
        grew = mirror.update(skipped)
        batch = BatchStats(nonfinite=draw(st.booleans()), absmax=1.0) if nonfinite else None
        if skipped:
            loss: float | None = float("nan") if nonfinite else level
        else:
            loss = level * draw(st.floats(0.5, 2.0)) if draw(st.floats(0, 1)) < loss_p else None
        out.append(Observation(step=step, skipped=skipped, loss=loss,
                               loss_finite=None if loss is None else not nonfinite, scale=scale, grew=grew,
                               lrs=(lr,), batch=batch))
    return out


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(_mixed_runs())
def test_the_clean_step_fast_path_changes_nothing(observations: list[Observation]) -> None:
    """The callback feeds quiet clean steps to observe_clean instead of observe: same diagnoses, same state."""
    slow, fast = AmpStateMachine("fp16", scaler_config=DEFAULT_SCALER), AmpStateMachine("fp16", scaler_config=DEFAULT_SCALER)
    slow_out = replay(slow, observations)
    fast_out: list[Diagnosis] = []
    for obs in observations:
        if fast.quiet and not obs.anomalous:
            fast.observe_clean(obs.step, obs.scale, obs.grew, obs.lrs, obs.loss)
        else:
            fast_out.extend(fast.observe(obs))
    assert fast_out == slow_out
    assert fast.state_dict() == slow.state_dict()


_LOSS_KINDS = st.one_of(
    st.floats(min_value=0.5, max_value=1.5),  # healthy
    st.floats(min_value=3.0, max_value=200.0),  # a spike (a run of them is a finite divergence)
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(losses=st.lists(st.tuples(_LOSS_KINDS, st.integers(min_value=1, max_value=12)), min_size=1, max_size=40),
       cuts=st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=8))
def test_note_losses_in_batches_is_one_loss_at_a_time(losses: list[tuple[float, int]], cuts: list[int]) -> None:
    """A log step hands the machine ~50 losses at once (``note_losses``, with the healthy case inline): the level,
    the climb and the finite divergence come out as when each loss is taken as the step's own
    (``observe_clean(loss=...)``)."""
    sequence = [loss for loss, repeat in losses for _ in range(repeat)]
    batched, single = AmpStateMachine("fp16"), AmpStateMachine("fp16")
    steps = list(enumerate(sequence))
    i, k = 0, 0
    while i < len(steps):
        n = cuts[k % len(cuts)]
        batched.note_losses(steps[i:i + n])
        i, k = i + n, k + 1
    for step, loss in steps:
        single.observe_clean(step, None, False, (), loss)

    def seen(m: AmpStateMachine) -> tuple:
        s = m.state
        return (s.reference, list(s.losses), list(s.loss_steps), s.climb, s.divergence_noted, s.start_loss,
                [(d.finding, d.step, d.evidence.get("loss_reference")) for d in m.take_pending()])

    assert seen(batched) == seen(single)


_MOSTLY_HEALTHY = st.one_of(
    st.floats(min_value=0.05, max_value=8.0),  # a healthy range wide enough to reach the climb threshold at times
    st.floats(min_value=0.5, max_value=1.5),
    _LOSS_KINDS,
)


def _taken_in(m: AmpStateMachine) -> tuple:
    """Everything the losses leave in a machine, the count towards the next re-judged level included."""
    return m.state_dict(), m._since_promote, [(d.finding, d.step, d.evidence) for d in m.take_pending()]


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(losses=st.lists(st.tuples(_MOSTLY_HEALTHY, st.integers(min_value=1, max_value=30)), min_size=1, max_size=30),
       cuts=st.lists(st.integers(min_value=1, max_value=80), min_size=1, max_size=8),
       window=st.integers(min_value=3, max_value=40))
def test_a_healthy_batch_taken_at_once_is_one_loss_at_a_time(losses: list[tuple[float, int]], cuts: list[int],
                                                             window: int) -> None:
    """Mostly healthy losses in batches of up to 80 (a log step's, taken at once with C builtins when every loss is
    sure to stay under the climb threshold), against the same losses handed over one at a time: the same machine,
    level, window, climb and count towards the next re-judged level, whatever the window's length."""
    sequence = [loss for loss, repeat in losses for _ in range(repeat)]
    thresholds = Thresholds(loss_window=window)
    batched, single = AmpStateMachine("fp16", thresholds=thresholds), AmpStateMachine("fp16", thresholds=thresholds)
    steps = list(enumerate(sequence))
    i, k = 0, 0
    while i < len(steps):
        n = cuts[k % len(cuts)]
        batched.note_losses(steps[i:i + n])
        i, k = i + n, k + 1
    for step, loss in steps:
        single.note_losses([(step, loss)])  # one at a time: never the batch path
    assert _taken_in(batched) == _taken_in(single)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(window=st.lists(st.one_of(st.floats(min_value=0.0, max_value=10.0), st.sampled_from([0.5, 1.0, 2.0]),
                                 st.floats(min_value=1e300, max_value=1.7e308)), max_size=24),
       before=st.one_of(st.none(), st.floats(min_value=0.01, max_value=10.0)),
       steps_known=st.booleans())
def test_the_level_is_rejudged_as_statistics_medians_say(window: list[float], before: float | None,
                                                         steps_known: bool) -> None:
    """``promote`` computes its medians inline (a log step re-judges the level about a dozen times): the level it
    makes, or keeps, is the one its definition gives with ``statistics.median``, huge finite losses included."""
    import statistics

    from lightning_ampwatch.machine import CLIMBING_RISE, HEALTHY_RISE, Reference

    m = AmpStateMachine("fp16", thresholds=Thresholds(loss_window=24))
    s = m.state
    s.losses.extend(window)
    s.loss_steps.extend(range(100, 100 + len(window)) if steps_known else range(100, 100 + len(window) // 2))
    s.steps_seen = 300
    s.reference = None if before is None else Reference(before, 0, 9, 10)
    expected = s.reference
    n, half = len(window), len(window) // 2
    if n >= 3 and statistics.median(window[half:]) <= CLIMBING_RISE * statistics.median(window[:half]):
        level = statistics.median(window)
        if before is None or level <= HEALTHY_RISE * before:
            expected = Reference(level, 100, 100 + n - 1, n) if steps_known else Reference(level, 300 - n, 299, n)
    m.healthy.promote()
    assert s.reference == expected
    assert m._since_promote == 0


def test_a_healthy_log_steps_losses_are_taken_at_once_and_trouble_one_by_one() -> None:
    m = AmpStateMachine("fp16")
    m.note_losses([(i, 1.0 + 0.01 * (i % 7)) for i in range(60)])
    assert m.loss_level is not None
    before = _taken_in(m)
    for trouble in (math.nan, math.inf, -math.inf):  # a batch holding one is taken one by one, all of it
        assert m._note_healthy_run([(60 + i, 1.0) for i in range(49)] + [(109, trouble)]) == 0
        assert _taken_in(m) == before  # and the machine is left as it was
    # a spike: the losses before its run of four are taken at once, the rest is left to the one-by-one path
    assert m._note_healthy_run([(60 + i, 1.0) for i in range(21)] + [(81, 1000.0)] + [(82, 1.0)]) == 20
    assert m.state.loss_steps[-1] == 79 and m.loss_level is not None


def test_losses_of_two_objectives_make_no_level_and_no_climb() -> None:
    """A GAN's batch steps the discriminator on its loss and the generator on its own: the step losses alternate
    between two objectives. Taken as one series, the discriminator's tiny losses make the level, and a wobble of
    theirs (4e-5 to 3e-4, found on a fresh GAN run) reads as a finite divergence. Once the machine knows the losses
    are apart it keeps no level, looks for no climb, still counts a non-finite loss, and says why there is no level."""
    def gan_losses(start: int, n: int, d_loss: float, g_loss: float) -> list[tuple[int, float]]:
        return [(step, d_loss if step % 2 == 0 else g_loss) for step in range(start, start + n)]

    why = "each batch steps several optimizers, each on a loss of its own"
    for apart in (False, True):
        machine = AmpStateMachine("fp16")
        if apart:
            machine.healthy.apart(why)
        machine.note_losses(gan_losses(0, 40, 1e-4, 1.0))  # a level between the two (about 0.5)
        # the generator's loss grows past 4x that level: each of its losses starts a climb that the discriminator's
        # next one ends, and only the discriminator's losses join the level, which falls to theirs
        machine.note_losses(gan_losses(40, 60, 4e-5, 13.0))
        machine.note_losses(gan_losses(100, 30, 3e-4, 13.0) + [(130, math.nan)])  # the discriminator's wobble
        found = [d.finding for d in machine.take_pending()]
        if not apart:
            assert Finding.FP32_UNSTABLE in found  # what a single series makes of it
            continue
        assert found == [] and machine.state.reference is None and machine.state.start_loss is None
        assert machine.state.nonfinite_total == 1
        assert machine.reference_evidence(120) == {"loss_reference": None,
                                                  "loss_reference_why": f"no healthy loss level: {why}"}
        restored = AmpStateMachine("fp16")
        restored.load_state_dict(json.loads(json.dumps(machine.state_dict())))
        assert restored.state.losses_apart == why  # a resumed run keeps it
