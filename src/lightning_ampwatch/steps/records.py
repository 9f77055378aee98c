"""The records a step becomes: opened (its outcome still in flight), resolved (an observation for the machine) or
closed (what the ledger hands back for every step it takes in)."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ampwatch.machine import Observation
from lightning_ampwatch.probes import MicroBatch
from lightning_ampwatch.signals import DeferredRead, LossTape

class OpenStep:
    """An optimizer step whose outcome needs more than the fast path: a skip, a flag or a loss still in flight,
    or an episode in progress. Queued until it can be resolved in order."""

    __slots__ = ("step", "scale", "lrs", "tape", "batches", "skipped", "found_inf", "loss", "scale_after",
                 "unscaled", "optimizer")

    def __init__(self, step: int, scale: float | None, lrs: tuple[float, ...], tape: LossTape,
                 batches: list[MicroBatch]) -> None:
        self.step, self.scale, self.lrs, self.tape, self.batches = step, scale, lrs, tape, batches
        self.skipped = False
        self.found_inf: DeferredRead | None = None  # fused optimizers: the scaler's flag, read once landed
        self.loss: DeferredRead | None = None  # no scaler: the loss, read once landed
        self.scale_after: float | None = None  # DeepSpeed: its scaler's scale after this step, as it set it
        self.unscaled = False  # no scaler step ran (see StepLedger.close): the mirror stays as it is
        self.optimizer: int | None = None  # which optimizer stepped, where several step through one scaler


@dataclass
class ResolvedStep:
    """A step the machine must see in full: its observation, what it ran on, the ranks at fault, and the losses of
    earlier steps read while resolving it (the machine takes them before it observes this step)."""

    obs: Observation
    opened: OpenStep
    fault_ranks: list[int]
    losses_before: list[tuple[int, float]]


class ClosedStep:
    """An optimizer step just taken in: its batches (for the trajectory control), and either the clean step's
    values (``clean``: the fast path; ``loss`` when it was read for free) or the steps resolved now.

    A clean step's record is one object per ledger, refilled at each step (no allocation on the fast path): read
    it before the next ``close``."""

    __slots__ = ("step", "batches", "clean", "scale", "grew", "lrs", "loss", "resolved")

    def __init__(self, step: int, batches: list[MicroBatch], clean: bool, scale: float | None, grew: bool,
                 lrs: tuple[float, ...], loss: float | None, resolved: list[ResolvedStep]) -> None:
        self.step, self.batches, self.clean, self.scale, self.grew = step, batches, clean, scale, grew
        self.lrs, self.loss, self.resolved = lrs, loss, resolved

