"""The bf16 fallback: bfloat16 has float32's range, so the overflow classes float16 has are gone."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lightning_ampwatch import compat, deepspeed_state
from lightning_ampwatch.remedies.base import AppliedRemedy, Effect, Remedy, RemedyContext, RemedyError, RemedyName, \
    register
from lightning_ampwatch.taxonomy import Diagnosis

BF16 = "bf16-mixed"


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return device.type == "cpu"


#: The precision with a float16 loss scaler (Lightning's and Fabric's name for float16 autocast).
FLOAT16_MIXED = "16-mixed"
UNKNOWN = "?"


def run_precision(ctx: RemedyContext) -> str:
    """The precision the run trains at now, as Lightning (or Fabric) names it; ``"?"`` where the context does not
    say (no trainer)."""
    strategy = getattr(ctx.trainer, "strategy", None)
    return str(getattr(getattr(strategy, "precision_plugin", None), "precision", UNKNOWN))


def _precision(ctx: RemedyContext) -> str:
    return run_precision(ctx)


def built_with(precision: str) -> str:
    """Why a remedy is not put back on a resumed run that trains at ``precision`` (the user's choice)."""
    return f"the resumed run trains at {precision}, the precision it was built with"


def without_scaler(ctx: RemedyContext) -> str | None:
    """Why a scaler's remedy is not put back: the resumed run trains at a precision with no float16 loss scaler
    (None: it has one, or its precision is not known)."""
    precision = run_precision(ctx)
    return None if precision in (FLOAT16_MIXED, UNKNOWN) else built_with(precision)


def _switch_to_bf16(ctx: RemedyContext) -> None:
    if not bf16_supported(ctx.device):
        raise RemedyError(f"bfloat16 autocast is not supported on {ctx.device}")
    if ctx.switch_precision is not None:
        ctx.switch_precision(BF16)  # the adapter's own way
    else:
        compat.set_trainer_precision(ctx.trainer, BF16, ctx.device.type)


@register
class Bf16Fallback(Remedy):
    """Swap the trainer's precision plugin for bf16-mixed, which needs no scaler."""

    name = RemedyName.BF16_FALLBACK
    effects = frozenset({Effect.PRECISION})

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        deepspeed_state.refuse(ctx.trainer, "bf16_fallback")
        before = _precision(ctx)
        if before == BF16:
            raise RemedyError(f"the run is already in {BF16}")
        _switch_to_bf16(ctx)
        return {"precision_before": before, "precision_after": BF16}

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> str | None:
        """The resumed Trainer is built anew with the original precision: switch it again, where it trains at the
        precision the fallback replaced (float16 mixed). A run resumed at another one (32-true, 16-true, bf16-true)
        is the user's choice: kept, and why it was not switched is returned."""
        now = _precision(ctx)
        if now == BF16:
            return None
        replaced = record.details.get("precision_before")
        if now != UNKNOWN and now != (replaced if isinstance(replaced, str) and replaced else FLOAT16_MIXED):
            return built_with(now)
        try:
            _switch_to_bf16(ctx)
        except RemedyError as err:
            return f"{err}; the resumed run trains at {now}"
        return None

    def describe(self, details: Mapping[str, Any]) -> str:
        return f"precision {details['precision_before']} -> {details['precision_after']}, without a GradScaler"
