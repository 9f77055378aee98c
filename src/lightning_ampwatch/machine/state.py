"""What the state machine carries from one step to the next (:class:`MachineState` and its parts), and its
checkpoint: plain JSON written by :func:`plain`, read back by :func:`decode`, which checks every entry against its
annotation. Pure Python (no torch, no Lightning). The healthy reference's fields (:class:`Reference`,
:class:`Climb`) and the LR's history (:class:`LrPoint`, :class:`LrRise`) are here too (one state, one checkpoint);
the logic that keeps them is :mod:`~lightning_ampwatch.machine.reference`'s and
:mod:`~lightning_ampwatch.machine.lr_history`'s. A fresh state's bounds come from the thresholds
(:func:`fresh_state`), and a checkpoint loads with them (:func:`load_state`). Of the machine package, this module
imports ``vocabulary`` only.
"""

from __future__ import annotations

import types
from collections import deque
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Mapping, Protocol, Union, get_args, get_origin, get_type_hints

from lightning_ampwatch.machine.vocabulary import PrecisionMode, Thresholds
from lightning_ampwatch.taxonomy import Finding

#: How many scales of a streak its ``scale_history`` evidence keeps.
SCALE_HISTORY = 24
#: How many of the latest skipped steps the machine keeps for judging the stretch a rollback goes back to (the loss
#: ring a rollback reads keeps as many steps).
SKIP_LOG = 256


@dataclass
class LrPoint:
    """A step at which the (largest) learning rate changed, and its new value."""

    step: int
    lr: float

@dataclass
class LrRise:
    """The latest rise of the learning rate: increases in a row, each within ``lr_lookback`` steps of the last."""

    start_step: int
    start_lr: float
    top_step: int
    top_lr: float
    points: int = 1

@dataclass
class Climb:
    """Losses in a row above ``divergence_ratio`` x the level: the run may be diverging."""

    start_step: int
    level: float
    start_loss: float
    last_step: int
    last_loss: float
    steps: int = 1

@dataclass
class Reference:
    """A loss level known to be healthy: the median of a stretch of finite losses taken while nothing was in
    progress (no episode, no skip awaiting its verdict) and that was not climbing."""

    level: float
    first_step: int
    last_step: int
    count: int


@dataclass
class Episode:
    """An open alarm: raised once, closed when training has been clean for a while (and, for a divergence, once
    the loss is back under the climb threshold)."""

    finding: Finding
    onset: int
    clean_run: int = 0
    growth_survived: int = 0
    back_run: int = 0  # losses in a row back under ``HEALTHY_RISE`` x the base (a divergence ends only then)
    finite: bool = False  # opened by a finite divergence (found in this rank's own losses)


@dataclass
class Streak:
    """The anomalous steps in a row so far, in bounded memory: a run stuck at NaN is one endless streak."""

    first_step: int
    first_scale: float | None
    count: int = 0
    all_loss_finite: bool = True  # leaving out the losses their own NaN batches made non-finite
    data: int = 0  # of ``count``, steps whose own batch made the loss non-finite
    scales: deque[float | None] = field(default_factory=lambda: deque(maxlen=SCALE_HISTORY))

    def __post_init__(self) -> None:
        self.scales = deque(self.scales, maxlen=SCALE_HISTORY)


@dataclass
class OptimizerSteps:
    """One optimizer's own steps, where several step through one scaler (a GAN's generator and discriminator share
    Lightning's one GradScaler): another optimizer's clean step says nothing of this one's gradients."""

    stepped: int = 0  # its steps that went through
    skipped: int = 0  # its steps the scaler skipped
    safe_scale: float | None = None  # the largest scale at which it stepped without a skip
    last_step: int | None = None  # the latest of its steps that went through
    skips_in_row: int = 0  # its own steps skipped in a row (the other optimizers' steps between do not end the row)
    first_skip: int | None = None  # the first step of that row
    scales: list[float | None] = field(default_factory=list)  # the scales of the row's skips (the latest few)
    all_loss_finite: bool = True  # every skip of the row had a finite loss (or none read)


@dataclass
class NormalCall:
    """The ``NORMAL_SCALING`` call made, kept so that an alarm that follows it closely can withdraw it."""

    step: int
    evidence: dict[str, Any]


@dataclass
class MachineState:
    """Everything the machine carries from one step to the next; its checkpoint is this, as plain JSON."""

    episode: Episode | None = None
    steps_seen: int = 0
    skipped_total: int = 0
    nonfinite_total: int = 0
    normal_reported: bool = False
    normal_call: NormalCall | None = None
    isolated_since: int | None = None
    streak: Streak | None = None
    streak_from_start: bool = True
    recent_skips: deque[int] = field(default_factory=deque)
    growths: deque[int] = field(default_factory=deque)
    growth_skips: deque[int] = field(default_factory=deque)
    lr_history: deque[LrPoint] = field(default_factory=deque)
    lr_last: float | None = None
    lr_rise: LrRise | None = None
    first_scale: float | None = None
    max_safe_scale: float | None = None
    losses: deque[float] = field(default_factory=deque)
    loss_steps: deque[int] = field(default_factory=deque)  # the step of each entry of ``losses``
    climb: Climb | None = None
    closed_episodes: list[dict[str, Any]] = field(default_factory=list)
    reference: Reference | None = None  # the newest healthy level
    reference_before_skip: Reference | None = None  # the healthy level when the latest first skip came
    reference_earlier: Reference | None = None  # the level the newest replaced (a newer one may take in an onset)
    start_loss: float | None = None  # the first finite loss the machine saw (the weights the fit started with)
    divergence_noted: bool = False  # a finite divergence reported without an episode (DDP), until its loss is back
    skip_log: deque[int] = field(default_factory=deque)  # the latest skipped steps, kept through alarms (a rollback
    # judges the stretch it goes back to by them)
    rebased_why: str | None = None  # why the latest rollback left no healthy level (None: it left one, or none came)
    climbing_why: str | None = None  # why no healthy level was taken yet: the stretch was already climbing
    # each optimizer's own steps, by its index, where several step through one scaler (empty with one optimizer; a
    # checkpoint from before it loads with none)
    optimizers: dict[str, OptimizerSteps] = field(default_factory=dict)
    # the last step of the run's start-up skips (the scaler lowering its first scale, every loss finite, before the
    # first step it took): the scaler finding its level, never the first sign of a later fault
    startup_until: int | None = None
    # why the run's losses are not one series (each batch steps several optimizers, each on a loss of its own: a
    # GAN's discriminator and generator): no healthy level is kept, and no climb is looked for (None: one series)
    losses_apart: str | None = None


def fresh_state(t: Thresholds) -> MachineState:
    """A new run's state, its histories bounded as the thresholds need them."""
    return MachineState(
        growths=deque(maxlen=max(t.growth_repeats * 4, 8)),
        growth_skips=deque(maxlen=t.growth_repeats),
        lr_history=deque(maxlen=t.window + t.lr_lookback + 2),
        losses=deque(maxlen=t.loss_window),
        loss_steps=deque(maxlen=t.loss_window),
        skip_log=deque(maxlen=SKIP_LOG),
    )


def load_state(value: Any, t: Thresholds) -> MachineState:
    """A checkpointed state (:func:`plain`'s JSON) read back, its histories bounded as in :func:`fresh_state`. A
    malformed one (not a dict, an unknown Finding, a wrong type) raises ValueError naming the bad entry."""
    loaded = decode(MachineState, value, "machine state")
    fresh = fresh_state(t)
    for f in fields(fresh):  # the bounded containers keep their bounds
        bound = getattr(fresh, f.name)
        if isinstance(bound, deque):
            setattr(loaded, f.name, deque(getattr(loaded, f.name), maxlen=bound.maxlen))
    return loaded


def run_up_start(skips: deque[int], start: int, gap: int, after: int | None = None) -> int:
    """Where trouble at ``start`` first showed: ``start``, or earlier, the first of the skips (``skips``, in step
    order) that led up to it, each within ``gap`` steps of the next; none at or before ``after`` (the run's start-up
    skips, where trouble at ``start`` came after them)."""
    floor = after if after is not None and start > after else None
    for skip in reversed(skips):
        if skip >= start:
            continue
        if start - skip > gap or (floor is not None and skip <= floor):
            break
        start = skip
    return start


def plain(value: Any) -> Any:
    """A state value as JSON-ready lists, dicts and scalars."""
    if is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple, deque)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def decode(kind: Any, value: Any, where: str) -> Any:
    """Rebuild one checkpoint entry as its annotation says; anything else raises ValueError naming the entry."""
    origin, args = get_origin(kind), get_args(kind)
    if kind is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return decode(inner, value, where)
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value)
        except ValueError:
            valid = ", ".join(m.value for m in kind)
            raise ValueError(f"{where}: {value!r} is not a {kind.__name__} (valid: {valid})") from None
    if is_dataclass(kind):
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(value).__name__}")
        hints = get_type_hints(kind)
        try:  # entries a later version added are ignored; a missing required one is an error
            return kind(**{f.name: decode(hints[f.name], value[f.name], f"{where}.{f.name}")
                           for f in fields(kind) if f.name in value})
        except TypeError as err:
            raise ValueError(f"{where}: {err}") from None
    if origin in (list, deque):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {type(value).__name__}")
        return [decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(value).__name__}")
        return {str(k): decode(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    numeric = kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
    if (kind is bool and isinstance(value, bool)) or (kind is str and isinstance(value, str)) or \
            (numeric and (kind is float or isinstance(value, int))):
        return kind(value)
    raise ValueError(f"{where} must be {getattr(kind, '__name__', kind)}, got {value!r}")


class MachineView(Protocol):
    """What the machine's parts (each optimizer's rows, the episode tracker) read of the machine that owns them."""

    @property
    def state(self) -> MachineState: ...

    @property
    def thresholds(self) -> Thresholds: ...

    @property
    def mode(self) -> PrecisionMode: ...
