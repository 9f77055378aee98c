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


def _precision(ctx: RemedyContext) -> str:
    return str(getattr(ctx.trainer.strategy.precision_plugin, "precision", "?"))


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

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> None:
        """The resumed Trainer is built anew with the original precision: switch it again."""
        if _precision(ctx) != BF16:
            _switch_to_bf16(ctx)

    def describe(self, details: Mapping[str, Any]) -> str:
        return f"precision {details['precision_before']} -> {details['precision_after']}, without a GradScaler"
