"""The taxonomy state machine, as a package whose imports run one way::

    vocabulary   what the machine is given (PrecisionMode, Thresholds, Observation, BatchStats)
    state        what it carries from step to step, and its checkpoint (MachineState and its parts)
    lr_history   the LR's change points and the LR event before an onset          (state, vocabulary)
    reference    the healthy reference: the loss level, the climb, the level after a rollback
                                                                                  (state, vocabulary, lr_history)
    machine      AmpStateMachine: observations in, diagnoses out                  (all of the above)

Pure Python (no torch, no Lightning). Every public name stays importable from ``lightning_ampwatch.machine``.
"""

from lightning_ampwatch.machine.lr_history import LR_LOG_KEEP, LR_LOG_MAX, LrLog, lr_event, record_lr
from lightning_ampwatch.machine.machine import DIVERGENCE_FINDINGS, AmpStateMachine
from lightning_ampwatch.machine.reference import CLIMBING_RISE, HEALTHY_RISE, SKIP_LOG, HealthyReference, LevelAt, ReferenceOwner
from lightning_ampwatch.machine.state import (
    SCALE_HISTORY, Climb, Episode, LrPoint, LrRise, MachineState, NormalCall, Reference, Streak, decode, plain,
)
from lightning_ampwatch.machine.vocabulary import BatchStats, Observation, PrecisionMode, Thresholds

__all__ = [
    "CLIMBING_RISE", "DIVERGENCE_FINDINGS", "HEALTHY_RISE", "LR_LOG_KEEP", "LR_LOG_MAX", "SCALE_HISTORY", "SKIP_LOG",
    "AmpStateMachine", "BatchStats", "Climb", "Episode", "HealthyReference", "LevelAt", "LrLog", "LrPoint", "LrRise",
    "MachineState", "NormalCall", "Observation", "PrecisionMode", "Reference", "ReferenceOwner", "Streak",
    "Thresholds", "decode", "lr_event", "plain", "record_lr",
]
