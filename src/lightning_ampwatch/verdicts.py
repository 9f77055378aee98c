"""Verdict helpers: what a measurement made during an investigation says about a finding.

Pure Python (no torch, no Lightning), like the machine: the investigation measures, these functions judge.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Sequence

from lightning_ampwatch.taxonomy import Finding

#: Findings that blame reduced precision, and so are put to the FP32 control.
AMP_BLAMING = frozenset({Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.GRADIENT_OVERFLOW,
                         Finding.GROWTH_OVERFLOW})

#: How far above the run's loss level a finite control loss must be to read as instability rather than AMP.
CONTROL_LEVEL_RATIO = 1e3


class ControlVerdict(str, Enum):
    """What the single-batch FP32 control concluded; the sentence users read is :attr:`ControlResult.reason`."""

    NOT_RUN = "not_run"
    FAILED = "failed"  # FP32 fails too, on a finding that does not blame AMP (it stands)
    FINITE = "finite"  # FP32 is finite, on a finding that does not blame AMP (it stands)
    DATA = "data"  # FP32 fails too and the batch holds non-finite values: the data
    NOT_AMP = "not_amp"  # FP32 fails too: the optimisation
    DIVERGING = "diverging"  # FP32 finite but orders of magnitude above the loss level: the optimisation
    AMP_FAULT = "amp_fault"  # FP32 finite near the level: reduced precision is at fault


class LevelOrigin(str, Enum):
    """What the loss level a single-batch control is measured against is: the run's healthy level, or, while there is
    none yet, its first loss. :attr:`words` is what the evidence (``loss_level_from``) and the verdict print."""

    HEALTHY = "healthy"
    FIRST_LOSS = "first_loss"

    @property
    def words(self) -> str:
        return "the run's loss level" if self is LevelOrigin.HEALTHY else \
            "the run's first loss (there is no healthy level yet)"


@dataclass(frozen=True)
class ControlResult:
    """The FP32 control's conclusion: the finding it leaves standing, the verdict, and why in a few words."""

    finding: Finding
    verdict: ControlVerdict
    reason: str
    control_loss: float | None = None


def control_result(finding: Finding, *, control_loss: float | None, control_grads_finite: bool | None,
                   batch_nonfinite: bool, loss_level: float | None,
                   level_origin: LevelOrigin = LevelOrigin.HEALTHY, amp_nonfinite: bool = False) -> ControlResult:
    """What the FP32 control says about a finding. ``level_origin`` says what ``loss_level`` is (the run's healthy
    level, or its first loss when there is no healthy level yet). ``amp_nonfinite``: the replay of the same batch
    at the run's precision went non-finite.

    A control that fails too clears AMP: the data (if the batch holds NaN/inf) or the optimisation is at fault.
    A control that is finite but orders of magnitude above the run's usual loss reads as divergence, not AMP.
    Findings that do not blame reduced precision (data, LR schedule) keep their name; the control is evidence.
    """
    def result(kept: Finding, verdict: ControlVerdict, reason: str) -> ControlResult:
        return ControlResult(kept, verdict, reason, control_loss)

    if control_loss is None:
        return result(finding, ControlVerdict.NOT_RUN, "control not run")
    control_failed = not math.isfinite(control_loss) or control_grads_finite is False
    if finding is Finding.DATA_NONFINITE and not control_failed and amp_nonfinite:
        # the batch's NaN/inf do not reach the loss in float32, while the same batch goes non-finite at the run's
        # precision: the reduced precision did it (the non-finite values are a mask, or a column never read)
        return result(Finding.FORWARD_OVERFLOW, ControlVerdict.AMP_FAULT,
                      "control finite although the batch holds non-finite values, which never reach the loss in "
                      "float32; at the run's precision the same batch goes non-finite: an AMP fault")
    if finding not in AMP_BLAMING:
        return result(finding, ControlVerdict.FAILED, "control failed too") if control_failed else \
            result(finding, ControlVerdict.FINITE, "control finite")
    if control_failed:
        if batch_nonfinite:
            return result(Finding.DATA_NONFINITE, ControlVerdict.DATA,
                          "control failed too; the batch holds non-finite values")
        return result(Finding.FP32_UNSTABLE, ControlVerdict.NOT_AMP, "control failed too: not an AMP fault")
    if loss_level is not None and loss_level > 0 and control_loss > CONTROL_LEVEL_RATIO * loss_level:
        return result(Finding.FP32_UNSTABLE, ControlVerdict.DIVERGING, (
            f"control finite but {control_loss / loss_level:.3g}x {level_origin.words}: the optimisation is "
            "diverging (or this batch is far outside the data seen so far)"))
    return result(finding, ControlVerdict.AMP_FAULT, "control finite: an AMP fault")


#: After a remedy the loss must come back within this factor of its level before the episode to count as
#: recovered: a run whose NaNs stopped but whose loss stays several times higher was ruined, not fixed.
RECOVERY_LOSS_FACTOR = 2.0


class Outcome(str, Enum):
    """A remedy's outcome. ``NOT_VERIFIED`` is neither "fixed" nor a reason to escalate; ``Diagnosis.outcome`` says
    ``"not_verified"`` (API.md), with the reason in the evidence."""

    RECOVERED = "recovered"
    NOT_RECOVERED = "not_recovered"
    NOT_VERIFIED = "not_verified"
    RELAPSED = "relapsed"  # it recovered, then the same fault came back later in the run: the recovery taken back

    @property
    def published(self) -> str | None:
        """The value ``Diagnosis.outcome`` takes: the name (``"not_verified"`` too: a script must be able to tell a
        watch that ended unverified from no remedy or one still watched, which are None)."""
        return self.value


class Unverified(str, Enum):
    """Why a remedy's outcome is not verified."""

    NO_REFERENCE = "no_reference"  # no loss to compare with a level before the episode
    INTERRUPTED = "interrupted"  # another alarm was treated before it could be judged
    RUN_ENDED = "run_ended"  # the run ended while it was watched


RECOVERED, NOT_RECOVERED = Outcome.RECOVERED, Outcome.NOT_RECOVERED


@dataclass(frozen=True)
class Recovery:
    """Whether a remedied run is verifiably healthy again, with the numbers it rests on (``unverified``: why not,
    when the outcome is ``NOT_VERIFIED``)."""

    outcome: Outcome
    reason: str
    details: dict[str, Any]
    unverified: Unverified | None = None


def _still_unwell(values: Sequence[float], finite: Sequence[float], steps: int, skipped: int,
                  details: dict[str, Any]) -> Recovery | None:
    """Not recovered, whatever the reference: a loss still non-finite, more than one skip (the scaler may probe
    once), or a loss still climbing. None: none of these."""
    if len(finite) < len(values):
        return Recovery(NOT_RECOVERED, f"{len(values) - len(finite)} of the {len(values)} losses after it are still "
                                       "non-finite", details)
    if skipped > 1:
        return Recovery(NOT_RECOVERED, f"the scaler still skipped {skipped} of the {steps} steps after it", details)
    if climbing(finite):
        third = max(1, len(finite) // 3)
        return Recovery(NOT_RECOVERED, f"the loss is still climbing after it ({statistics.median(finite[:third]):.4g}"
                                       f" -> {statistics.median(finite[-third:]):.4g})", details)
    return None


def judge_recovery(losses: Sequence[float], *, steps: int, skipped: int, reference: float | None,
                   reference_from: str) -> Recovery:
    """The outcome of a remedy from the ``steps`` optimizer steps after it: recovered only when at most one of
    them was skipped (dynamic scaling may still probe once), every loss read is finite, and their median is within
    ``RECOVERY_LOSS_FACTOR`` of ``reference`` (the loss level before the episode, or what an FP32 replay reached:
    ``reference_from`` says which). Without a reference or a loss, nothing is verified (``NOT_VERIFIED``)."""
    finite = [x for x in losses if math.isfinite(x)]
    after = statistics.median(finite) if finite else None
    details: dict[str, Any] = {"steps": steps, "skipped": skipped, "loss_after": after, "loss_before": reference,
                               "loss_before_from": reference_from}
    unwell = _still_unwell(losses, finite, steps, skipped, details)
    if unwell is not None:
        return unwell
    if after is None or reference is None or not reference > 0:
        why = reference_from if reference_from.startswith("nothing: ") else "nothing: no loss was read"
        return Recovery(Outcome.NOT_VERIFIED, f"there is no healthy reference to compare the loss with "
                                              f"({why[len('nothing: '):]})", details,
                        Unverified.NO_REFERENCE)
    ratio = after / reference
    details["loss_ratio"] = round(ratio, 4)
    if ratio > RECOVERY_LOSS_FACTOR:
        return Recovery(NOT_RECOVERED, f"the loss is {ratio:.3g}x {reference_from} "
                                       f"({after:.4g} against {reference:.4g})", details)
    return Recovery(RECOVERED, f"{steps} steps after it: {skipped} skipped, the loss {after:.4g} is {ratio:.3g}x "
                               f"{reference_from} ({reference:.4g})", details)


def judge_tracking(losses: Sequence[tuple[int, float]], track: dict[int, float], *, steps: int, skipped: int,
                   track_from: str, tolerance: float, same_batches: bool = True) -> Recovery:
    """The outcome of a remedy with no healthy level to come back to, judged against a reference trajectory
    (``track``: step -> loss): FP32 training from the same state over the same steps, or the remedy's own cured
    replay of the window. Recovered when at most one step was skipped, every loss is finite, the run's loss tracks
    the reference within ``tolerance`` (the median of its ratios to the reference, step by step, at most
    ``1 + tolerance``), and it trains down (its last three's median more than ``tolerance`` under its first), or
    holds where the reference holds too. Else not recovered where it plainly lags, not verified where only the trend
    is in doubt. ``same_batches``: the reference ran the very batches the run did (FP32 from the same state); where
    it did not (the cured replay of the window, whose batches a rollback skipped), a lag beyond the tolerance but
    within ``RECOVERY_LOSS_FACTOR`` is batch noise as much as a fault: not verified, never escalated on."""
    values = [loss for _, loss in losses]
    finite = [x for x in values if math.isfinite(x)]
    after = statistics.median(finite) if finite else None
    details: dict[str, Any] = {"steps": steps, "skipped": skipped, "loss_after": after, "loss_before": None,
                               "loss_before_from": track_from, "track_tolerance": tolerance}
    unwell = _still_unwell(values, finite, steps, skipped, details)
    if unwell is not None:
        return unwell
    pairs = [(loss, track[s]) for s, loss in losses if s in track and math.isfinite(track[s]) and track[s] > 0]
    if len(pairs) < 3:  # different steps (a rollback renumbered them): the levels over the judged steps
        ref = [v for v in track.values() if math.isfinite(v)]
        if len(ref) < 3 or len(finite) < 3:
            return Recovery(Outcome.NOT_VERIFIED, f"there is no healthy reference to compare the loss with (too few "
                                                  f"steps in common with {track_from})", details,
                            Unverified.NO_REFERENCE)
        reference = statistics.median(ref[-max(3, len(ref) // 3):])
        ratio = statistics.median(finite[-max(3, len(finite) // 3):]) / reference
        ref_first, ref_end = ref[0], statistics.median(ref[-3:])
    else:
        ratio = statistics.median(a / b for a, b in pairs)
        reference = statistics.median(b for _, b in pairs)
        ref_losses = [b for _, b in pairs]
        ref_first, ref_end = ref_losses[0], statistics.median(ref_losses[-3:])
    details.update(loss_before=reference, loss_ratio=round(ratio, 4))
    allowed = f"{tolerance * 100:.3g}%"
    first, end = finite[0], statistics.median(finite[-3:])
    if ratio > 1 + tolerance and not same_batches and ratio <= RECOVERY_LOSS_FACTOR:
        return Recovery(Outcome.NOT_VERIFIED, f"the loss is {ratio:.3g}x {track_from}, more than the {allowed} "
                                              "allowed, on other batches than the run's: no recovery is claimed",
                        details, Unverified.NO_REFERENCE)
    if ratio > 1 + tolerance:
        return Recovery(NOT_RECOVERED, f"the loss does not track {track_from}: {ratio:.3g}x it, more than the "
                                       f"{allowed} allowed ({after:.4g} against {reference:.4g})", details)
    if end < (1 - tolerance) * first:
        trend = f"trains down ({first:.4g} -> {end:.4g})"
    elif not ref_end < (1 - tolerance) * ref_first:
        moved = "holds" if end <= (1 + tolerance) * first else "rises"
        trend = (f"{moved} ({first:.4g} -> {end:.4g}) as the reference does on the same batches ({ref_first:.4g} -> "
                 f"{ref_end:.4g})")
    else:
        return Recovery(Outcome.NOT_VERIFIED, (
            f"the loss tracks {track_from} within {allowed} ({ratio:.3g}x it), but it does not train down ({first:.4g} -> {end:.4g}) while the "
            f"reference does ({ref_first:.4g} -> {ref_end:.4g})"), details, Unverified.NO_REFERENCE)
    return Recovery(RECOVERED, f"{steps} steps after it: {skipped} skipped, every loss finite, the loss {after:.4g} "
                               f"tracks {track_from} ({reference:.4g}): {ratio:.3g}x it, within the {allowed} "
                               f"allowed, and {trend}", details)


def judge_decisive_fall(losses: Sequence[float], *, steps: int, skipped: int, margin: float,
                        why: str) -> Recovery | None:
    """For a fault that stopped training from progressing (a stall): the run, with no reference to track, is
    recovered when nothing was skipped (one probe aside), every loss is finite and its loss fell decisively
    (the median of its last three at least ``margin`` under its first). None when it has not (yet)."""
    finite = [x for x in losses if math.isfinite(x)]
    if len(finite) < len(losses) or len(finite) < 3 or skipped > 1:
        return None
    first, end = finite[0], statistics.median(finite[-3:])
    if not end <= (1 - margin) * first:
        return None
    return Recovery(RECOVERED, (
        f"{steps} steps after it: {skipped} skipped, every loss finite, and the loss fell decisively, from {first:.4g} "
        f"to {end:.4g} (at least the {margin:.0%} fall_margin): {why}"),
        {"steps": steps, "skipped": skipped, "loss_after": statistics.median(finite), "loss_before": None,
         "loss_first": first, "loss_end": end, "fall_margin": margin})


def climbing(losses: Sequence[float]) -> bool:
    """The losses (in step order) climb: the median of their last third is more than twice that of their first."""
    if len(losses) < 3:
        return False
    third = max(1, len(losses) // 3)
    return statistics.median(losses[-third:]) > 2.0 * statistics.median(losses[:third])


# --------------------------------------------------------------------------------------------
# The FP32 trajectory control's verdict (the replay itself is in trajectory.py)
# --------------------------------------------------------------------------------------------


@dataclass
class TrajectoryResult:
    """What one replay of a window measured, as plain Python values."""

    precision: str  # "fp32" or "amp"
    from_step: int  # the snapshot's step: the replay starts after it
    steps: list[int]
    losses: list[float | None]  # each step's loss as Lightning reports it (None: training_step returned None)
    skipped: list[bool]  # the scaler skipped the step (always False without one)
    params_finite: bool  # the weights after the last replayed step
    #: per step, the largest finite output magnitude of the watched modules (``replay_trajectory``'s ``watch``)
    absmax: list[float] = field(default_factory=list)

    @property
    def first_nonfinite(self) -> int | None:
        """The first step whose loss is non-finite (or the last step, when only the weights it left are)."""
        bad = next((s for s, loss in zip(self.steps, self.losses) if loss is not None and not math.isfinite(loss)),
                   None)
        if bad is None and not self.params_finite and self.steps:
            return self.steps[-1]
        return bad

    @property
    def faulted(self) -> bool:
        """A non-finite loss or weight, or a step the scaler skipped, anywhere in the window."""
        return self.first_nonfinite is not None or any(self.skipped)




class TrajectoryKind(str, Enum):
    """What the trajectory control concluded."""

    AMP_CONFIRMED = "amp_confirmed"  # FP32 training over the window is fine; the fault is reduced precision's
    FP32_DIVERGES = "fp32_diverges"  # FP32 training climbs far above the level before the onset
    FP32_NONFINITE = "fp32_nonfinite"  # FP32 training goes non-finite too
    NOT_REPRODUCED = "not_reproduced"  # the run's own precision, replayed from the snapshot, does not fault


@dataclass(frozen=True)
class TrajectoryVerdict:
    """The trajectory control's conclusion, why in a sentence, and the numbers it rests on."""

    kind: TrajectoryKind
    reason: str  # plain words, for the diagnosis
    evidence: dict[str, Any]  # JSON-ready: non-finite losses are strings
    fp32_losses: tuple[float | None, ...] = ()  # the FP32 replay's losses, as numbers
    fp32_reference: Fp32Reference | None = None  # what they offer a recovery check (:func:`fp32_reference`)


def judge_trajectory(fp32: TrajectoryResult, amp: TrajectoryResult | None, loss_level: float | None,
                     divergence_ratio: float) -> TrajectoryVerdict:
    """See :func:`_judge_trajectory`; the verdict carries the FP32 losses as numbers too."""
    verdict = _judge_trajectory(fp32, amp, loss_level, divergence_ratio)
    return replace(verdict, fp32_losses=tuple(fp32.losses))


def _judge_trajectory(fp32: TrajectoryResult, amp: TrajectoryResult | None, loss_level: float | None,
                      divergence_ratio: float) -> TrajectoryVerdict:
    """What the FP32 trajectory (and, when run, the replay at the run's precision) says about the fault.

    FP32 going non-finite, or above ``divergence_ratio`` x ``loss_level`` (the loss before the onset), clears AMP.
    Otherwise an amp replay that does not fault again means the fault did not reproduce: AMP is not blamed either.
    """
    if not (isinstance(divergence_ratio, (int, float)) and divergence_ratio > 1):
        raise ValueError(f"divergence_ratio={divergence_ratio!r}: expected a number above 1")
    window = f"steps {fp32.steps[0]}-{fp32.steps[-1]}" if len(fp32.steps) > 1 else f"step {fp32.steps[0]}"
    start = (f"from the snapshot after step {fp32.from_step}" if fp32.from_step >= 0 else
             "from the snapshot taken at the fit's start, before its first step")
    evidence: dict[str, Any] = {
        "window": [fp32.steps[0], fp32.steps[-1]], "snapshot_step": fp32.from_step,
        "fp32_losses": [_json_float(v) for v in fp32.losses], "loss_level": _json_float(loss_level),
        "divergence_ratio": divergence_ratio,
    }
    if amp is not None:
        evidence["amp_losses"] = [_json_float(v) for v in amp.losses]
        evidence["amp_skipped"] = amp.skipped
    finite = [v for v in fp32.losses if v is not None and math.isfinite(v)]
    peak = max(finite, default=None)
    bad = fp32.first_nonfinite
    if bad is not None:
        return TrajectoryVerdict(TrajectoryKind.FP32_NONFINITE, (
            f"FP32 training {start} goes non-finite too, at step {bad}: not an AMP fault"), evidence)
    has_level = loss_level is not None and loss_level > 0 and math.isfinite(loss_level)
    climb = _fp32_climb(fp32, loss_level, divergence_ratio) if has_level else None
    if climb is not None:
        (cross_at, cross), (peak_at, peak) = climb
        return TrajectoryVerdict(TrajectoryKind.FP32_DIVERGES, (
            f"FP32 training {start} passes {divergence_ratio:g}x the level {loss_level:.4g} before the onset at "
            f"step {cross_at} (loss {cross:.4g}) and keeps climbing, to {peak:.4g} at step {peak_at}: the "
            "optimisation diverges without reduced precision, so it is not an AMP fault"), evidence)
    if not has_level and finite:
        # No healthy level to compare with: judge the FP32 run by its own shape, from where it started
        start_loss = finite[0]
        evidence["judged_by"] = "its own shape: there is no healthy loss level before the onset"
        evidence["start_loss"] = start_loss
        shape = _fp32_climb(fp32, start_loss, divergence_ratio) if start_loss > 0 else None
        amp_alike = amp is None or amp.faulted or any(
            v is not None and math.isfinite(v) and v > divergence_ratio * start_loss for v in amp.losses)
        if shape is not None and amp_alike:
            (cross_at, cross), (peak_at, peak) = shape
            return TrajectoryVerdict(TrajectoryKind.FP32_DIVERGES, (
                f"FP32 training {start} begins at loss {start_loss:.4g}, passes {divergence_ratio:g}x that at step "
                f"{cross_at} (loss {cross:.4g}) and keeps climbing, to {peak:.4g} at step {peak_at}, as the run's "
                "own precision does: the optimisation diverges without reduced precision, so it is not an AMP "
                "fault (there was no healthy level before the onset; the FP32 run is judged by its own shape)"),
                evidence)
    level_words = (f"at most {peak / loss_level:.3g}x the level {loss_level:.4g} before the onset" if has_level
                   and peak is not None else
                   f"from {finite[0]:.4g} to at most {peak:.4g}, with no healthy level before the onset" if finite
                   else "no loss level before the onset to compare with")
    fp32_words = f"FP32 training {start} stays finite over {window} ({level_words})"
    if amp is not None and not amp.faulted:
        return TrajectoryVerdict(TrajectoryKind.NOT_REPRODUCED, (
            f"{fp32_words}, and replayed at the run's own precision the same steps stay finite with no skipped "
            "step: the fault did not reproduce, so it is not blamed on AMP"), evidence)
    if amp is None:
        amp_words = "; the run's own precision was not replayed"
    else:
        again = amp.first_nonfinite if amp.first_nonfinite is not None else amp.steps[amp.skipped.index(True)]
        amp_words = f"; at the run's own precision the fault comes back at step {again}"
    return TrajectoryVerdict(TrajectoryKind.AMP_CONFIRMED, f"{fp32_words}{amp_words}: an AMP fault", evidence)


#: After the FP32 loss passes ``divergence_ratio`` x its level it must climb this much further within the window to
#: count as diverging: a loss that jumps once and stays (harder batches, a shift in the data) is not a divergence.
CLIMB_AFTER_CROSSING = 2.0


def _fp32_climb(fp32: TrajectoryResult, loss_level: float, divergence_ratio: float
                ) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """((step, loss) where the FP32 loss first passed ``divergence_ratio`` x the level, (step, loss) of a later
    loss ``CLIMB_AFTER_CROSSING`` x higher still), or None when the FP32 run did not keep climbing."""
    points = [(s, v) for s, v in zip(fp32.steps, fp32.losses) if v is not None and math.isfinite(v)]
    cross = next(((i, p) for i, p in enumerate(points) if p[1] > divergence_ratio * loss_level), None)
    if cross is None:
        return None
    later = max(points[cross[0] + 1:], key=lambda p: p[1], default=None)
    if later is None or later[1] < CLIMB_AFTER_CROSSING * cross[1][1]:
        return None
    return cross[1], later


def _json_float(value: float | None) -> float | str | None:
    return value if value is None or math.isfinite(value) else str(value)


# --------------------------------------------------------------------------------------------
# The lower-LR counterfactual: the same window, the run's own precision, the learning rate lowered
# --------------------------------------------------------------------------------------------

#: How much lower the counterfactual replay runs the learning rate: a rate that diverges is seldom only a few
#: times too high, and a tenth is what the FP32_UNSTABLE remedy tries first.
LOWER_LR_FACTOR = 0.1


class LowerLrKind(str, Enum):
    """What the replay at a lower learning rate showed."""

    LR_IS_THE_CAUSE = "lr_is_the_cause"  # clean, and its loss falls decisively, well under the full-LR replay's
    STILL_FAULTS = "still_faults"  # it still overflows or goes non-finite at the lower LR
    DOES_NOT_FALL = "does_not_fall"  # clean, but its loss does not fall: nothing concluded
    INCONCLUSIVE = "inconclusive"  # clean and falling, but not by the margin, or not clearly under the full LR's
    TOO_SHORT = "too_short"  # too few steps to see a trend


@dataclass(frozen=True)
class LowerLrVerdict:
    """The counterfactual's conclusion, why in a sentence, and the numbers it rests on (JSON-ready)."""

    kind: LowerLrKind
    reason: str
    factor: float
    evidence: dict[str, Any]


def judge_lower_lr(lower: TrajectoryResult, factor: float, *, full: TrajectoryResult, margin: float
                   ) -> LowerLrVerdict:
    """What the window replayed at the run's own precision with every learning rate times ``factor`` says, against
    ``full``: the same steps from the same snapshot at the full learning rate in FP32 (no reduced precision, so its
    losses are the learning rate's own). The learning rate is the cause only when the lower-LR replay is clean (no
    non-finite loss or weight, at most one skip: the scaler may probe its scale once), its loss falls decisively
    (the median of its last three at least ``margin`` under its first, never above ``CLIMB_AFTER_CROSSING`` x its
    first), and it ends clearly better than the full-LR replay (its median of the last three at least ``margin``
    under that replay's on the same steps, or that replay went non-finite). A fall smaller than that, as noise on a
    plateau makes, is ``INCONCLUSIVE``: nothing is concluded from it."""
    if not 0 < margin < 1:
        raise ValueError(f"margin={margin!r}: expected a fraction in (0, 1)")
    evidence: dict[str, Any] = {"factor": factor, "losses": [_json_float(v) for v in lower.losses],
                                "skipped": lower.skipped, "margin": margin}
    lr = f"the learning rate x{factor:g}"
    if lower.first_nonfinite is not None or sum(lower.skipped) > 1:
        return LowerLrVerdict(LowerLrKind.STILL_FAULTS, (
            f"replayed at the run's own precision with {lr}, the same steps still fault"), factor, evidence)
    finite = [v for v in lower.losses if v is not None and math.isfinite(v)]
    if len(finite) < 3:
        return LowerLrVerdict(LowerLrKind.TOO_SHORT, (
            f"replayed at the run's own precision with {lr}, the window is too short ({len(finite)} losses) to see "
            "whether the loss falls"), factor, evidence)
    first, last = finite[0], statistics.median(finite[-3:])
    if not last < first or max(finite) > CLIMB_AFTER_CROSSING * first:
        return LowerLrVerdict(LowerLrKind.DOES_NOT_FALL, (
            f"replayed at the run's own precision with {lr}, the same steps train clean but the loss does not fall "
            f"({first:.4g} -> {last:.4g}): nothing is concluded about the learning rate"), factor, evidence)
    clean = f"replayed at the run's own precision with {lr}, the same steps train clean"
    if last > (1 - margin) * first:
        return LowerLrVerdict(LowerLrKind.INCONCLUSIVE, (
            f"{clean} and the loss falls from {first:.4g} to {last:.4g}, by less than the {margin:.0%} needed: "
            "inconclusive, nothing is concluded about the learning rate"), factor, evidence)
    full_finite = [v for v in full.losses if v is not None and math.isfinite(v)]
    if full.first_nonfinite is not None:
        versus = f"while at the full learning rate FP32 goes non-finite at step {full.first_nonfinite}"
    elif len(full_finite) >= 3 and last <= (1 - margin) * statistics.median(full_finite[-3:]):
        full_last = statistics.median(full_finite[-3:])
        evidence["full_lr_last"] = full_last
        versus = f"against {full_last:.4g} at the full learning rate in FP32 on the same steps"
    else:
        full_last = statistics.median(full_finite[-3:]) if len(full_finite) >= 3 else None
        evidence["full_lr_last"] = full_last
        against = f"{full_last:.4g}" if full_last is not None else "too few losses"
        return LowerLrVerdict(LowerLrKind.INCONCLUSIVE, (
            f"{clean} and the loss falls from {first:.4g} to {last:.4g}, but not clearly below the same steps at the "
            f"full learning rate in FP32 ({against}; {margin:.0%} lower is needed): inconclusive, nothing is "
            "concluded about the learning rate"), factor, evidence)
    return LowerLrVerdict(LowerLrKind.LR_IS_THE_CAUSE, (
        f"{clean} and the loss falls from {first:.4g} to {last:.4g}, {versus}: the learning rate is the cause"),
        factor, evidence)


def falls(losses: Sequence[float | None]) -> bool:
    """A loss that falls over its window: the median of its last three finite values under its first."""
    finite = [v for v in losses if v is not None and math.isfinite(v)]
    return len(finite) >= 3 and statistics.median(finite[-3:]) < finite[0]


def trains_down(result: TrajectoryResult) -> bool:
    """The replay's loss falls over its window (:func:`falls`)."""
    return falls(result.losses)


@dataclass(frozen=True)
class Fp32Reference:
    """What an FP32 replay offers a remedy's recovery check: the loss it reached (``level``), only when that replay was
    itself healthy, and ``why``: what the replay did, in words that follow the replay's name ("went non-finite")."""

    level: float | None
    why: str


def fp32_reference(losses: Sequence[float | None], *, level: float | None, margin: float) -> Fp32Reference:
    """Whether an FP32 replay's losses make a healthy reference, and what it reached (the median of its last third,
    at least three losses). Healthy: finite throughout, trained down (:func:`falls`), and near a level: within
    ``RECOVERY_LOSS_FACTOR`` of the healthy ``level`` from before the episode when there is one, or else fallen
    decisively (its last three's median at least ``margin`` under its first). A "recovered" is only ever measured
    against such a reference."""
    shown = [v for v in losses if v is not None]
    if any(not math.isfinite(v) for v in shown):
        return Fp32Reference(None, "went non-finite")
    if len(shown) < 3:
        return Fp32Reference(None, f"gave too few losses ({len(shown)}) to judge")
    first, end = shown[0], statistics.median(shown[-3:])
    reached = statistics.median(shown[-max(3, len(shown) // 3):])
    if not falls(shown):
        return Fp32Reference(None, f"did not train down ({first:.4g} -> {end:.4g})")
    if level is not None and level > 0:
        if reached > RECOVERY_LOSS_FACTOR * level:
            return Fp32Reference(None, (
                f"ended at {reached:.4g}, {reached / level:.3g}x the healthy level "
                f"{level:.4g} before the episode: not near it"))
        return Fp32Reference(reached, f"trained down to {reached:.4g}, within "
                                      f"{RECOVERY_LOSS_FACTOR:g}x the healthy level {level:.4g}")
    if end > (1 - margin) * first:
        return Fp32Reference(None, (
            f"fell only from {first:.4g} to {end:.4g}, less than the {margin:.0%} a decisive fall needs"))
    return Fp32Reference(reached, f"fell decisively, from {first:.4g} to {end:.4g}")
