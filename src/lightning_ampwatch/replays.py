"""What the single-batch control (:mod:`lightning_ampwatch.investigate`) and the trajectory control
(:mod:`lightning_ampwatch.trajectory.control`) share: the record of a faulty step's replay, the error that stops the
replays on every rank, the findings located by a gradient, and the evidence an AMP finding gives up once renamed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lightning_ampwatch.taxonomy import Finding
from lightning_ampwatch.verdicts import LevelOrigin


#: Why a rank may not replay with the others (said in the evidence where it would have had to).
APART = ("the ranks do not meet this anomaly together (no scaler, or another rank's AmpWatch switched itself "
         "off)")
#: Findings located by the first non-finite gradient (in backward order).
BACKWARD = {Finding.GRADIENT_OVERFLOW, Finding.GROWTH_OVERFLOW}


@dataclass
class ReplayRecord:
    """What the replay of a faulty step found, agreed across ranks: evidence for the diagnosis, where the fault
    sits, and the FP32 control's numbers for the verdict."""

    evidence: dict[str, Any] = field(default_factory=dict)
    module: str | None = None  # the first module whose output went non-finite from finite inputs
    param: str | None = None  # the first parameter whose gradient went non-finite, in backward order
    control_loss: float | None = None
    control_grads_finite: bool | None = None
    loss_level: float | None = None  # the investigating rank's healthy loss level (else its first loss)
    loss_level_origin: LevelOrigin = LevelOrigin.HEALTHY  # which of the two ``loss_level`` is
    error: str | None = None  # the replay failed on this rank
    # the replay at the run's own precision, as measured (the evidence's ``replay_*`` entries say the same)
    loss: float | None = None  # its loss (``replay_loss``)
    grads_finite: bool | None = None  # its gradients, at the scale it ran with (``replay_grads_finite``)
    unscaled_grads_finite: bool | None = None  # unscaled, where that scale was not 1 (``replay_unscaled_grads_finite``)
    grad_absmax: float | None = None  # its largest unscaled parameter gradient (``replay_grad_absmax``)
    reduced_precision_inputs: list[str] | None = None  # the batch's entries seen entering a reduced-precision op


class InvestigationError(RuntimeError):
    """A replay failed on some rank; raised on every rank alike so that all of them stop replaying together."""


def replay_went_nonfinite(record: ReplayRecord) -> bool:
    """Whether the replay at the run's own precision went non-finite: a module's output, or the loss."""
    loss = record.loss
    return record.module is not None or (isinstance(loss, float) and not math.isfinite(loss))


#: Evidence that only means something for a finding that blames reduced precision: once the finding is renamed to
#: one that does not, it moves under ``superseded_amp_evidence``, so that no one reads it as the diagnosis.
AMP_ONLY_EVIDENCE = ("pattern", "safe_scale", "safe_scale_from", "scale_history", "onset_scale", "skip_rate",
                     "window", "growth_steps", "span", "batch_control_verdict", "growth_interval", "growth_factor",
                     "backoff_factor")


def supersede_amp_evidence(ev: dict[str, Any], was: Finding) -> None:
    """Move the evidence of the AMP finding ``was`` (its overflow pattern, its safe scale, the single-batch verdict
    that blamed AMP) under ``superseded_amp_evidence``, in place."""
    moved = {k: ev.pop(k) for k in AMP_ONLY_EVIDENCE if k in ev}
    if moved:
        ev["superseded_amp_evidence"] = {"was": was.value, **moved}
