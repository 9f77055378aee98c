"""Lower the learning rate, for a fault set off by a rise in it (or a run that diverges at full precision).

After an LR rise, the learning rates are held at or under a ceiling: the level before the rise, whatever the scheduler
computes next (:class:`~lightning_ampwatch.remedies.hold_lr.LrCeiling`). A rollback to before the rise already
brought that level back, so the schedule is not scaled: the steps before the rise re-run as fast as they first ran.
With no rise to undo, or where no ceiling can be held (a Fabric loop sets its own learning rates), every rate is
scaled, in the optimizers and in the schedulers' base values."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lightning_ampwatch import compat
from lightning_ampwatch.remedies.base import AppliedRemedy, Effect, Remedy, RemedyContext, RemedyName, register
from lightning_ampwatch.remedies.hold_lr import LrCeiling, param_groups
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


def _rise(diagnosis: Diagnosis) -> tuple[float, float] | None:
    """The LR rise that set the fault off, (before, after), when the evidence says what it was."""
    before, after = diagnosis.evidence.get("lr_before"), diagnosis.evidence.get("lr_after")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and 0 < before < after:
        return float(before), float(after)
    return None


def _earlier_rungs(diagnosis: Diagnosis) -> int:
    tried = diagnosis.evidence.get("remedies_tried")
    return sum(1 for t in tried if isinstance(t, dict) and t.get("remedy") == RemedyName.REDUCE_LR) \
        if isinstance(tried, list) else 0


def _scale(ctx: RemedyContext, factor: float) -> None:
    """Every learning rate times ``factor``, in the optimizers and in the schedulers' base values (so the schedule
    keeps the lower level instead of undoing it on its next step)."""
    for group in param_groups(ctx.trainer.optimizers):
        group["lr"] = group["lr"] * factor
        for key in ("initial_lr", "max_lr", "min_lr"):
            if isinstance(group.get(key), (int, float)):
                group[key] = group[key] * factor
    for config in getattr(ctx.trainer, "lr_scheduler_configs", []):
        sched = config.scheduler
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]
        compat.scale_last_lr(sched, factor)


def _can_hold(ctx: RemedyContext) -> bool:
    """Whether a ceiling holds here: Lightning steps the schedulers through the module's hook (automatic
    optimization, with a scheduler). Without a scheduler, or where the loop steps them itself (manual optimization,
    Fabric), whatever raised the LR would raise it again past a ceiling only set once: the rates are scaled."""
    module = ctx.lightning_module
    return module is not None and getattr(module, "automatic_optimization", True) is True \
        and bool(getattr(ctx.trainer, "lr_scheduler_configs", None))


def _lrs(ctx: RemedyContext) -> list[float]:
    return [float(g["lr"]) for g in param_groups(ctx.trainer.optimizers)]


@register
class ReduceLr(Remedy):
    """Lower the learning rates. After an LR rise (under Lightning): held at or under the level before the rise from
    now on, whatever the scheduler computes; scaled first only where the run is still past the rise (no rollback
    took it back), or by a rung after one that did not recover (halved again, and the ceiling with it). Otherwise:
    every rate scaled, back to the level before the rise, at least halved (a tenth for a run that diverges at full
    precision)."""

    name = RemedyName.REDUCE_LR
    effects = frozenset({Effect.OPTIMIZERS})

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        rise = _rise(diagnosis) if _can_hold(ctx) else None
        before = _lrs(ctx)
        if rise is not None:
            factor = self._ceiling_factor(ctx, diagnosis, before, rise[0])
        else:
            factor = _lr_factor(diagnosis) * _below_tried(ctx, diagnosis)
        if factor != 1.0:
            _scale(ctx, factor)
        details: dict[str, Any] = {"lr_before": before, "lr_after": _lrs(ctx), "factor": float(f"{factor:.6g}")}
        if rise is not None:
            held = LrCeiling.install(ctx.lightning_module, details["lr_after"])
            for config in getattr(ctx.trainer, "lr_scheduler_configs", []):
                compat.held_last_lr(config.scheduler)
            details["lr_after"] = _lrs(ctx)
            details["ceiling"] = list(held.caps)
        if isinstance(diagnosis.evidence.get("lr_before"), (int, float)):
            details["back_to"] = diagnosis.evidence["lr_before"]  # the LR just before the rise
        if isinstance(diagnosis.evidence.get("lr_tried"), list):
            details["compounded_on"] = diagnosis.evidence["lr_tried"]  # what the earlier rung had set
        return details

    @staticmethod
    def _ceiling_factor(ctx: RemedyContext, diagnosis: Diagnosis, current: Sequence[float], before: float) -> float:
        """How much to scale before the ceiling is set at the rates that result. 1: a rollback took the run back to
        before the rise, whose rates are the healthy ones (scaling them would slow the steps before the rise too).
        A rung after one that did not recover: half what that one set. Still past the rise: back to before it."""
        if isinstance(diagnosis.evidence.get("lr_tried"), list):
            return LR_FACTOR * _below_tried(ctx, diagnosis)
        if _earlier_rungs(diagnosis) == 0 and max(current, default=0.0) <= before * (1 + 1e-6):
            return 1.0
        return _lr_factor(diagnosis)

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> None:
        """The ceiling is a wrapper on the module's hook, which a checkpoint does not carry: put back (the rates
        and the schedules themselves came back with the optimizers' and the schedulers' states)."""
        caps = record.details.get("ceiling")
        if isinstance(caps, list) and caps and ctx.lightning_module is not None:
            LrCeiling.install(ctx.lightning_module, [float(c) for c in caps])

    def describe(self, details: Mapping[str, Any]) -> str:
        changes = ", ".join(f"{b:g} -> {a:g}" for b, a in zip(details["lr_before"], details["lr_after"]))
        ceiling = details.get("ceiling")
        if not isinstance(ceiling, list) or not ceiling:
            return f"learning rates x{details['factor']:g}" + (f": {changes}" if changes else "")
        caps = ", ".join(f"{c:g}" for c in ceiling)
        back_to = details.get("back_to")
        at_before = isinstance(back_to, (int, float)) and back_to > 0 and \
            abs(max(ceiling) - back_to) <= 1e-6 * back_to
        why = (" (the LRs before the rise)" if len(ceiling) > 1 else " (the LR before the rise)") if at_before else ""
        held = f"held at or under {caps}{why}"
        if details["factor"] == 1.0:
            return f"learning rates {held}"
        return f"learning rates x{details['factor']:g}" + (f": {changes}" if changes else "") + f", then {held}"
