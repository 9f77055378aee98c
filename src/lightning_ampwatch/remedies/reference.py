"""What a remedy's recovery is measured against (:func:`recovery_reference`): only ever a reference known to be
healthy, a level from before the trouble or a replay from the same state that itself trained down, or none, and then
why. The treatment (:mod:`~lightning_ampwatch.remedies.treatment`) watches a remedy against it."""

from __future__ import annotations

import math
import statistics
from typing import Any

from lightning_ampwatch.machine import LevelAt, Thresholds
from lightning_ampwatch.records import RollbackKind, TrajectoryKind, facts_of
from lightning_ampwatch.remedies.policy import REMEDY_OF
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch.verdicts import fp32_reference


def _fp32_reached(diagnosis: Diagnosis, trajectory: Any, fp32: Any, steps: int) -> tuple[float, str]:
    """What FP32 reached replaying the episode's steps. After a rollback to the replays' own snapshot (the episode's
    batches skipped), the remedied run is judged on its first ``steps`` steps from that state: FP32's first
    ``steps`` losses from it, not where its whole window ended, which came from more updates than the run has had.
    (A fresh run rolled back to step 1 was judged 'not recovered' against the end of a 16-step FP32 window after 8
    steps, and escalated to bf16, though its island had cured the replays.)"""
    facts = facts_of(diagnosis)
    rollback, report = facts.rollback, facts.interventions
    first = [v for v in trajectory.fp32_losses[:steps] if v is not None and math.isfinite(v)]
    if (steps and rollback is not None and rollback.resumed_at is not None and rollback.retrained is None
            and report is not None and rollback.snapshot_step == report.from_step
            and steps < len(trajectory.fp32_losses) and len(first) == steps):
        return statistics.median(first), (
            f"what FP32 reached over its first {steps} steps from the same snapshot (after step "
            f"{rollback.snapshot_step}), as many as the run has trained since going back to it (over the whole "
            f"window it {fp32.why})")
    return fp32.level, f"what FP32 reached replaying the episode's steps (it {fp32.why})"


def recovery_reference(diagnosis: Diagnosis, level: float | None, then: LevelAt | None,
               margin: float = Thresholds.fall_margin, steps: int = 0) -> tuple[float | None, str]:
    """What the loss must come back to: only ever a reference known to be healthy. ``level`` is the healthy level
    from before the episode (None when the episode began before any healthy stretch). After a rollback, the level the
    run had where it went back to (``then``), if higher (it cannot be asked to be better than that), and only when
    that stretch was itself healthy (:meth:`~lightning_ampwatch.machine.AmpStateMachine.level_before`). Where the
    FP32 replay confirmed an AMP fault, what FP32 reached on the episode's own steps, if higher, and only when that
    replay was healthy (:func:`~lightning_ampwatch.verdicts.fp32_reference`: trained down near the healthy level, or
    with no level, fell decisively). With neither, nothing: the outcome is then not verified, never "recovered"
    against a level made of the trouble itself, and ``reference_from`` says why."""
    facts = facts_of(diagnosis)
    trajectory = facts.trajectory
    fp32 = trajectory.fp32_reference if trajectory is not None and trajectory.kind is TrajectoryKind.AMP_CONFIRMED \
        else None
    if level is None and facts.rollback is not None and facts.rollback.kind in (RollbackKind.NONE, RollbackKind.OFF):
        # applied in place, steps after the replays' start: what they reached came from more (or other) updates than
        # the run has had since, so it is no level for it; FP32 from the same state on the same steps is replayed
        return None, ("nothing: there was no healthy loss level before the episode, and the remedy was applied in "
                      "place, later than the replays of the episode began")
    if level is not None:
        if then is not None and then.level is not None and then.level > level:
            if then.ahead:
                return then.level, (f"what the run first reached from the same state, on steps {then.first_step}.."
                                    f"{then.last_step} before the episode")
            return then.level, f"the healthy loss level where the run went back to (step {then.resumed_at})"
        if fp32 is not None and fp32.level is not None:
            reached = _fp32_reached(diagnosis, trajectory, fp32, steps)
            if reached[0] > level:
                return reached
        return level, "the healthy loss level before the episode"
    if fp32 is not None and fp32.level is not None:
        return _fp32_reached(diagnosis, trajectory, fp32, steps)
    cured = _cured_replay_reference(diagnosis, margin)
    if cured is not None:
        return cured
    why = "nothing: there was no healthy loss level before the episode"
    if fp32 is not None:
        why += f"; FP32 replaying the episode's steps {fp32.why}"
    return None, why


def _cured_replay(diagnosis: Diagnosis) -> tuple[Any, Any] | None:
    """The interventions' report and the replay of the applied remedy's own intervention, where it cured the window;
    None otherwise (no interventions ran, no remedy, or its replay did not cure)."""
    facts = facts_of(diagnosis)
    report, applied = facts.interventions, facts.remedy
    if report is None or applied is None:
        return None
    kind = next((k for k, r in REMEDY_OF.items() if r is applied.name), None)
    tried = report.get(kind) if kind is not None else None
    return (report, tried) if tried is not None and tried.cured else None


def _cured_replay_reference(diagnosis: Diagnosis, margin: float = Thresholds.fall_margin) -> tuple[float, str] | None:
    """What the remedy's own intervention reached when it cured the replayed window (the run is then judged by
    whether it tracks its cured replay), only when that replay trained down; None otherwise."""
    cured = _cured_replay(diagnosis)
    if cured is None:
        return None
    report, tried = cured
    found = fp32_reference(tried.losses, level=None, margin=margin)  # a decisive fall only: noise verifies nothing
    if found.level is None:
        return None
    return found.level, (f"what its cured replay ({tried.label}) reached on steps {report.window[0]}-"
                         f"{report.window[1]} (it {found.why})")


def cured_replay_track(diagnosis: Diagnosis) -> tuple[dict[int, float], str] | None:
    """The remedy's own cured replay of the window, as a reference trajectory (step -> loss) the run must track:
    where the replay neither fell decisively nor had a level to come back to."""
    cured = _cured_replay(diagnosis)
    if cured is None:
        return None
    report, tried = cured
    track = {s: v for s, v in zip(tried.result.steps, tried.result.losses) if v is not None and math.isfinite(v)}
    if len(track) < 3:
        return None
    return track, f"its cured replay ({tried.label}, steps {report.window[0]}-{report.window[1]})"
