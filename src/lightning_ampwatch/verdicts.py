"""Verdict helpers: what a measurement made during an investigation says about a finding.

Pure Python (no torch, no Lightning), like the machine: the investigation measures, these functions judge.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from lightning_ampwatch.taxonomy import Finding

#: Findings that blame reduced precision, and so are put to the FP32 control.
AMP_BLAMING = frozenset({Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.GRADIENT_OVERFLOW,
                         Finding.GROWTH_OVERFLOW})

#: How far above the run's loss level a finite control loss must be to read as instability rather than AMP.
CONTROL_LEVEL_RATIO = 1e3


def judge_control(finding: Finding, *, control_loss: float | None, control_grads_finite: bool | None,
                  batch_nonfinite: bool, loss_level: float | None) -> tuple[Finding, str]:
    """What the FP32 control says about a finding: (the finding it leaves standing, why, in a few words).

    A control that fails too clears AMP: the data (if the batch holds NaN/inf) or the optimisation is at fault.
    A control that is finite but orders of magnitude above the run's usual loss reads as divergence, not AMP.
    Findings that do not blame reduced precision (data, LR schedule) keep their name; the control is evidence.
    """
    if control_loss is None:
        return finding, "control not run"
    control_failed = not math.isfinite(control_loss) or control_grads_finite is False
    if finding not in AMP_BLAMING:
        return finding, "control failed too" if control_failed else "control finite"
    if control_failed:
        if batch_nonfinite:
            return Finding.DATA_NONFINITE, "control failed too; the batch holds non-finite values"
        return Finding.FP32_UNSTABLE, "control failed too: not an AMP fault"
    if loss_level is not None and loss_level > 0 and control_loss > CONTROL_LEVEL_RATIO * loss_level:
        return Finding.FP32_UNSTABLE, (f"control finite but {control_loss / loss_level:.3g}x the run's loss level: "
                                       "the optimisation is diverging (or this batch is far outside the data "
                                       "seen so far)")
    return finding, "control finite: an AMP fault"


#: After a remedy the loss must come back within this factor of its level before the episode to count as
#: recovered: a run whose NaNs stopped but whose loss stays several times higher was ruined, not fixed.
RECOVERY_LOSS_FACTOR = 2.0
RECOVERED, NOT_RECOVERED = "recovered", "not_recovered"


@dataclass(frozen=True)
class Recovery:
    """Whether a remedied run is verifiably healthy again, with the numbers it rests on. ``outcome`` is None when
    nothing could be verified (no loss level to come back to): neither "fixed" nor a reason to escalate."""

    outcome: str | None
    reason: str
    details: dict[str, Any]


def judge_recovery(losses: Sequence[float], *, steps: int, skipped: int, reference: float | None,
                   reference_from: str) -> Recovery:
    """The outcome of a remedy from the ``steps`` optimizer steps after it: recovered only when at most one of
    them was skipped (dynamic scaling may still probe once), every loss read is finite, and their median is within
    ``RECOVERY_LOSS_FACTOR`` of ``reference`` (the loss level before the episode, or what an FP32 replay reached:
    ``reference_from`` says which). Without a reference or a loss, nothing is verified (outcome None)."""
    finite = [x for x in losses if math.isfinite(x)]
    after = statistics.median(finite) if finite else None
    details: dict[str, Any] = {"steps": steps, "skipped": skipped, "loss_after": after, "loss_before": reference,
                               "loss_before_from": reference_from}
    if len(finite) < len(losses):
        return Recovery(NOT_RECOVERED, f"{len(losses) - len(finite)} of the {len(losses)} losses after it are still "
                               "non-finite", details)
    if skipped > 1:
        return Recovery(NOT_RECOVERED, f"the scaler still skipped {skipped} of the {steps} steps after it", details)
    if after is None or reference is None or not reference > 0:
        return Recovery(None, "no loss could be compared with a level before the episode, so recovery is not "
                              "verified", details)
    ratio = after / reference
    details["loss_ratio"] = round(ratio, 4)
    if ratio > RECOVERY_LOSS_FACTOR:
        return Recovery(NOT_RECOVERED, f"the NaNs are gone, but the loss is {ratio:.3g}x {reference_from} "
                                       f"({after:.4g} against {reference:.4g})", details)
    return Recovery(RECOVERED, f"{steps} steps after it: {skipped} skipped, the loss {after:.4g} is {ratio:.3g}x "
                               f"{reference_from} ({reference:.4g})", details)
