"""What the state machine is given: the run's precision (:class:`PrecisionMode`), its thresholds
(:class:`Thresholds`), and one optimizer step as observed (:class:`Observation`, with its batch's
:class:`BatchStats`). Pure Python (no torch, no Lightning); the first module of the machine package, importing none
of the others.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import get_type_hints

#: float16's largest finite value (the one home of the figure for the modules that may import the machine's
#: vocabulary; ``advice`` words it on its own, below the machine in the import order).
FP16_MAX = 65504.0


class PrecisionMode(str, Enum):
    """What arithmetic the watched run uses; decides which findings are possible."""

    FP16 = "fp16"  # float16 autocast with a GradScaler
    BF16 = "bf16"  # bfloat16 autocast, no scaler
    FP32 = "fp32"  # no reduced precision at all: the FP32 control is the run itself
    HALF = "half"  # parameters in float16 ("16-true"), no scaler


@dataclass(frozen=True)
class Thresholds:
    """When a pattern becomes an alarm. The defaults suit a GradScaler with its default settings."""

    startup_streak: int = 4
    """Skips in a row from the first step before the start-up is called a gradient overflow (2**4 = 16x too high)."""
    streak: int = 4
    """Skips in a row later in the run that make a gradient-overflow alarm."""
    window: int = 32
    """Steps over which the skip rate is measured."""
    window_skip_rate: float = 0.25
    """Skip rate over ``window`` that makes a persistent gradient-overflow alarm."""
    floor_scale: float = 1.0
    """A scale below this that still overflows means the unscaled gradients overflow float16."""
    growth_repeats: int = 3
    """Growths followed straight away by a skip before it counts as growth overflow."""
    growth_lag: int = 2
    """A skip within this many steps after a growth counts as caused by it."""
    growth_skip_rate: float = 0.02
    """Below this skip rate, growth-then-skip is the scaler's normal equilibrium, not a fault."""
    lr_lookback: int = 5
    """How many steps before the onset an LR increase is taken as the cause."""
    lr_rise: float = 0.1
    """Relative LR increase inside ``lr_lookback`` that counts as an increase."""
    warmup_ratio: float = 2.0
    """The peak must be this many times the LR the climb started from for the climb to count as a warmup."""
    input_limit: float = 1e4
    """Batch values beyond this magnitude are out of float16's comfortable range."""
    recovery_steps: int = 8
    """Clean steps in a row that end an episode (and that must follow a skip before it is called normal)."""
    loss_window: int = 16
    """Healthy losses whose median is the run's loss level: recent enough to follow training, robust to a few
    hard batches."""
    divergence_ratio: float = 4.0
    """A loss this many times the loss level is part of a climb. Minibatch noise seldom takes a healthy loss to
    twice its recent median, while a diverging run passes 4x on its way to the 8x and more of a diverged one
    (30 against a healthy 0.82 in the case that motivated it): 4x dates the climb near its start."""
    climb_steps: int = 2
    """Losses in a row above ``divergence_ratio`` x the level before they count as a climb: one is a hard batch."""
    divergence_steps: int = 8
    """Losses read in a row above ``divergence_ratio`` x the healthy reference (or the run's first loss, when there
    is none yet) that make a finite divergence an alarm on their own, with no skip and no NaN: a few hard batches
    come back well before this many."""
    lr_cause_margin: float = 0.1
    """The lower-LR counterfactual blames the learning rate only when its loss falls by at least this fraction (the
    median of its last three losses under its first) and ends at least this fraction under the full-LR FP32 replay's
    on the same steps: on a plateau, noise moves both by less, and the two replays see the same batches."""
    fall_margin: float = 0.2
    """With no healthy level to compare with, an FP32 replay is a remedy's recovery reference only when its loss falls
    decisively: the median of its last three losses at least this fraction under its first. Minibatch noise on a
    plateau seldom moves a median of three that far; a smaller fall is no evidence that the replay was healthy."""

    track_tolerance: float = 0.1
    """With no healthy level before the episode, a remedy is recovered when the run after it tracks a reference
    trajectory (FP32 training from the same state on the same steps, or the remedy's own cured replay): the median of
    its loss's ratios to the reference, step by step, at most this fraction above 1. Both see the same batches, so
    minibatch noise largely cancels; a run that lags its reference by more has not recovered."""

    replay_steps: int = 96
    """At an alarm, the window is replayed once per candidate intervention (nothing changed, FP32, an FP32 island, a
    lower LR, lower loss scales, bf16): at most this many replayed steps in all, per alarm (eight dozen: the three
    that decide most findings, nothing changed, FP32 and the lower LR, over the longest window the default snapshot
    interval of 20 steps gives, plus the cheaper ones, which stop at their first fault). Those the cap leaves out
    are said in the evidence."""
    replay_past: int = 8
    """The replayed window runs from the snapshot before the onset through this many steps past the onset (the
    batches of steps the run has not reached yet are the window's own again)."""

    def __post_init__(self) -> None:
        kinds = get_type_hints(Thresholds)
        values: dict[str, object] = asdict(self)
        for name, value in values.items():
            kind = kinds[name]
            wanted = "a positive integer" if kind is int else "a positive finite number"
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or (kind is int and not isinstance(value, int)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Thresholds.{name} must be {wanted}, got {value!r}")
        for name, fraction in (("window_skip_rate", self.window_skip_rate),
                               ("growth_skip_rate", self.growth_skip_rate)):
            if fraction > 1:
                raise ValueError(f"Thresholds.{name} is a fraction in (0, 1], got {fraction!r}")
        for name, fraction in (("lr_cause_margin", self.lr_cause_margin), ("fall_margin", self.fall_margin),
                               ("track_tolerance", self.track_tolerance)):
            if fraction >= 1:
                raise ValueError(f"Thresholds.{name} is a fraction in (0, 1), got {fraction!r}")
        if self.divergence_ratio <= 1:
            raise ValueError(f"Thresholds.divergence_ratio must be above 1 (a loss above its level), "
                             f"got {self.divergence_ratio!r}")


@dataclass(frozen=True)
class BatchStats:
    """What the adapter found in the batch of an anomalous step."""

    nonfinite: bool = False
    nonfinite_where: str | None = None
    absmax: float = 0.0
    absmax_where: str | None = None


@dataclass(frozen=True)
class Observation:
    """One optimizer step, as plain numbers.

    ``loss`` and ``loss_finite`` may be ``None`` when the adapter did not read them (a healthy step under
    a scaler costs nothing to watch); a clean step's loss feeds the loss level and the divergence rule.
    ``scale`` is the scale the step ran with. ``optimizer``: which optimizer stepped (its index among the run's
    optimizers), where several step through one scaler (a GAN's generator and discriminator): each one's skips and
    safe scale are its own. None with one optimizer.
    """

    step: int
    skipped: bool = False
    loss: float | None = None
    loss_finite: bool | None = None
    scale: float | None = None
    grew: bool = False
    lrs: tuple[float, ...] = ()
    batch: BatchStats | None = None
    optimizer: int | None = None

    @property
    def anomalous(self) -> bool:
        return self.skipped or self.loss_finite is False

    @property
    def data_nonfinite(self) -> bool:
        """Its loss was made non-finite by its own batch (NaN/inf in the data that reached the loss): it says nothing
        of the scale."""
        return self.loss_finite is False and self.batch is not None and self.batch.nonfinite
