"""The verdicts that a rename or a "recovered" rests on, alone (pure: no torch, no Lightning): the lower-LR
counterfactual needs a decisive fall that ends clearly under the full-LR replay; the level a rollback goes back to
must be a healthy stretch; an FP32 replay is a recovery reference only when it was itself healthy."""

from __future__ import annotations

import math
import statistics

import pytest
from test_machine import replay

from lightning_ampwatch.machine import AmpStateMachine, LevelAt, Observation, PrecisionMode, Thresholds
from lightning_ampwatch.records import TrajectoryKind, TrajectoryVerdict, Unverified, facts_of, with_facts
from lightning_ampwatch.remedies.policy import RemedyPolicy
from lightning_ampwatch.remedies.treatment import Treatment, Watch, _reference
from lightning_ampwatch.taxonomy import Diagnosis, Finding, advise
from lightning_ampwatch.verdicts import (
    LowerLrKind,
    Outcome,
    TrajectoryResult,
    fp32_reference,
    judge_lower_lr,
    judge_recovery,
)


def _result(losses: list[float], skipped: list[bool] | None = None) -> TrajectoryResult:
    return TrajectoryResult(precision="amp", from_step=9, steps=list(range(10, 10 + len(losses))), losses=list(losses),
                            skipped=skipped or [False] * len(losses), params_finite=True)


# the lower-LR replay and the full-LR FP32 replay of a window on a plateau (measured: a too-high SGD on random labels,
# tests/test_verdict_soundness_e2e.py): both wander around log(4) = 1.386; the lower one happens to end a little lower
PLATEAU_FULL = [1.365, 1.495, 1.389, 1.408, 1.406, 1.477, 1.488, 1.324, 1.371, 1.308, 1.413, 1.577]
PLATEAU_LOWER = [1.365, 1.46, 1.404, 1.361, 1.38, 1.386, 1.352, 1.282, 1.389, 1.333, 1.286, 1.423]


def test_noise_on_a_plateau_is_inconclusive_not_the_learning_rate() -> None:
    verdict = judge_lower_lr(_result(PLATEAU_LOWER), 0.1, full=_result(PLATEAU_FULL), margin=0.1)
    assert verdict.kind is LowerLrKind.INCONCLUSIVE
    assert "inconclusive" in verdict.reason and "the learning rate is the cause" not in verdict.reason
    assert verdict.evidence["margin"] == 0.1


def test_a_decisive_fall_no_better_than_the_full_lr_is_inconclusive() -> None:
    lower = [3.4, 3.0, 2.7, 2.6, 2.5]  # falls by a quarter ...
    full = [3.4, 2.9, 2.6, 2.5, 2.6]  # ... as the full LR does on the same steps
    verdict = judge_lower_lr(_result(lower), 0.1, full=_result(full), margin=0.1)
    assert verdict.kind is LowerLrKind.INCONCLUSIVE and "not clearly below" in verdict.reason
    assert verdict.evidence["full_lr_last"] == pytest.approx(2.6)


def test_a_decisive_fall_well_under_the_full_lr_is_the_learning_rate() -> None:
    lower = [3.4, 3.0, 2.7, 2.6, 2.5]
    verdict = judge_lower_lr(_result(lower), 0.1, full=_result([3.4, 9.0, 20.0, 30.0, 45.0]), margin=0.1)
    assert verdict.kind is LowerLrKind.LR_IS_THE_CAUSE and "against 30 at the full learning rate" in verdict.reason
    gone = judge_lower_lr(_result(lower), 0.1, full=_result([3.4, 9.0, math.inf, math.nan, math.nan]), margin=0.1)
    assert gone.kind is LowerLrKind.LR_IS_THE_CAUSE and "goes non-finite at step 12" in gone.reason


@pytest.mark.parametrize("margin", [0.0, 1.0, -0.1])
def test_the_margin_is_a_fraction(margin: float) -> None:
    with pytest.raises(ValueError, match="margin"):
        judge_lower_lr(_result([3.0, 2.0, 1.0]), 0.1, full=_result([3.0, 3.0, 3.0]), margin=margin)


@pytest.mark.parametrize("name", ["lr_cause_margin", "fall_margin"])
@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, math.nan])
def test_the_margins_are_thresholds_and_fractions(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        Thresholds(**{name: value})
    assert 0 < getattr(Thresholds(), name) < 1


# ---------------------------------------------------------------------------- the FP32 reference for a recovery


def test_an_fp32_replay_that_barely_falls_with_no_level_is_no_reference() -> None:
    # what a Fabric fp16 run measured: FP32 from the start state over the remedied steps, 0.916 -> 0.885
    ref = fp32_reference([0.9161, 0.92, 0.90, 0.89, 0.91, 0.88, 0.8847, 0.89], level=None, margin=0.2)
    assert ref.level is None and "fell only from 0.9161 to 0.8847" in ref.why
    decisive = fp32_reference([2.0, 1.6, 1.3, 1.2, 1.1, 1.0], level=None, margin=0.2)
    assert decisive.level == pytest.approx(1.1) and "fell decisively" in decisive.why


def test_an_fp32_replay_must_end_near_the_healthy_level() -> None:
    far = fp32_reference([9.0, 8.0, 7.5, 7.0, 6.8, 6.5], level=1.0, margin=0.2)  # trained down, at 6.6x the level
    assert far.level is None and "not near it" in far.why
    near = fp32_reference([1.9, 1.7, 1.6, 1.5, 1.5, 1.4], level=1.0, margin=0.2)
    assert near.level == pytest.approx(1.5)
    assert fp32_reference([1.0, 0.9, math.nan, 0.8], level=1.0, margin=0.2).level is None
    assert fp32_reference([1.0, 1.1, 1.2, 1.3], level=1.0, margin=0.2).level is None  # did not train down


def _amp_confirmed(fp32_losses: list[float], level: float | None) -> Diagnosis:
    verdict = TrajectoryVerdict(TrajectoryKind.AMP_CONFIRMED, "an AMP fault", {}, tuple(fp32_losses),
                                fp32_reference(fp32_losses, level=level, margin=0.2))
    return with_facts(Diagnosis(Finding.FORWARD_OVERFLOW, 12, evidence={}), trajectory=verdict)


def test_without_a_level_a_plateau_fp32_trajectory_verifies_nothing() -> None:
    """Before: FP32 "trained down" (1.37 -> 1.35) made its median the reference, and a run at that plateau read as
    recovered. Now the outcome is not verified, and the reason says why."""
    reference, why = _reference(_amp_confirmed([1.367, 1.38, 1.36, 1.35, 1.34, 1.347], None), None, None)
    assert reference is None and "fell only from 1.367" in why
    recovery = judge_recovery([1.36, 1.35, 1.37, 1.34], steps=4, skipped=0, reference=reference, reference_from=why)
    assert recovery.outcome is Outcome.NOT_VERIFIED and "fell only from 1.367" in recovery.reason


def test_an_fp32_trajectory_far_above_the_level_does_not_stand_in_for_it() -> None:
    """Before: FP32 that trained down from 9 to 6.5, above a healthy 1.0, became the (higher, so more lenient)
    reference: a run at 6 would be "recovered". Now the healthy level stands."""
    reference, why = _reference(_amp_confirmed([9.0, 8.0, 7.5, 7.0, 6.8, 6.5], 1.0), 1.0, None)
    assert (reference, why) == (1.0, "the healthy loss level before the episode")
    near, why = _reference(_amp_confirmed([1.9, 1.7, 1.6, 1.5, 1.5, 1.4], 1.0), 1.0, None)
    assert near == pytest.approx(1.5) and "within 2x the healthy level 1" in why


# ---------------------------------------------------------------------------- the level a rollback goes back to

HEALTHY = [2.0 * 0.97**step for step in range(24)]


def _machine(losses: list[float | None], skipped: set[int] = frozenset()) -> tuple[AmpStateMachine, list]:
    machine = AmpStateMachine(PrecisionMode.FP16)
    obs = [Observation(step=i, skipped=i in skipped, loss=v, loss_finite=None if v is None else math.isfinite(v),
                       scale=2.0**10, lrs=(0.1,)) for i, v in enumerate(losses)]
    replay(machine, obs)
    recent = [(i, v) for i, v in enumerate(losses) if v is not None]
    return machine, recent


def test_a_healthy_stretch_before_the_resume_point_is_the_level() -> None:
    machine, recent = _machine(HEALTHY)
    at = machine.level_before(recent, 20)
    assert at.level == pytest.approx(statistics.median(HEALTHY[4:20])) and at.why is None
    assert (at.first_step, at.last_step, at.count) == (4, 19, 16)
    machine.rebase(at)
    assert machine.loss_level == at.level


@pytest.mark.parametrize("name, losses, skipped, words", [
    ("climbing", HEALTHY[:8] + [HEALTHY[7] * 1.25**i for i in range(1, 13)], set(), "climb"),
    ("non-finite", HEALTHY[:14] + [math.inf] + HEALTHY[15:20], {14}, "non-finite one (step 14)"),
    ("skip streak", HEALTHY[:20], {15, 16}, "skipped steps in a row (from step 15)"),
])
def test_an_unhealthy_stretch_before_the_resume_point_is_no_level(name: str, losses: list[float], skipped: set[int],
                                                                    words: str) -> None:
    """Before: the median of whatever the window held became the healthy level after a rollback."""
    machine, recent = _machine(losses, skipped)
    at = machine.level_before(recent, 20)
    assert at.level is None and words in (at.why or "") and "not a healthy stretch" in (at.why or "")
    machine.rebase(at)
    assert machine.loss_level is None
    ev = machine.reference_evidence(25)
    assert ev["loss_reference"] is None and words in ev["loss_reference_why"]
    assert "the run went back to step 20" in ev["loss_reference_why"]


def test_a_slow_build_over_the_healthy_level_is_no_level() -> None:
    machine, _ = _machine(HEALTHY)
    level = machine.loss_level
    assert level is not None
    build = [(24 + i, level * 3.0 * 1.02**i) for i in range(16)]  # 3x the level, each step a little higher
    at = machine.level_before(build, 40)
    assert at.level is None and "a slow build" in (at.why or "")


def test_a_healthy_level_where_the_run_went_back_is_the_reference_only_when_it_was_healthy() -> None:
    plain = Diagnosis(Finding.GRADIENT_OVERFLOW, 30, evidence={})
    higher = LevelAt(20, 1.5, 4, 19, count=16)
    assert _reference(plain, 1.0, higher) == (1.5, "the healthy loss level where the run went back to (step 20)")
    unhealthy = LevelAt(20, None, 4, 19, "the run went back to step 20, and the losses ... climb: not a healthy "
                                         "stretch")
    assert _reference(plain, 1.0, unhealthy) == (1.0, "the healthy loss level before the episode")


def test_a_run_that_ends_before_its_remedy_is_judged_says_so() -> None:
    treatment = Treatment(policy=RemedyPolicy(frozenset()), recovery_steps=8)
    assert treatment.finish(20) is None  # nothing watched
    d = Diagnosis(Finding.FORWARD_OVERFLOW, 9, evidence={"precision": "fp16"}, remedy="fp32_island")
    treatment.watch = Watch(d, start=10, steps_before=10, skipped_before=0, reference=1.0,
                            reference_from="the healthy loss level before the episode")
    ended = treatment.finish(13)
    assert ended is not None and treatment.watch is None and ended.old is d
    assert ended.new.outcome == "not_verified"  # said as such (API.md), never assumed recovered
    assert ended.new.evidence["recovery"]["reason"] == ("the run ended 3 optimizer steps after the remedy, before the 8 "
                                                        "its recovery is judged over")
    assert facts_of(ended.new).recovery.unverified is Unverified.RUN_ENDED


@pytest.mark.parametrize("first, words", [(True, "against the run's first loss of 0.5"),
                                          (False, "against a healthy level of 0.5")])
def test_the_advice_names_the_level_by_its_typed_origin(first: bool, words: str) -> None:
    """The advice reads which level the control was measured against from the typed origin, not from a sentence."""
    ev = {"loss_level": 0.5, "fp32_control_loss": 2000.0}  # no loss_level_from sentence to read
    advice = advise(Finding.FP32_UNSTABLE, ev, control_diverging=True, against_first_loss=first)
    assert words in advice


def test_a_rollback_to_the_start_is_held_to_what_the_run_first_reached_on_the_same_steps() -> None:
    """One loss before the resume point is not a stretch (it shows no climb): the remedied run is held instead to
    the losses the run first had on the steps it runs again, which came before the episode."""
    losses = HEALTHY[:20] + [math.inf] * 4
    machine, recent = _machine(losses, {20, 21, 22, 23})
    assert machine.state.episode is not None and machine.state.episode.onset >= 9
    at = machine.level_before(recent, 1)
    assert at.ahead and (at.first_step, at.last_step, at.count) == (1, 8, 8)
    assert at.level == pytest.approx(statistics.median(HEALTHY[1:9]))
    assert _reference(Diagnosis(Finding.LR_SCHEDULE, 21, evidence={}), HEALTHY[19], at) == (
        at.level, "what the run first reached from the same state, on steps 1..8 before the episode")


def test_steps_run_again_that_reach_into_the_episode_are_no_reference() -> None:
    losses = HEALTHY[:6] + [math.inf] * 4
    machine, recent = _machine(losses, {6, 7, 8, 9})
    assert machine.state.episode is not None and machine.state.episode.onset < 9
    at = machine.level_before(recent, 1)
    # the one loss before shows no climb, so it is no level either (it was taken as one before)
    assert not at.ahead and at.level is None and "only 1 loss was read" in (at.why or "")
