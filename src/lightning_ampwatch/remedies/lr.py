"""Lower the learning rate, for a fault set off by a rise in it."""

from __future__ import annotations

from typing import Any, Mapping

from lightning_ampwatch import compat
from lightning_ampwatch.remedies.base import Effect, Remedy, RemedyContext, RemedyName, register
from lightning_ampwatch.taxonomy import Diagnosis, Finding

LR_FACTOR = 0.5
#: For a run that diverges at full precision with no LR rise to undo: a learning rate that diverges is seldom
#: only twice too high, so a tenth (and, if that does not recover, a tenth again: the ladder has two rungs).
UNSTABLE_LR_FACTOR = 0.1


def _lr_factor(diagnosis: Diagnosis) -> float:
    """Back to the level before the rise that set the fault off, when the evidence says what it was; else half,
    or a tenth for a run that diverges at full precision. A rung after an earlier ``reduce_lr`` that did not
    recover compounds with it: the rollback before it brought the earlier learning rate back."""
    before, after = diagnosis.evidence.get("lr_before"), diagnosis.evidence.get("lr_after")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and after > 0 and 0 < before < after:
        factor = min(max(before / after, 0.01), LR_FACTOR)
    else:
        factor = UNSTABLE_LR_FACTOR if diagnosis.finding is Finding.FP32_UNSTABLE else LR_FACTOR
    if isinstance(diagnosis.evidence.get("lr_tried"), list):
        return factor  # compounded on the learning rate already tried, in apply
    tried = diagnosis.evidence.get("remedies_tried")
    earlier = sum(1 for t in tried if isinstance(t, dict) and t.get("remedy") == RemedyName.REDUCE_LR) \
        if isinstance(tried, list) else 0
    return factor ** (1 + earlier)


def _below_tried(ctx: RemedyContext, diagnosis: Diagnosis) -> float:
    """How far below the current learning rate the one an earlier rung already tried lies (1: not below, or none
    tried). A rollback restores the snapshot's learning rate, so a rung after it must start from what was tried,
    not from what the rollback put back."""
    tried = diagnosis.evidence.get("lr_tried")
    if not isinstance(tried, list) or not tried:
        return 1.0
    current = [float(g["lr"]) for opt in ctx.trainer.optimizers for g in opt.param_groups]
    ratios = [t / c for t, c in zip(tried, current) if isinstance(t, (int, float)) and c > 0 and 0 < t < c]
    return min(ratios) if ratios else 1.0


@register
class ReduceLr(Remedy):
    """Lower every learning rate, in the optimizers and in the schedulers' base values (so the schedule keeps the
    lower level instead of undoing it on its next step): back to the level before the rise, at least halved."""

    name = RemedyName.REDUCE_LR
    effects = frozenset({Effect.OPTIMIZERS})

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        factor = _lr_factor(diagnosis) * _below_tried(ctx, diagnosis)
        before, after = [], []
        for opt in ctx.trainer.optimizers:
            for group in opt.param_groups:
                before.append(float(group["lr"]))
                group["lr"] = group["lr"] * factor
                for key in ("initial_lr", "max_lr", "min_lr"):
                    if isinstance(group.get(key), (int, float)):
                        group[key] = group[key] * factor
                after.append(float(group["lr"]))
        for config in getattr(ctx.trainer, "lr_scheduler_configs", []):
            sched = config.scheduler
            if hasattr(sched, "base_lrs"):
                sched.base_lrs = [lr * factor for lr in sched.base_lrs]
            compat.scale_last_lr(sched, factor)
        details: dict[str, Any] = {"lr_before": before, "lr_after": after, "factor": float(f"{factor:.6g}")}
        if isinstance(diagnosis.evidence.get("lr_before"), (int, float)):
            details["back_to"] = diagnosis.evidence["lr_before"]  # the LR just before the rise
        if isinstance(diagnosis.evidence.get("lr_tried"), list):
            details["compounded_on"] = diagnosis.evidence["lr_tried"]  # what the earlier rung had set
        return details

    def describe(self, details: Mapping[str, Any]) -> str:
        changes = ", ".join(f"{b:g} -> {a:g}" for b, a in zip(details["lr_before"], details["lr_after"]))
        return f"learning rates x{details['factor']:g}" + (f": {changes}" if changes else "")
