"""The per-step owner: every optimizer step taken in, in order, at no added host-device read on a healthy step.

One small class per module, imported one way (each module only from those above it in this list):

- :mod:`.records`: what a step becomes (:class:`OpenStep`, :class:`ResolvedStep`, :class:`ClosedStep`);
- :mod:`.losses`: the losses held unread and read at once (:class:`LossRing`);
- :mod:`.clean_runs`: clean steps held back and handed over in runs (:class:`CleanRuns`);
- :mod:`.cadence`: how often the log step's work and the snapshots run (:class:`LogCadence`,
  :class:`SnapshotCadence`);
- :mod:`.optimizers`: the optimizers the step hook sits on, and which one a step belongs to, where several step
  through one scaler (:class:`Optimizers`);
- :mod:`.open_steps`: the steps that are not clean, queued and resolved in order (:class:`OpenSteps`);
- :mod:`.lane`: the lean route's express lane, a healthy batch end in one call (:class:`ExpressLane`);
- :mod:`.ledger`: the ledger itself (:class:`StepLedger`), which takes each step in;
- :mod:`.route`: the route of every step (:class:`StepRoute`): the adapter's per-step calls, the lean route and its
  express lane, the log step, and how far the ledger may hold clean steps back.
"""

from lightning_ampwatch.steps.cadence import LogCadence, SnapshotCadence
from lightning_ampwatch.steps.clean_runs import CleanRuns
from lightning_ampwatch.steps.ledger import BATCHES_KEPT_AFTER_TRIM, BATCHES_KEPT_MAX, StepLedger
from lightning_ampwatch.steps.losses import (
    HOST_TAPE_DEVICES,
    LOSS_RING_MAX_STEPS,
    LOSS_RING_STEPS,
    RECENT_LOSSES,
    LossRing,
)
from lightning_ampwatch.steps.records import ClosedStep, OpenStep, ResolvedStep
from lightning_ampwatch.steps.route import MAX_DEFERRED, StepRoute

__all__ = [
    "BATCHES_KEPT_AFTER_TRIM", "BATCHES_KEPT_MAX", "HOST_TAPE_DEVICES", "LOSS_RING_MAX_STEPS", "LOSS_RING_STEPS",
    "MAX_DEFERRED", "RECENT_LOSSES", "CleanRuns", "ClosedStep", "LogCadence", "LossRing", "OpenStep",
    "ResolvedStep", "SnapshotCadence", "StepLedger", "StepRoute",
]
