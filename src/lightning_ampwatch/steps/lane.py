"""The express lane: on the lean route, a healthy batch end taken in one call (:class:`ExpressLane`).

It does, inline, what the ledger's ``add_loss`` then ``close`` do for a healthy step they would hold back, for a
batch whose one optimizer step the scaler ran and took, below the step the lane was opened up to. Why it stays beside
the ledger's one route (it repeats part of ``close``): the figures measured against one route are beside
``StepRoute.take_lean`` (steps/route.py); every call on an ordinary step counts against its budget of 25.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from lightning_ampwatch import compat
from lightning_ampwatch.probes import MicroBatch
from lightning_ampwatch.signals import StepTaken
from lightning_ampwatch.steps.clean_runs import NO_BATCHES, CleanRuns
from lightning_ampwatch.steps.losses import LossRing
from lightning_ampwatch.steps.lrs import LrTracking
from lightning_ampwatch.steps.scale import ScaleTracking


class Ledger(Protocol):
    """What the lane reads and advances of the ledger it takes steps for (``steps.ledger.StepLedger``)."""

    step_index: int
    log_steps: int
    taken: StepTaken
    scale: ScaleTracking
    lr: LrTracking
    losses: LossRing
    runs: CleanRuns
    fast_path: bool

    @property
    def host_tape(self) -> bool: ...

    @property
    def waiting(self) -> bool: ...


class ExpressLane:
    """The lane of one ledger: it takes the steps below :attr:`until` (0: closed), set by :meth:`open`."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.until = 0
        self.host_tape = False  # the ledger's, as it was when the lane was opened (see :meth:`take`)

    def open(self, log_every: int) -> None:
        """Set :attr:`until`: the steps :meth:`take` may take from now on, given the route's leave (a quiet machine,
        nothing due). None while an earlier micro-batch's loss or batch waits, a step is in flight, a clean step
        cannot take the fast path, there is no per-optimizer table to tell a scaler step by, or the LRs are not one
        plain number; else up to (not including) the first of: the step the deferral stops at, the step before a
        log step, the step the losses' ring fills at, the step the scale grows at."""
        ledger = self.ledger
        tracking = ledger.scale
        mirror = tracking.mirror
        if (ledger.waiting or not ledger.fast_path or tracking.table_scaler is None or ledger.lr.one_group is None
                or tracking.loss_scale is not None or mirror is None):
            self.until = 0
            return
        self.host_tape = ledger.host_tape
        step = ledger.step_index
        until = ledger.runs.until
        if log_every:
            until = min(until, -(-(step + 1) // log_every) * log_every - 1)
        losses = ledger.losses
        self.until = min(until, step + losses.capacity - 1 - len(losses.entries),
                         step + mirror.growth_interval - 1 - mirror.tracker)

    def take(self, loss: Tensor, micro_batch: MicroBatch | tuple[Any, ...]) -> bool:
        """Take a batch below :attr:`until` whose one optimizer step the scaler ran and took, as the ledger would
        hold it back. Returns False, having changed nothing, for any other batch. Reads only what a lean step must:
        the step hook's flag, the scaler's per-optimizer table (a new one after each update), the LR, the loss."""
        ledger = self.ledger
        step = ledger.step_index
        if step >= self.until:
            return False
        taken_hook = ledger.taken
        if not taken_hook.taken:
            return False  # the scaler skipped the step, or none ran
        scaling = ledger.scale
        states = compat.read_per_optimizer_states(scaling.table_scaler)
        if states is scaling.states_seen:
            return False  # no scaler step ran in this batch
        if self.host_tape:
            try:
                value: Any = loss.item()
            except RuntimeError:  # not one value: the ledger's add_loss decides what to keep
                return False
        else:
            value = loss
        # as the ledger's close() leaves a clean step it holds back (open() ruled out a growth)
        taken_hook.taken = False
        scaling.states_seen = states
        mirror = scaling.mirror
        mirror.tracker += 1  # type: ignore[union-attr]
        ledger.step_index = step + 1
        tracking = ledger.lr
        lrs = tracking.lrs  # the LRs this step ran with; the next step's read now
        lr = tracking.one_group["lr"]  # type: ignore[index]
        if lrs[0] != lr:  # as close() takes a change in
            lrs = tracking.changed(step, lrs, (lr,))
        ledger.log_steps += 1
        ledger.losses.entries.append((step, value))  # its loss as it is, unscaled (LossRing reads it as a tape)
        runs = ledger.runs
        runs.deferred.append((step, [micro_batch] if runs.keep_batches else NO_BATCHES,  # type: ignore[list-item]
                              mirror.scale, False, lrs))  # type: ignore[union-attr]
        return True
