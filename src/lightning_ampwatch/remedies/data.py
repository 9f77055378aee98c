"""The remedy for a batch whose NaN/inf reached the weights (no scaler skipped its step, as under bf16 or FP32):
the run goes back to a state from before that batch and trains on without it."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lightning_ampwatch.errors import RemedyError
from lightning_ampwatch.remedies.base import Remedy, RemedyContext, RemedyName, register
from lightning_ampwatch.taxonomy import Diagnosis


@register
class SkipBatch(Remedy):
    """The work is the rollback's (to the newest state from before the batch; the batches since are skipped, that
    one among them). What this unit adds is the check that it worked: the weights are finite again. Where no state
    from before the batch could be gone back to, they are not, and the remedy does not apply."""

    name = RemedyName.SKIP_BATCH

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        with torch.no_grad():  # once, at the alarm: the run is lost without it anyway
            finite = all(bool(torch.isfinite(p).all()) for p in ctx.module.parameters())
        if not finite:
            raise RemedyError(f"the weights still hold non-finite values: no state from before step {diagnosis.step} "
                              "could be rolled back to")
        return {"skipped_batch_step": diagnosis.step, "where": diagnosis.measured.nonfinite_where}

    def describe(self, details: Mapping[str, Any]) -> str:
        where = details.get("where")
        return (f"the run went back to before the batch of step {details.get('skipped_batch_step')}"
                f"{' (' + str(where) + ')' if where else ''} and trains on without it")
