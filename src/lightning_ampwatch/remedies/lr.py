"""Lower the learning rate, for a fault set off by a rise in it (or a run that diverges at full precision).

After an LR rise, the learning rates are held at or under a ceiling, whatever the scheduler computes next
(:class:`~lightning_ampwatch.remedies.hold_lr.LrCeiling`): the raised LR brought back to the level before the rise
(at most half the raised LR, at least a hundredth of it), whatever LR a rollback restored. A rollback can take the run
(and its scheduler) back to any point before the rise, early in a warmup too: the rates it restored are not scaled,
so the re-run steps run at the LRs they first ran with, up to the ceiling. Only rates above the ceiling are scaled
down to it. With no rise to undo, or where no ceiling can be held (a Fabric loop sets its own learning rates), every
rate is scaled, in the optimizers and in the schedulers' base values."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from lightning_ampwatch import compat
from lightning_ampwatch.remedies.base import AppliedRemedy, Effect, Remedy, RemedyContext, RemedyName, register
from lightning_ampwatch.remedies.hold_lr import LrCeiling, param_groups
from lightning_ampwatch.taxonomy import Diagnosis, Finding

LR_FACTOR = 0.5
#: The least a factor brings a raised LR back to: a hundredth of it (a warmup from near zero is not undone to zero).
MIN_RISE_FACTOR = 0.01
#: For a run that diverges at full precision with no LR rise to undo: a learning rate that diverges is seldom
#: only twice too high, so a tenth (and, if that does not recover, a tenth again: the ladder has two rungs).
UNSTABLE_LR_FACTOR = 0.1


def _lr_factor(diagnosis: Diagnosis) -> float:
    """Back to the level before the rise that set the fault off, when the evidence says what it was; else half,
    or a tenth for a run that diverges at full precision. A rung after an earlier ``reduce_lr`` that did not
    recover compounds with it: the rollback before it brought the earlier learning rate back."""
    rise = _rise(diagnosis)
    if rise is not None:
        factor = min(max(rise[0] / rise[1], MIN_RISE_FACTOR), LR_FACTOR)
    else:
        factor = UNSTABLE_LR_FACTOR if diagnosis.finding is Finding.FP32_UNSTABLE else LR_FACTOR
    if diagnosis.measured.lr_tried is not None:
        return factor  # compounded on the learning rate already tried, in apply
    return factor ** (1 + _earlier_rungs(diagnosis))


def _below_tried(ctx: RemedyContext, diagnosis: Diagnosis) -> float:
    """How far below the current learning rate the one an earlier rung already tried lies (1: not below, or none
    tried). A rollback restores the snapshot's learning rate, so a rung after it must start from what was tried,
    not from what the rollback put back."""
    tried = diagnosis.measured.lr_tried
    if not tried:
        return 1.0
    current = [float(g["lr"]) for opt in ctx.trainer.optimizers for g in opt.param_groups]
    ratios = [t / c for t, c in zip(tried, current) if t is not None and c > 0 and 0 < t < c]
    return min(ratios) if ratios else 1.0


def _rise(diagnosis: Diagnosis) -> tuple[float, float] | None:
    """The LR rise that set the fault off, (before, after), when it was measured."""
    lr = diagnosis.measured.lr
    rose = lr.rose if lr is not None else None
    return None if rose is None else (float(rose[0]), float(rose[1]))


def _earlier_rungs(diagnosis: Diagnosis) -> int:
    return diagnosis.measured.earlier_lr_rungs


def _again(diagnosis: Diagnosis) -> bool:
    """A rung after an earlier ``reduce_lr`` on the same episode."""
    return diagnosis.measured.lr_tried is not None or _earlier_rungs(diagnosis) > 0


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


def _ceiling_top(before: float, after: float) -> float:
    """The ceiling on the largest learning rate after a rise from ``before`` to ``after``: the raised LR times the
    factor that brings it back to ``before``, kept between ``MIN_RISE_FACTOR`` and ``LR_FACTOR``."""
    ratio = before / after
    if ratio > LR_FACTOR:
        return after * LR_FACTOR
    if ratio < MIN_RISE_FACTOR:
        return after * MIN_RISE_FACTOR
    return before


def _spread(ctx: RemedyContext, current: Sequence[float], top: float) -> list[float]:
    """``top`` for the largest learning rate (the one the evidence measures), and each param group's share of it: its
    share now, or for a group at zero (a warmup from zero, restored by a rollback), its share of the scheduler's base
    rates; ``top`` itself where neither says."""
    initial = [g.get("initial_lr") for g in param_groups(ctx.trainer.optimizers)]
    base = [float(i) if isinstance(i, (int, float)) and i > 0 else 0.0 for i in initial]
    base += [0.0] * (len(current) - len(base))
    top_now, top_base = max(current, default=0.0), max(base, default=0.0)
    return [lr * (top / top_now) if lr > 0 and top_now > 0 else top * (b / top_base) if b > 0 else top
            for lr, b in zip(current, base)]


def _down_to(current: Sequence[float], caps: Sequence[float]) -> float:
    """The factor that brings every rate at or under its cap (1: all are already; the rest stay as they are)."""
    factor = min((cap / lr for lr, cap in zip(current, caps) if lr > 0), default=1.0)
    return 1.0 if factor >= 1 - 1e-6 else factor


@register
class ReduceLr(Remedy):
    """Lower the learning rates. After an LR rise (under Lightning): held at or under the level before the rise from
    now on, whatever the scheduler computes (at most half the raised LR, at least a hundredth of it); the rates a
    rollback restored are scaled only where they stand above that ceiling. A rung after one that did not recover
    halves the ceiling that one held (and scales what stands above the new one). Otherwise: every rate scaled,
    back to the level before the rise, at least halved (a tenth for a run that diverges at full precision)."""

    name = RemedyName.REDUCE_LR
    effects = frozenset({Effect.OPTIMIZERS})

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        rise = _rise(diagnosis) if _can_hold(ctx) else None
        before = _lrs(ctx)
        caps: list[float] | None = None
        earlier_caps = self._earlier_ceiling(ctx, diagnosis, before) if rise is not None else None
        if rise is not None:
            caps = self._caps(ctx, diagnosis, before, rise)
            factor = _down_to(before, caps)
        else:
            factor = _lr_factor(diagnosis) * _below_tried(ctx, diagnosis)
        if factor != 1.0:
            _scale(ctx, factor)
        details: dict[str, Any] = {"lr_before": before, "lr_after": _lrs(ctx), "factor": float(f"{factor:.6g}")}
        if caps is not None:
            held = LrCeiling.install(ctx.lightning_module, caps)
            for config in getattr(ctx.trainer, "lr_scheduler_configs", []):
                compat.held_last_lr(config.scheduler)
            details["lr_after"] = _lrs(ctx)
            details["ceiling"] = list(held.caps)
        measured = diagnosis.measured
        if measured.lr is not None and measured.lr.before is not None:
            details["back_to"] = measured.lr.before  # the LR just before the rise
        if earlier_caps is not None:
            details["compounded_on"] = earlier_caps  # the ceiling the earlier rung held
        elif measured.lr_tried is not None:
            details["compounded_on"] = measured.lr_tried_entry()  # what the earlier rung had set
        return details

    @staticmethod
    def _caps(ctx: RemedyContext, diagnosis: Diagnosis, current: Sequence[float],
              rise: tuple[float, float]) -> list[float]:
        """One cap per param group. The largest: the raised LR brought back to the LR before the rise (at most half
        the raised LR, at least a hundredth of it), the level the evidence measured, whatever LR a rollback restored
        (it may be earlier in a warmup than the rise; the steps from there re-run as they first ran). The other
        groups keep their share of it. A rung after one that did not recover: half the ceiling that one held."""
        earlier = ReduceLr._earlier_ceiling(ctx, diagnosis, current)
        if earlier is not None:
            return [LR_FACTOR * cap for cap in earlier]
        again = _again(diagnosis)
        top = _ceiling_top(*rise)
        if again:  # no ceiling held by the earlier rung: half what it set, and at most the level before the rise
            tried = [float(t) for t in diagnosis.measured.lr_tried or () if t is not None and t > 0]
            top = LR_FACTOR * min(top, max(tried)) if tried else top * LR_FACTOR ** _earlier_rungs(diagnosis)
        return _spread(ctx, current, top)

    @staticmethod
    def _earlier_ceiling(ctx: RemedyContext, diagnosis: Diagnosis, current: Sequence[float]) -> list[float] | None:
        """For a rung after one that did not recover: the ceiling that one held (None: a first rung, or none held)."""
        if not _again(diagnosis):
            return None
        held = LrCeiling.installed(ctx.lightning_module)
        return list(held.caps) if held is not None and len(held.caps) == len(current) else None

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> str | None:
        """The ceiling is a wrapper on the module's hook, which a checkpoint does not carry: put back (the rates
        and the schedules themselves came back with the optimizers' and the schedulers' states), whatever the
        precision: a learning rate does not depend on it."""
        caps = record.details.get("ceiling")
        if isinstance(caps, list) and caps and ctx.lightning_module is not None:
            LrCeiling.install(ctx.lightning_module, [float(c) for c in caps])
        return None

    def describe(self, details: Mapping[str, Any]) -> str:
        changes = ", ".join(f"{b:g} -> {a:g}" for b, a in zip(details["lr_before"], details["lr_after"]))
        ceiling = details.get("ceiling")
        if not isinstance(ceiling, list) or not ceiling:
            return f"learning rates x{details['factor']:g}" + (f": {changes}" if changes else "")
        caps = ", ".join(f"{c:g}" for c in ceiling)
        back_to = details.get("back_to")
        why = ""
        if isinstance(back_to, (int, float)) and back_to > 0 and "compounded_on" not in details:
            top = max(ceiling)
            if abs(top - back_to) <= 1e-6 * back_to:
                why = " (the LRs before the rise)" if len(ceiling) > 1 else " (the LR before the rise)"
            elif top < back_to:
                why = f" (at most half the LR the rise reached; the LR before it was {back_to:g})"
            else:
                why = f" (a hundredth of the LR the rise reached, or less; the LR before it was {back_to:g})"
        held = f"held at or under {caps}{why}"
        if details["factor"] == 1.0:
            return f"learning rates {held}"
        return f"learning rates x{details['factor']:g}" + (f": {changes}" if changes else "") + f", then {held}"
