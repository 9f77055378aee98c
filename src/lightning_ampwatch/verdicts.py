"""Verdict helpers: what a measurement made during an investigation says about a finding.

Pure Python (no torch, no Lightning), like the machine: the investigation measures, these functions judge.
"""

from __future__ import annotations

import math

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
