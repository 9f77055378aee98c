"""The steps closed but not resolved yet: the slow path. A step that is not clean (a skip, a fused optimizer's flag or
a loss still in flight, several optimizers, an episode in progress) is opened (:class:`OpenStep`), queued in order,
and resolved into the machine's :class:`Observation` once its deferred reads have landed (:class:`OpenSteps`). The
fast path never comes here: a healthy step is the ledger's alone."""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Protocol, Sequence

from torch import Tensor

from lightning_ampwatch import distributed
from lightning_ampwatch.machine import Observation
from lightning_ampwatch.probes import MicroBatch
from lightning_ampwatch.signals import DeferredRead, LossTape, ScaleMirror, inspect_batch
from lightning_ampwatch.steps.losses import LossRing
from lightning_ampwatch.steps.lrs import LrTracking
from lightning_ampwatch.steps.optimizers import Optimizers
from lightning_ampwatch.steps.reads import LossReads
from lightning_ampwatch.steps.records import ClosedStep, OpenStep, ResolvedStep
from lightning_ampwatch.steps.scale import ScaleTracking


class Ledger(Protocol):
    """What resolving a step reads and counts of the ledger whose steps are queued (``steps.ledger.StepLedger``)."""

    scale: ScaleTracking
    optimizers: Optimizers
    reads: LossReads
    lr: LrTracking
    losses: LossRing
    step_index: int
    host: Any  # the trainer, for the optimizers' re-check on an anomalous step (None outside a fit)
    world_size: int
    agree: bool
    log_steps: int
    log_skipped: int
    log_nonfinite: int

    @property
    def scaler_active(self) -> bool: ...

    def recheck_optimizers(self, trainer: Any) -> bool: ...

    def read_losses(self, extra: Sequence[Tensor] = ()) -> list[float]: ...

    def take_unnoted(self) -> list[tuple[int, float]]: ...


class OpenSteps:
    """The queue of opened steps of one ledger, resolved in order."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.queue: deque[OpenStep] = deque()

    def __bool__(self) -> bool:
        """Steps closed but not resolved yet (a skip or a loss still to be read)."""
        return bool(self.queue)

    def open(self, step: int, scale: float | None, lrs: tuple[float, ...], tape: LossTape, batches: list[MicroBatch],
             taken: bool, unscaled: bool = False, found_inf: Tensor | None = None, split: bool = False,
             scale_after: float | None = None) -> ClosedStep:
        """Queue step ``step`` with what is known of it when it closes (``taken``: the scaler took it, as the step
        hook saw; ``unscaled``: no scaler step ran; ``found_inf``: a fused optimizer's flag, still on the device;
        ``scale_after``: DeepSpeed's scale, its engine having counted the step skipped or not), and hand its record
        back with the steps resolved now. A step ``split`` off another optimizer's in the same batch resolves
        nothing yet: it is resolved with the step that closes the batch, once the batch is in the list the two
        share."""
        ledger = self.ledger
        opened = OpenStep(step, scale, lrs, tape, batches)
        if scale_after is not None:
            opened.skipped, opened.scale_after = not taken, scale_after
        else:
            optimizers, mirror = ledger.optimizers, ledger.scale.mirror
            if optimizers.several:
                if self.queue and mirror is not None:
                    opened.scale = scale = self.scale_after(mirror)
                opened.optimizer = optimizers.current
            if not ledger.scaler_active:
                # Without a scaler the loss is the only signal: copy it to the host without waiting.
                opened.loss = DeferredRead(opened.tape.total())
            elif found_inf is not None:  # fused optimizer: called whether or not it skipped
                opened.found_inf = DeferredRead(found_inf)
            else:
                opened.skipped, opened.unscaled = not taken, unscaled
        self.queue.append(opened)
        # Under DDP a skipped step is agreed across ranks by a collective, so every rank must resolve it at the
        # same point: wait for an in-flight flag there rather than let ranks resolve it at different steps.
        return ClosedStep(step, batches, False, scale, False, lrs, None,
                          [] if split else self.drain(force=ledger.world_size > 1))

    def scale_after(self, mirror: ScaleMirror) -> float:
        """The scale a step ran with while earlier steps of the batch wait to be resolved (another optimizer's step,
        split off before it, updates the mirror only when the batch ends): the mirror's, advanced over those whose
        skip is known already (none read from a fused optimizer's flag)."""
        if any(o.found_inf is not None or o.unscaled or o.scale_after is not None for o in self.queue):
            return mirror.scale
        ahead = ScaleMirror(**mirror.state_dict())
        for opened in self.queue:
            ahead.update(opened.skipped)
        return ahead.scale

    def drain(self, force: bool) -> list[ResolvedStep]:
        """Resolve queued steps in order; with ``force`` wait for copies still in flight (log steps, fit end)."""
        out: list[ResolvedStep] = []
        queue = self.queue
        while queue:
            head = queue[0]
            deferred = head.found_inf or head.loss
            if deferred is not None and not force and not deferred.ready():
                break
            queue.popleft()
            out.append(self._resolve(head))
        return out

    def _resolve(self, opened: OpenStep) -> ResolvedStep:
        ledger = self.ledger
        skipped = bool(opened.found_inf.value()) if opened.found_inf is not None else opened.skipped
        mirror = ledger.scale.mirror
        if opened.scale_after is not None and mirror is not None:  # DeepSpeed's scale, as its scaler set it
            grew = opened.scale_after > (opened.scale or 0.0)
            mirror.reconcile(opened.scale_after, 0 if skipped or grew else mirror.tracker + 1)
        elif opened.unscaled:
            grew = False
        else:
            grew = mirror.update(skipped) if mirror is not None else False
        loss: float | None = opened.loss.value() if opened.loss is not None else None
        if skipped and loss is None:
            # Under a scaler a non-finite loss always shows up as a skip, so only skipped steps are read.
            loss = opened.tape.read()
        loss_finite = None if loss is None else math.isfinite(loss)
        if loss is not None:
            ledger.reads.recent((opened.step, loss))
        ledger.log_steps += 1
        ledger.log_skipped += int(skipped)
        batch_stats = None
        fault_ranks = [distributed.rank()]
        if skipped or loss_finite is False:
            host = ledger.host
            if host is not None and ledger.recheck_optimizers(host) and ledger.lr.set_before \
                    and opened.step == ledger.step_index - 1:
                opened.lrs = ledger.lr.lrs  # a group added since (read just now): no scheduler stepped since this step ran
            ledger.read_losses()  # the level before the fault, current to the step before it
            batch_stats = inspect_batch([mb[0] for mb in opened.batches])
            ledger.log_nonfinite += int(loss_finite is False)
            if skipped and ledger.world_size > 1 and ledger.agree:
                # every rank skipped this step together: agree on one view of it (the only collective we make); a
                # rank whose watch switched itself off says so here, and the ranks stop agreeing (CrossRank)
                records = distributed.gather({"loss": loss, "loss_finite": loss_finite, "batch": batch_stats})
                ledger.agree = not any(rec.get("off") for rec in records)
                loss, loss_finite, batch_stats, fault_ranks = distributed.merge_step(records)
        elif loss is None:  # read later with the others (a read Observation loss feeds the machine's level)
            ledger.losses.append(opened.step, opened.tape)
        obs = Observation(step=opened.step, skipped=skipped, loss=loss, loss_finite=loss_finite,
                          scale=opened.scale, grew=grew, lrs=opened.lrs, batch=batch_stats, optimizer=opened.optimizer)
        return ResolvedStep(obs, opened, fault_ranks, ledger.take_unnoted())
