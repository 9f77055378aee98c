"""The taxonomy state machine, as a package whose imports run one way (each module imports only those above it)::

    vocabulary       what the machine is given (PrecisionMode, Thresholds, Observation, BatchStats)
    state            what it carries from step to step, and its checkpoint (MachineState and its parts)
    lr_history       the LR's change points and the LR event before an onset
    tally            what every step adds to the counts and histories, before anything is judged
    reference        the healthy reference: the loss level, the climb, the level after a rollback (HealthyReference)
    overflow         the gradient-overflow patterns, read from the skip history (functions returning an Overflow)
    optimizers       each optimizer's own skips and safe scale, several through one scaler (OptimizerRows)
    episode_tracker  the episode an alarm opens, its end, the NORMAL_SCALING call (EpisodeTracker)
    machine          AmpStateMachine: observations in, diagnoses out; it keeps the transitions, reads what the parts
                     return, and decides

Pure Python (no torch, no Lightning). Every public name stays importable from ``lightning_ampwatch.machine``.
"""

from lightning_ampwatch.machine.episode_tracker import DIVERGENCE_FINDINGS, EpisodeTracker
from lightning_ampwatch.machine.lr_history import LR_LOG_KEEP, LR_LOG_MAX, LrLog, lr_event, record_lr
from lightning_ampwatch.machine.machine import AmpStateMachine
from lightning_ampwatch.machine.optimizers import OptimizerRows
from lightning_ampwatch.machine.overflow import Overflow
from lightning_ampwatch.machine.reference import (
    CLIMBING_RISE, HEALTHY_RISE, HealthyReference, LevelAt, ReferenceOwner,
)
from lightning_ampwatch.machine.state import (
    SCALE_HISTORY, SKIP_LOG, Climb, Episode, LrPoint, LrRise, MachineState, NormalCall, Reference, Streak, decode,
    plain,
)
from lightning_ampwatch.machine.vocabulary import BatchStats, Observation, PrecisionMode, Thresholds

__all__ = [
    "CLIMBING_RISE", "DIVERGENCE_FINDINGS", "HEALTHY_RISE", "LR_LOG_KEEP", "LR_LOG_MAX", "SCALE_HISTORY", "SKIP_LOG",
    "AmpStateMachine", "BatchStats", "Climb", "Episode", "EpisodeTracker", "HealthyReference", "LevelAt", "LrLog",
    "LrPoint", "LrRise", "MachineState", "NormalCall", "Observation", "OptimizerRows", "Overflow", "PrecisionMode",
    "Reference", "ReferenceOwner", "Streak", "Thresholds", "decode", "lr_event", "plain", "record_lr",
]
