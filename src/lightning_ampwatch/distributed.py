"""Cross-rank agreement, used only on anomalous steps. (How results come home from ``ddp_spawn`` workers is
Lightning's business: :func:`lightning_ampwatch.compat.carry_spawn_results`.)

Under a GradScaler every rank skips the same steps (gradients are all-reduced before the inf check, and sharded
scalers all-reduce ``found_inf``), so an anomalous step is a step every rank is in at the same time: a collective
there is safe and costs nothing on healthy steps. Without a scaler, anomalies need not coincide, and each rank
judges alone.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_ampwatch.machine import BatchStats


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a small picklable record), on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def merge_step(records: list[dict[str, Any]]) -> tuple[float | None, bool | None, BatchStats | None, list[int]]:
    """One view of an anomalous step from every rank's record: (loss, loss_finite, batch, ranks at fault).

    The loss is non-finite if any rank's was; the batch holds non-finite values if any rank's did (named with
    the rank); the ranks at fault are those whose loss or data was bad, or every rank when none was.
    """
    bad_ranks = [r for r, rec in enumerate(records)
                 if rec["loss_finite"] is False or (rec["batch"] is not None and rec["batch"].nonfinite)]
    finite_flags = [rec["loss_finite"] for rec in records if rec["loss_finite"] is not None]
    loss_finite = None if not finite_flags else all(finite_flags)
    losses = [rec["loss"] for rec in records if rec["loss"] is not None]
    loss = None
    if losses:
        bad = [x for x in losses if not (x == x and abs(x) != float("inf"))]
        loss = bad[0] if bad else sum(losses) / len(losses)
    batches = [(r, rec["batch"]) for r, rec in enumerate(records) if rec["batch"] is not None]
    batch = None
    if batches:
        nonfinite = [(r, b) for r, b in batches if b.nonfinite]
        biggest_rank, biggest = max(batches, key=lambda rb: rb[1].absmax)
        prefix = len(records) > 1
        batch = BatchStats(
            nonfinite=bool(nonfinite),
            nonfinite_where="; ".join((f"rank {r}: " if prefix else "") + str(b.nonfinite_where) for r, b in nonfinite)
            or None,
            absmax=biggest.absmax,
            absmax_where=((f"rank {biggest_rank}: " if prefix else "") + str(biggest.absmax_where))
            if biggest.absmax_where else None,
        )
    return loss, loss_finite, batch, bad_ranks or list(range(len(records)))
