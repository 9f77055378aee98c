"""The losses of recent steps: held unread (device tensors, or on the CPU the floats taken as they came) and read
all at once, at a log step, on an anomaly, or when the ring is full."""

from __future__ import annotations

from itertools import repeat
from operator import itemgetter, truediv
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_ampwatch.signals import LossTape

#: Step losses held unread; the ring is read when it holds this many (or ``log_every_n_steps``, if larger).
LOSS_RING_STEPS = 64
LOSS_RING_MAX_STEPS = 1024
#: Step losses kept once read, for checking a remedy's outcome over the steps after it.
RECENT_LOSSES = 256
#: Device types whose losses are taken as floats when they come (``loss.item()``, cheaper there than keeping the
#: tensor): reading a tensor on them is no synchronisation. On any other device the loss stays an unread tensor.
HOST_TAPE_DEVICES: frozenset[str] = frozenset({"cpu"})
_first, _second = itemgetter(0), itemgetter(1)
_UNSCALED_ONE = ((None, 1.0),)  # a lane step's one loss, read as a tape's (its value comes from the read)


class LossRing:
    """The losses of recent steps, as ``(step, tape)`` pairs of unread device tensors (or, on the CPU, the floats
    taken as they came); read all at once. A step the express lane took holds its one unscaled loss in place of
    the tape, ``(step, loss)``: the tape's three objects a step saved (garbage collections come on with every
    object a step keeps)."""

    def __init__(self, capacity: int = LOSS_RING_STEPS) -> None:
        self.capacity = capacity
        self.entries: list[tuple[int, LossTape]] = []
        self._lane_only = False  # what :meth:`held` found: every entry the express lane's (for :meth:`settle`)

    def append(self, step: int, tape: LossTape) -> None:
        self.entries.append((step, tape))

    @property
    def full(self) -> bool:
        return len(self.entries) >= self.capacity

    def held(self) -> list[Tensor | float]:
        """Every held loss, in order, as held (tensors, or floats taken on the host)."""
        tapes = list(map(_second, self.entries))
        kinds = set(map(type, tapes))
        self._lane_only = LossTape not in kinds
        if self._lane_only:  # every step the express lane's: its loss itself
            return tapes
        if len(kinds) == 1 and sum(map(len, tapes)) == len(tapes):  # one backward per step: each tape's first (C)
            return list(map(_first, map(_first, tapes)))
        return [loss for tape in tapes for loss in (map(_first, tape) if type(tape) is LossTape else (tape,))]

    def stacked(self) -> Tensor | None:
        """Every held loss as one float32 vector, in order (no read): for a packed read with other values. Losses
        of one dtype and device (the usual case) are stacked as they are: one op for the lot."""
        losses = self.held()
        if not losses:
            return None
        if type(losses[0]) is float:  # taken on the host (the tape's later losses may be tensors: see backward)
            losses = [torch.tensor(loss, dtype=torch.float32) if type(loss) is float else loss for loss in losses]
        try:
            stacked = torch.stack(losses)
            if stacked.dim() != 1:
                stacked = stacked.reshape(-1)
            return stacked if stacked.dtype == torch.float32 else stacked.float()
        except RuntimeError:  # mixed dtypes or shapes (a loss that is not a scalar): one by one
            return torch.stack([loss.detach().float().reshape(()).to(losses[0].device) for loss in losses])

    def settle(self, values: Sequence[float], held: Sequence[Any] | None = None) -> list[tuple[int, float]]:
        """The per-step (unscaled) losses from the values of :meth:`stacked` (or, ``held``, of :meth:`held` as read
        on the host), and the ring emptied."""
        entries = self.entries
        if self._lane_only and len(values) == len(entries):  # as :meth:`held` found them: unscaled losses, one a step
            self._lane_only = False
            self.entries = []
            if held is not None and values == held:  # the floats held were float32 values already: each entry is its
                return entries  # ``(step, loss)`` pair (no new object per step: each is paid for again when it goes)
            return list(zip(map(_first, entries), values))  # (``value / 1.0`` is ``value``, bit for bit: no new float)
        if len(values) == len(entries):  # one loss per step, the usual case: (step, value / its scale), in C
            kinds = set(map(type, map(_second, entries)))
            scales: Any
            if LossTape not in kinds:  # the express lane's steps: unscaled losses
                scales = repeat(1.0)
            elif len(kinds) == 1:
                scales = map(_second, map(_first, map(_second, entries)))
            else:  # the lane's steps among tapes of one loss each
                scales = [tape[0][1] if type(tape) is LossTape else 1.0 for tape in map(_second, entries)]
            self.entries = []
            return list(zip(map(_first, entries), map(truediv, values, scales)))
        out: list[tuple[int, float]] = []
        i = 0
        for step, tape in entries:
            total = 0.0
            for _, scale in (tape if type(tape) is LossTape else _UNSCALED_ONE):
                total += values[i] / scale
                i += 1
            out.append((step, total))
        self.entries = []
        return out

