"""Remedies that act on the GradScaler: its scale, its growth, and clipping that must follow its scale."""

from __future__ import annotations

import math
from typing import Any, Mapping

from lightning_ampwatch import compat, deepspeed_state
from lightning_ampwatch.remedies.base import (
    AppliedRemedy,
    Effect,
    Remedy,
    RemedyContext,
    RemedyError,
    RemedyName,
    register,
    require_scaler,
)
from lightning_ampwatch.remedies.precision import without_scaler
from lightning_ampwatch.taxonomy import Diagnosis, format_pow2


def _pow2_floor(value: float) -> float:
    return float(2.0 ** math.floor(math.log2(value))) if value > 0 else 1.0


@register
class LowerInitScale(Remedy):
    """Set the scale to the largest power of two that held, and make growth wait 4x longer so the scaler does not
    climb straight back into the overflow."""

    name = RemedyName.LOWER_INIT_SCALE
    effects = frozenset({Effect.SCALER})
    needs_scaler = True

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        scaler = require_scaler(ctx)
        before = float(scaler.get_scale())
        safe = diagnosis.measured.safe_scale or ctx.safe_scale
        target = _pow2_floor(float(safe)) if isinstance(safe, (int, float)) and safe > 0 else _pow2_floor(before / 2)
        target = min(target, _pow2_floor(before)) if before > 0 else target
        interval_before = int(scaler.get_growth_interval())
        scaler.update(new_scale=float(target))
        scaler.set_growth_interval(interval_before * 4)
        compat.reset_growth_tracker(scaler)
        return {"scale_before": before, "scale_after": target,
                "growth_interval_before": interval_before, "growth_interval_after": interval_before * 4}

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> str | None:
        """The scale and growth interval came back with the scaler's checkpointed state; a run resumed without a
        float16 scaler has none to hold them: why is returned."""
        return without_scaler(ctx)

    def describe(self, details: Mapping[str, Any]) -> str:
        growth = f"growth interval {details['growth_interval_before']} -> {details['growth_interval_after']} steps"
        if details["scale_after"] >= details["scale_before"]:  # the scaler had already come down to the safe scale
            return f"loss scale kept at {format_pow2(details['scale_after'])} (already the safe scale), {growth}"
        return f"loss scale {format_pow2(details['scale_before'])} -> {format_pow2(details['scale_after'])}, {growth}"


@register
class SlowGrowth(Remedy):
    """Grow less often and by less. The tracker is reset on purpose: it counts clean steps towards the interval."""

    name = RemedyName.SLOW_GROWTH
    effects = frozenset({Effect.SCALER})
    needs_scaler = True

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        scaler = require_scaler(ctx)
        interval, factor = int(scaler.get_growth_interval()), float(scaler.get_growth_factor())
        new_interval = max(interval * 10, 100)
        new_factor = max(1.0 + (factor - 1.0) / 2, 1.0001)
        scaler.set_growth_interval(new_interval)
        scaler.set_growth_factor(new_factor)
        compat.reset_growth_tracker(scaler)
        return {"growth_interval_before": interval, "growth_interval_after": new_interval,
                "growth_factor_before": factor, "growth_factor_after": new_factor}

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> str | None:
        """The scaler's growth settings came back with its checkpointed state; a run resumed without a float16
        scaler has none to hold them: why is returned."""
        return without_scaler(ctx)

    def describe(self, details: Mapping[str, Any]) -> str:
        return (f"growth interval {details['growth_interval_before']} -> {details['growth_interval_after']} steps, "
                f"growth factor {details['growth_factor_before']:g} -> {details['growth_factor_after']:g}")


@register
class UnscaleBeforeClip(Remedy):
    """Clipping limits follow the scale from now on (the recipe guards' clip wrapper does it), so clipping
    still-scaled gradients clips exactly what clipping unscaled gradients would have."""

    name = RemedyName.UNSCALE_BEFORE_CLIP
    needs_scaler = True

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        require_scaler(ctx)
        deepspeed_state.refuse(ctx.trainer, "unscale_before_clip")
        _rescale_clipping(ctx)
        return {"clip_threshold": "multiplied by the current loss scale"}

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> str | None:
        """The switch lives in the guards, which a checkpoint does not hold: put back, where the resumed run has a
        float16 scaler whose scale the gradients carry (else why not is returned)."""
        why = without_scaler(ctx)
        if why is None:
            _rescale_clipping(ctx)
        return why

    def describe(self, details: Mapping[str, Any]) -> str:
        return "clipping limits are multiplied by the loss scale while the gradients are still scaled"


def _rescale_clipping(ctx: RemedyContext) -> None:
    if ctx.guards is None:
        raise RemedyError("AmpWatch's recipe guards are not in this context, so clipping cannot follow the scale")
    ctx.guards.rescale_clipping = True
