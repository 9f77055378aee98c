"""The reads of step losses: every loss held in the ring read in ONE device-to-host copy (with the log step's other
values, the scaler's scale and growth tracker among them), at a log step, on an anomaly, or when the ring is full.
On the CPU, where the losses were taken as floats as they came, the read has no tensor op at all."""

from __future__ import annotations

from array import array
from collections import deque
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat
from lightning_ampwatch.steps.losses import RECENT_LOSSES, LossRing


class LossReads:
    """The losses read so far: the recent ones (for a remedy's outcome), those not yet handed to the machine, and
    the latest by step (the timeline samples it)."""

    def __init__(self) -> None:
        self.recent_losses: deque[tuple[int, float]] = deque(maxlen=RECENT_LOSSES)  # (step, loss) as read
        self.unnoted: list[tuple[int, float]] = []  # losses read and not yet handed to the machine
        self._latest: tuple[int, float] | None = None  # the (step, loss) of the latest step read so far
        # the scaler's scale and growth tracker (0-d on torch 2.x) as 1-d views for the log step's ``cat``, made once
        # per pair of tensors (the scaler updates them in place): (scale, tracker, their views)
        self._scaler_views: tuple[Tensor, Tensor, Tensor, Tensor] | None = None

    @property
    def last_loss(self) -> float | None:
        latest = self._latest
        return None if latest is None else latest[1]

    def take_unnoted(self) -> list[tuple[int, float]]:
        """The losses read since the last call, in step order (the list itself stays the same object)."""
        unnoted = self.unnoted[:]
        self.unnoted.clear()
        return unnoted

    def recent(self, pair: tuple[int, float]) -> None:
        """One step's loss, read: kept with the recent ones; the latest by step is remembered (steps resolved on
        the slow path may be read before older ones still in the ring)."""
        self.recent_losses.append(pair)
        latest = self._latest
        if latest is None or pair[0] >= latest[0]:
            self._latest = pair

    def read(self, ring: LossRing, host_tape: bool, extra: Sequence[Tensor] = ()) -> list[float]:
        """Read every loss ``ring`` holds, and ``extra`` tensors (scalars, or the cross-rank sums' vector), in ONE
        device-to-host copy; returns ``extra``'s values, flattened. The values are packed with as few ops as
        possible (one ``cat`` promotes their dtypes): each op is paid at every log step. Losses taken as floats on
        the host (``host_tape``) are read with no tensor op (:meth:`read_host`)."""
        if host_tape and _on_host(extra):
            return self.read_host(ring, [], extra)
        losses = ring.stacked()
        if extra:
            device = extra[0].device
            parts = [t.data if t.dim() == 1 else t.data.reshape(-1) for t in extra]  # the scaler's are 1-d
            n_extra = sum([t.numel() for t in parts])
            if losses is not None:
                parts.append(losses if losses.device == device else losses.to(device))
            packed = torch.cat(parts)
            values = (packed if packed.dtype == torch.float32 else packed.float()).cpu().tolist()
        elif losses is not None:
            values, n_extra = losses.cpu().tolist(), 0
        else:
            return []
        self._note(ring, values[n_extra:])
        return values[:n_extra]

    def read_host(self, ring: LossRing, head: list[float], extra: Sequence[Tensor]) -> list[float]:
        """:meth:`read` where the losses were taken as floats (the CPU): ``head`` (values already read) and
        ``extra`` (host tensors) first, read with no packing op. Every value is rounded to float32, as the packed
        vector's ``float()`` rounds it, so the values are those of the packed read, bit for bit."""
        for t in extra:
            head.extend(t.reshape(-1).tolist())
        losses = ring.held()
        if not losses and not head:
            return []
        n = len(head)
        head.extend(losses)
        values = array("f", head).tolist()  # float32, as ``cat(...).float().tolist()`` gives them
        self._note(ring, values[n:], losses)
        return values[:n]

    def read_with_scaler(self, ring: LossRing, host_tape: bool, scaler: Any,
                         extra: Sequence[Tensor] = ()) -> tuple[float, float, list[float]] | None:
        """The log step's one packed read with a GradScaler's scale and growth tracker in front: ``(scale, tracker,
        extra's values)``; None (nothing read) while the scaler has no scale tensor yet."""
        scale_t = compat.scale_tensor(scaler)
        if scale_t is None:
            return None
        tracker_t = compat.growth_tracker_tensor(scaler)
        if host_tape and tracker_t is not None and _on_host((scale_t, *extra)):
            # the CPU: the scaler's two values read as they are, with the losses taken as floats, without a ``cat``
            scale, tracker, *values = self.read_host(ring, [scale_t.item(), tracker_t.item()], extra)
            return scale, tracker, values
        views = self._scaler_views
        if views is None or views[0] is not scale_t or views[1] is not tracker_t:
            # views (``view``: never a copy) alias the scaler's tensors, read as they are at each log step: no
            # reshape op per read
            views = (scale_t, tracker_t, scale_t.data.view(-1), tracker_t.data.view(-1)) if tracker_t is not None \
                else None
            self._scaler_views = views
        pair = [views[2], views[3]] if views is not None else [scale_t, tracker_t]
        scale, tracker, *values = self.read(ring, host_tape, [*pair, *extra])
        return scale, tracker, values

    def _note(self, ring: LossRing, values: list[float], held: list[Any] | None = None) -> None:
        losses = ring.settle(values, held)
        if losses:
            self.unnoted.extend(losses)
            self.recent_losses.extend(losses)
            latest = self._latest
            if latest is None or losses[-1][0] >= latest[0]:
                self._latest = losses[-1]


def _on_host(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor lives on the CPU (its values read with no synchronisation)."""
    for t in tensors:
        if t.device.type != "cpu":
            return False
    return True
