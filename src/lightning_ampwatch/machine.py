"""The taxonomy state machine: one observation per optimizer step in, diagnoses out.

Pure Python (no torch, no Lightning) so that every rule can be tested with synthetic sequences.
It decides *what* is wrong; how the numbers were measured and what to do about them live elsewhere.
"""

from __future__ import annotations

import math
import statistics
import types
from collections import deque
from itertools import compress
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Iterable, Mapping, Sequence, Union, get_args, get_origin, get_type_hints

from lightning_ampwatch.taxonomy import Diagnosis, DivergencePattern, Finding, GradientPattern, LrEvent, advise


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

    def __post_init__(self) -> None:
        kinds = get_type_hints(Thresholds)
        for f in fields(self):
            value, kind = getattr(self, f.name), kinds[f.name]
            wanted = "a positive integer" if kind is int else "a positive finite number"
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or (kind is int and not isinstance(value, int)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Thresholds.{f.name} must be {wanted}, got {value!r}")
        for name in ("window_skip_rate", "growth_skip_rate"):
            if getattr(self, name) > 1:
                raise ValueError(f"Thresholds.{name} is a fraction in (0, 1], got {getattr(self, name)!r}")
        for name in ("lr_cause_margin", "fall_margin"):
            if getattr(self, name) >= 1:
                raise ValueError(f"Thresholds.{name} is a fraction in (0, 1), got {getattr(self, name)!r}")
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
    ``scale`` is the scale the step ran with.
    """

    step: int
    skipped: bool = False
    loss: float | None = None
    loss_finite: bool | None = None
    scale: float | None = None
    grew: bool = False
    lrs: tuple[float, ...] = ()
    batch: BatchStats | None = None

    @property
    def anomalous(self) -> bool:
        return self.skipped or self.loss_finite is False


# ------------------------------------------------------------------------------------ the machine's state

#: How many scales of a streak its ``scale_history`` evidence keeps.
SCALE_HISTORY = 24
#: Healthy losses needed before there is a loss level to compare with.
_LEVEL_MIN_LOSSES = 3
#: A stretch whose newer half has a median above this many times its older half's is climbing, not healthy; nor
#: is one whose median is this many times the healthy level before it (a slow build, under ``divergence_ratio``).
HEALTHY_RISE = 2.0
#: The healthy level is re-judged every this many candidate losses (and at the first sign of trouble): a few
#: medians of ``loss_window`` numbers, not one per step.
_PROMOTE_EVERY = 4
_INF = math.inf
#: How many of the latest skipped steps the machine keeps for judging the stretch a rollback goes back to (the loss
#: ring a rollback reads keeps as many steps).
SKIP_LOG = 256
#: Findings whose episode is a divergence of the loss: it lasts until the loss is back, whatever the skips do.
DIVERGENCE_FINDINGS = frozenset({Finding.FP32_UNSTABLE, Finding.LR_SCHEDULE})


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
    all_loss_finite: bool = True
    scales: deque[float | None] = field(default_factory=lambda: deque(maxlen=SCALE_HISTORY))

    def __post_init__(self) -> None:
        self.scales = deque(self.scales, maxlen=SCALE_HISTORY)


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


@dataclass(frozen=True)
class LevelAt:
    """The loss level a run had where a rollback took it back to: the median of the losses of the ``loss_window``
    steps before ``resumed_at`` (steps ``first_step``..``last_step``), or None (``why`` says why) when that stretch
    was not healthy or held no loss."""

    resumed_at: int
    level: float | None
    first_step: int
    last_step: int
    why: str | None = None
    count: int = 0  # the losses the level is the median of
    ahead: bool = False  # the losses are those the run first had on the steps it runs again (too few before them)


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
    start_loss: float | None = None  # the first finite loss the machine saw (the weights the fit started with)
    divergence_noted: bool = False  # a finite divergence reported without an episode (DDP), until its loss is back
    skip_log: deque[int] = field(default_factory=deque)  # the latest skipped steps, kept through alarms (a rollback
    # judges the stretch it goes back to by them)
    rebased_why: str | None = None  # why the latest rollback left no healthy level (None: it left one, or none came)


def _plain(value: Any) -> Any:
    """A state value as JSON-ready lists, dicts and scalars."""
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple, deque)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _decode(kind: Any, value: Any, where: str) -> Any:
    """Rebuild one checkpoint entry as its annotation says; anything else raises ValueError naming the entry."""
    origin, args = get_origin(kind), get_args(kind)
    if kind is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, where)
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
            return kind(**{f.name: _decode(hints[f.name], value[f.name], f"{where}.{f.name}")
                           for f in fields(kind) if f.name in value})
        except TypeError as err:
            raise ValueError(f"{where}: {err}") from None
    if origin in (list, deque):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {type(value).__name__}")
        return [_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be a dict, got {type(value).__name__}")
        return {str(k): _decode(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    numeric = kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool)
    if (kind is bool and isinstance(value, bool)) or (kind is str and isinstance(value, str)) or \
            (numeric and (kind is float or isinstance(value, int))):
        return kind(value)
    raise ValueError(f"{where} must be {getattr(kind, '__name__', kind)}, got {value!r}")


# ------------------------------------------------------------------------------------ the machine


class AmpStateMachine:
    """Feed ``observe`` one :class:`Observation` per optimizer step, in order; it returns new diagnoses.

    An alarm is returned once per episode, dated at the episode's onset: the first sign of the trouble (the
    first skip of the run-up, or the start of a climb of the loss, whichever came first). ``NORMAL_SCALING`` is
    returned at most once per run, never opens an episode, and is returned again, withdrawn, when an alarm's
    episode begins within ``window`` steps of the skip it was about.
    """

    def __init__(self, mode: PrecisionMode | str = PrecisionMode.FP16, thresholds: Thresholds | None = None,
                 scaler_config: Mapping[str, Any] | None = None, *, early_startup: bool = False) -> None:
        self.mode = PrecisionMode(mode)
        self.thresholds = thresholds or Thresholds()
        self.scaler_config = dict(scaler_config or {})
        self.early_startup = early_startup
        """Raise a start-up overflow at the skip that makes the streak alarm-length, rather than when the streak
        ends: a remedy can then set the scale at once instead of letting the scaler halve its way down. The scale
        that holds is not known yet; the adapter measures it from the replay's gradients."""
        self.state = self._fresh_state()
        self._pending: list[Diagnosis] = []  # alarms raised while losses read after the fact were taken in
        self._since_promote = 0  # candidate losses taken since the healthy level was last judged
        self.divergence_opens_episode = True
        """A finite divergence opens an episode (later alarms are part of it). Off under DDP, where each rank finds
        it in its own losses while the ranks must keep meeting the agreed alarms (skips) together: it is then
        reported once, until its loss is back, and opens nothing."""

    def _fresh_state(self) -> MachineState:
        t = self.thresholds
        return MachineState(
            growths=deque(maxlen=max(t.growth_repeats * 4, 8)),
            growth_skips=deque(maxlen=t.growth_repeats),
            lr_history=deque(maxlen=t.window + t.lr_lookback + 2),
            losses=deque(maxlen=t.loss_window),
            loss_steps=deque(maxlen=t.loss_window),
            skip_log=deque(maxlen=SKIP_LOG),
        )

    # ---------------------------------------------------------------- public API

    def observe(self, obs: Observation) -> list[Diagnosis]:
        t, s = self.thresholds, self.state
        # a finite divergence found in losses taken in since the last observation comes out first (one raised by
        # this observation's own loss comes out at the next, or through take_pending: the fast path's timing)
        out: list[Diagnosis] = self.take_pending() if self._pending else []
        s.steps_seen += 1
        if s.first_scale is None:
            s.first_scale = obs.scale  # the scaler's initial scale, kept for the advice
        if obs.skipped:
            s.skipped_total += 1
            s.recent_skips.append(obs.step)
            s.skip_log.append(obs.step)
        while s.recent_skips and s.recent_skips[0] <= obs.step - t.window:
            s.recent_skips.popleft()
        if obs.loss_finite is False:
            s.nonfinite_total += 1

        if obs.anomalous:
            if self.quiet:  # the first sign of whatever comes: the healthy level stands as it was before it
                self._promote()
                s.reference_before_skip = s.reference
            if s.start_loss is None and obs.loss is not None and math.isfinite(obs.loss):
                s.start_loss = obs.loss  # a skipped step leaves the weights as they were: still the start
            if obs.skipped and s.growths and obs.step - s.growths[-1] <= t.growth_lag:
                if not s.growth_skips or s.growth_skips[-1] != s.growths[-1]:
                    s.growth_skips.append(s.growths[-1])
            self._extend_streak(obs)
            if s.episode is not None:
                s.episode.clean_run = 0
            else:
                diagnosis = self._classify(obs)
                if diagnosis is not None:
                    out.extend(self._raise(diagnosis, obs.step))
        else:
            out.extend(self._on_clean(obs))

        if obs.grew:
            s.growths.append(obs.step)
        self._record_lr(obs.step, obs.lrs)
        return out

    def take_pending(self) -> list[Diagnosis]:
        """Alarms raised while losses read after the fact were taken in (:meth:`note_losses`, the fast path's
        ``loss``): a finite divergence, which shows in the losses alone. The adapter collects them after its reads."""
        out, self._pending = self._pending, []
        return out

    @property
    def quiet(self) -> bool:
        """Nothing in progress (no episode, no streak, no isolated skip awaiting its verdict): a clean step can
        take :meth:`observe_clean`."""
        s = self.state
        return s.episode is None and s.streak is None and s.isolated_since is None

    def observe_clean(self, step: int, scale: float | None, grew: bool, lrs: tuple[float, ...],
                      loss: float | None = None) -> None:
        """The per-step fast path: what :meth:`observe` does for a clean step while :attr:`quiet`, without
        building an Observation. Never produces a diagnosis (a quiet machine has nothing to conclude).
        ``loss`` is the step's loss when the adapter has it without a sync; it feeds :attr:`loss_level`."""
        s = self.state
        s.steps_seen += 1
        skips = s.recent_skips
        if skips:
            while skips and skips[0] <= step - self.thresholds.window:
                skips.popleft()
        if scale is not None:
            if s.first_scale is None:
                s.first_scale = scale
            if self.mode is PrecisionMode.FP16 and (s.max_safe_scale is None or scale > s.max_safe_scale):
                s.max_safe_scale = scale
        s.streak_from_start = False
        if grew:
            s.growths.append(step)
        if lrs and (lrs[0] if len(lrs) == 1 else max(lrs)) != s.lr_last:
            self._record_lr(step, lrs)
        if loss is not None:
            self._take_loss(step, loss)

    def observe_clean_run(self, steps: Sequence[int], scales: Sequence[float | None], grews: Sequence[bool],
                          lrss: Sequence[tuple[float, ...]]) -> None:
        """:meth:`observe_clean` for a run of clean steps taken in later, at once, as columns (one entry per step,
        in step order; every step taken while :attr:`quiet`, with no loss read). The same state as one call per
        step: the counts added, the skip window pruned at the newest step (pruning is monotonic), the first and
        largest scale over the run, the growths in order, and the LR checked only where the run's LR tuple changes
        (after a check :attr:`MachineState.lr_last` holds that tuple's LR, so an unchanged tuple is a no-op)."""
        n = len(steps)
        if not n:
            return
        s = self.state
        s.steps_seen += n
        skips = s.recent_skips
        if skips:
            limit = steps[-1] - self.thresholds.window
            while skips and skips[0] <= limit:
                skips.popleft()
        if None in scales:
            scales = [v for v in scales if v is not None]
        if scales:
            if s.first_scale is None:
                s.first_scale = scales[0]
            if self.mode is PrecisionMode.FP16:
                top = max(scales)
                if s.max_safe_scale is None or top > s.max_safe_scale:
                    s.max_safe_scale = top
        s.streak_from_start = False
        if True in grews:
            s.growths.extend(compress(steps, grews))
        first = lrss[0]
        if lrss.count(first) == n:  # one LR through the run (a constant LR keeps its tuple): one check
            if first and (first[0] if len(first) == 1 else max(first)) != s.lr_last:
                self._record_lr(steps[0], first)
            return
        previous: tuple[float, ...] | None = None
        for step, lrs in zip(steps, lrss):
            if lrs is not previous:
                previous = lrs
                if lrs and (lrs[0] if len(lrs) == 1 else max(lrs)) != s.lr_last:
                    self._record_lr(step, lrs)

    def note_losses(self, losses: Iterable[tuple[int, float]]) -> None:
        """Healthy steps' losses read after the fact (the adapter reads them in batches, at no added sync), in
        step order: they feed :attr:`loss_level` and mark a climb exactly as ``observe_clean(loss=...)`` would.
        The adapter hands them over before it observes any later anomalous step."""
        # :meth:`_take_loss` for each, with its common case inline (a log step hands over ~50 at once): while nothing
        # is in progress (no climb, episode, streak, isolated skip or noted divergence), a finite loss under the climb
        # threshold only joins the candidate window, and the level is re-judged every ``_PROMOTE_EVERY`` losses. That
        # state and the threshold are read once, and again after anything that may change them (a re-judged level,
        # a loss that took the full path): the same result as one call per loss, for a few comparisons per loss.
        if not isinstance(losses, list):
            losses = list(losses)
        taken = self._note_healthy_run(losses) if len(losses) > _PROMOTE_EVERY else 0
        s, take, promote = self.state, self._take_loss, self._promote
        ratio = self.thresholds.divergence_ratio
        limit: float | None = None  # the climb threshold while the inline path holds; None: read the state again
        since = self._since_promote
        for step, loss in (losses[taken:] if taken else losses):
            if limit is None:
                start = s.start_loss
                if (start is None or s.climb is not None or s.episode is not None or s.divergence_noted
                        or s.streak is not None or s.isolated_since is not None):
                    self._since_promote = since
                    take(step, loss)
                    since = self._since_promote
                    continue
                ref = s.reference
                limit = ratio * (ref.level if ref is not None else start)
                window, window_steps = s.losses, s.loss_steps
            if not -_INF < loss < _INF or loss > limit:
                self._since_promote = since
                take(step, loss)
                since = self._since_promote
                limit = None
                continue
            window.append(loss)
            window_steps.append(step)
            since += 1
            if since >= _PROMOTE_EVERY:  # quiet: read with the threshold
                promote()
                since = self._since_promote
                limit = None
        self._since_promote = since

    def _note_healthy_run(self, batch: list[tuple[int, float]]) -> int:
        """The inline path of :meth:`note_losses` over whole runs of losses with C builtins: while nothing is in
        progress and every loss of the batch is finite, the losses up to the next re-judged level are taken at once
        when none of them is above the climb threshold in force (one ``max``, two ``extend``), and the level is
        re-judged exactly where the one-by-one path re-judges it. Returns how many losses it took, from the first:
        it stops before the first run that holds a loss over the threshold (the rest go one by one)."""
        s = self.state
        start = s.start_loss
        if (start is None or s.climb is not None or s.episode is not None or s.divergence_noted
                or s.streak is not None or s.isolated_since is not None):
            return 0
        steps, values = zip(*batch)
        if not all(map(math.isfinite, values)):
            return 0
        ratio, promote = self.thresholds.divergence_ratio, self._promote
        window, window_steps = s.losses, s.loss_steps
        n, since = len(values), self._since_promote
        ref = s.reference
        limit = ratio * (ref.level if ref is not None else start)
        taken = 0
        end = max(1, _PROMOTE_EVERY - since)  # where the level is re-judged first (after this many losses)
        while taken < n:
            end = min(end, n)
            run = values[taken:end]
            if max(run) > limit:
                break
            window.extend(run)
            window_steps.extend(steps[taken:end])
            since += end - taken
            taken = end
            if since >= _PROMOTE_EVERY:
                promote()  # as the one-by-one path: the level re-judged, and the threshold with it
                since = self._since_promote
                ref = s.reference
                limit = ratio * (ref.level if ref is not None else start)
            end = taken + _PROMOTE_EVERY
        self._since_promote = since
        return taken

    @property
    def has_reference(self) -> bool:
        """A healthy loss level is known (a stretch of steps was seen to be healthy)."""
        return self.state.reference is not None

    @property
    def quiet_agreed(self) -> bool:
        """:attr:`quiet`, leaving out a finite divergence's episode: what every rank of a DDP run under a scaler
        agrees on (skips are agreed; each rank's losses, and so a finite divergence, are its own)."""
        s = self.state
        ep = s.episode
        return (ep is None or ep.finite) and s.streak is None and s.isolated_since is None

    @property
    def alarm_imminent(self) -> bool:
        """No episode is open and one more skipped step would complete a start-up-length streak: the last
        moment to replay the faulty step while the weights are still those it ran with."""
        s = self.state
        count = s.streak.count if s.streak is not None else 0
        return s.episode is None and count == self.thresholds.startup_streak - 1

    @property
    def loss_level(self) -> float | None:
        """The run's healthy loss level: the median of the newest stretch of losses known to be healthy (finite,
        taken while nothing was in progress, not climbing); None while there is none (the first steps of a run,
        or a run in trouble from its start). A level is never made of the trouble it is compared with."""
        ref = self.state.reference
        return ref.level if ref is not None else None

    def reference_for(self, onset: int) -> Reference | None:
        """The healthy level from before ``onset`` (an episode's first sign), or None when no healthy stretch
        came before it: then there is nothing the episode can be measured against but what training itself shows."""
        s = self.state
        for ref in (s.reference, s.reference_before_skip):
            if ref is not None and ref.last_step < onset:
                return ref
        return None

    def reference_evidence(self, onset: int) -> dict[str, Any]:
        """``loss_reference`` (the healthy level before ``onset``, or None) and, when there is none, why."""
        ref = self.reference_for(onset)
        if ref is not None:
            return {"loss_reference": ref.level, "loss_reference_steps": [ref.first_step, ref.last_step]}
        start = self.state.start_loss
        rebased = self.state.rebased_why
        why = (f"no healthy loss level before step {onset}: {rebased}" if rebased is not None else
               f"no healthy loss level before step {onset}: the trouble began before a stretch of healthy steps "
               "could be seen")
        if start is not None:
            why += f"; the run's first loss was {start:.4g}"
        return {"loss_reference": None, "loss_reference_why": why, "loss_at_start": start}

    @property
    def start_loss(self) -> float | None:
        """The first finite loss of the fit: the weights it started with, before any update."""
        return self.state.start_loss

    @property
    def max_safe_scale(self) -> float | None:
        """The largest scale at which a step went through: what ``lower_init_scale`` falls back to."""
        return self.state.max_safe_scale

    @property
    def episode(self) -> Episode | None:
        return self.state.episode

    @property
    def steps_seen(self) -> int:
        return self.state.steps_seen

    @property
    def skipped_total(self) -> int:
        return self.state.skipped_total

    @property
    def nonfinite_total(self) -> int:
        return self.state.nonfinite_total

    @property
    def closed_episodes(self) -> list[dict[str, Any]]:
        return self.state.closed_episodes

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to carry on after a resume without re-announcing old episodes (plain JSON)."""
        return _plain(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up a checkpointed state. A malformed one (not a dict, an unknown Finding, a wrong type) raises
        ValueError naming the bad entry, and leaves this machine as it was."""
        loaded = _decode(MachineState, state, "machine state")
        fresh = self._fresh_state()
        for f in fields(fresh):  # the bounded containers keep their bounds
            bound = getattr(fresh, f.name)
            if isinstance(bound, deque):
                setattr(loaded, f.name, deque(getattr(loaded, f.name), maxlen=bound.maxlen))
        self.state = loaded

    def close_episode(self, step: int, reason: str) -> None:
        """A remedy was applied: the episode is over, so a recurrence is a new episode (and escalates)."""
        s = self.state
        if s.episode is not None:
            s.closed_episodes.append({"finding": s.episode.finding.value, "onset": s.episode.onset,
                                      "end": int(step), "reason": reason})
            s.episode = None
        s.streak = None
        s.climb = None
        s.recent_skips.clear()
        s.growth_skips.clear()

    def level_before(self, recent: Iterable[tuple[int, float]], resumed_at: int) -> LevelAt:
        """The loss level the run had where a rollback takes it back to (``resumed_at``: the first step run again),
        from ``recent`` ((step, loss) pairs as read) over the ``loss_window`` steps before it, judged as a healthy
        stretch is: every loss finite, no two skipped steps in a row, its newer half not climbing over its older half,
        and not a slow build above the healthy level before it. Otherwise there is no level, and
        ``why`` says why."""
        t, s = self.thresholds, self.state
        recent = list(recent)
        then = sorted((step, loss) for step, loss in recent if resumed_at - t.loss_window <= step < resumed_at)
        where = f"the run went back to step {resumed_at}"
        if len(then) < _LEVEL_MIN_LOSSES:  # a point is not a stretch (a rollback to the fit's start holds one loss)
            ahead = self._level_ahead(recent, resumed_at)
            if ahead is not None:
                return ahead
            if then:
                n = len(then)
                return LevelAt(resumed_at, None, then[0][0], then[-1][0], (
                    f"{where}, and only {n} loss{'' if n == 1 else 'es'} {'was' if n == 1 else 'were'} read in the "
                    f"{t.loss_window} steps before it: too few to tell a healthy stretch"))
        if not then:
            return LevelAt(resumed_at, None, resumed_at, resumed_at, (
                f"{where}, and no loss was read in the {t.loss_window} steps before it"))
        first, last = then[0][0], then[-1][0]
        span = f"steps {first}..{last}" if last > first else f"step {first}"

        def unhealthy(what: str) -> LevelAt:
            return LevelAt(resumed_at, None, first, last, f"{where}, and the losses of {span} before it {what}: not "
                                                          "a healthy stretch")

        bad = next((step for step, loss in then if not math.isfinite(loss)), None)
        if bad is not None:
            return unhealthy(f"include a non-finite one (step {bad})")
        skips = sorted(step for step in s.skip_log if resumed_at - t.loss_window <= step < resumed_at)
        streak = next((a for a, b in zip(skips, skips[1:]) if b == a + 1), None)
        if streak is not None:
            return unhealthy(f"include skipped steps in a row (from step {streak})")
        losses = [loss for _, loss in then]
        half = len(losses) // 2  # (a single loss shows no climb)
        older, newer = (statistics.median(losses[:half]), statistics.median(losses[half:])) if half else (0.0, 0.0)
        if half and newer > HEALTHY_RISE * older:
            return unhealthy(f"climb ({older:.4g} -> {newer:.4g})")
        level = statistics.median(losses)
        before = self.reference_for(first)
        if before is not None and level > HEALTHY_RISE * before.level:
            return unhealthy(f"stand at {level:.4g}, {level / before.level:.3g}x the healthy level {before.level:.4g} "
                             "before them (a slow build)")
        return LevelAt(resumed_at, level, first, last, count=len(losses))

    def _level_ahead(self, recent: list[tuple[int, float]], resumed_at: int) -> LevelAt | None:
        """Too few losses before ``resumed_at`` to judge a stretch (a rollback to the fit's start has one): the
        losses the run first had on the ``recovery_steps`` steps it now runs again, from the same state, when every
        one of them was read, finite, not skipped in a row, and before the open episode's onset. Their median is
        what a healthy run reached from that state, so the remedied run is held to it. None when they do not
        qualify (the caller then judges the few losses before, and a single loss shows no climb)."""
        t, s = self.thresholds, self.state
        end = resumed_at + t.recovery_steps
        if s.episode is None or s.episode.onset < end:
            return None
        ahead = sorted((step, loss) for step, loss in recent if resumed_at <= step < end)
        if [step for step, _ in ahead] != list(range(resumed_at, end)):
            return None
        if not all(math.isfinite(loss) for _, loss in ahead):
            return None
        skips = sorted(step for step in s.skip_log if resumed_at <= step < end)
        if any(b == a + 1 for a, b in zip(skips, skips[1:])):
            return None
        losses = [loss for _, loss in ahead]
        return LevelAt(resumed_at, statistics.median(losses), resumed_at, end - 1, count=len(losses), ahead=True)

    def rebase(self, at: LevelAt) -> None:
        """The run went back to an earlier state (a rollback): its healthy level is the one it had there, if that
        stretch was healthy (:meth:`level_before`); otherwise there is none, and the evidence of a later alarm says
        why. What was climbing belongs to abandoned steps."""
        s = self.state
        s.reference = None if at.level is None else Reference(at.level, at.first_step, at.last_step, at.count)
        s.rebased_why = at.why
        s.reference_before_skip = s.reference
        s.losses.clear()
        s.loss_steps.clear()
        s.climb = None
        self._since_promote = 0

    def reconfigure(self, mode: PrecisionMode | str | None = None, scaler_config: Mapping[str, Any] | None = None) -> None:
        """The run's arithmetic changed under us (bf16 fallback, slower growth): keep the history, switch rules."""
        if mode is not None:
            self.mode = PrecisionMode(mode)
        if scaler_config is not None:
            self.scaler_config = dict(scaler_config)

    def revise(self, finding: Finding) -> None:
        """The FP32 control renamed the open episode's finding (e.g. FORWARD_OVERFLOW -> FP32_UNSTABLE)."""
        if self.state.episode is not None:
            self.state.episode.finding = finding

    # ---------------------------------------------------------------- healthy steps

    def _on_clean(self, obs: Observation) -> list[Diagnosis]:
        t, s = self.thresholds, self.state
        out: list[Diagnosis] = []
        if obs.scale is not None and self.mode is PrecisionMode.FP16:
            if s.max_safe_scale is None or obs.scale > s.max_safe_scale:
                s.max_safe_scale = obs.scale
        episode_before = s.episode
        if obs.loss is not None:
            self._take_loss(obs.step, obs.loss)
        streak, from_start = s.streak, s.streak_from_start
        s.streak = None
        s.streak_from_start = False
        if streak is not None and s.episode is None:
            if from_start and streak.count >= t.startup_streak and streak.all_loss_finite:
                out.extend(self._raise(self._startup_overflow(streak, obs), obs.step))
            elif not s.normal_reported and s.isolated_since is None:
                s.isolated_since = streak.first_step
        if s.isolated_since is not None and s.episode is None and not s.normal_reported \
                and not self._recent_skips_after(obs.step - t.recovery_steps):
            # an isolated skip, then a clean stretch: the scaler found its level again by itself
            s.normal_reported = True
            evidence = {"skipped_steps": s.skipped_total, "steps": s.steps_seen, "scale": obs.scale}
            s.normal_call = NormalCall(s.isolated_since, evidence)
            out.append(self._make(Finding.NORMAL_SCALING, s.isolated_since, evidence))
            s.isolated_since = None
        ep = s.episode
        if ep is not None and ep is episode_before:  # an alarm this very loss raised counts from the next step
            ep.clean_run += 1
            if ep.finding is Finding.GROWTH_OVERFLOW:
                # Closed only when a growth survives; otherwise it would reopen every growth interval.
                last = s.growths[-1] if s.growths else None
                if last is not None and obs.step - last == t.growth_lag + 1 and \
                        (not s.growth_skips or s.growth_skips[-1] != last):
                    ep.growth_survived += 1
                done = ep.growth_survived >= t.growth_repeats
            else:
                done = ep.clean_run >= t.recovery_steps
            if ep.finding in DIVERGENCE_FINDINGS and ep.back_run < t.recovery_steps:
                done = False  # a divergence lasts until its loss is back, skips or not: alarms meanwhile are part of it
            if done:
                s.closed_episodes.append({"finding": ep.finding.value, "onset": ep.onset, "end": obs.step})
                s.episode = None
                s.growth_skips.clear()
        return out

    def _take_loss(self, step: int, loss: float) -> None:
        """A step's finite loss: part of a climb when far above the healthy base, otherwise a candidate for the
        healthy level. A climb that goes on for ``divergence_steps`` losses is a finite divergence."""
        if not math.isfinite(loss):
            return
        s, t = self.state, self.thresholds
        if s.start_loss is None:
            s.start_loss = loss
        ref = s.reference
        base = ref.level if ref is not None else s.start_loss
        ep = s.episode
        if loss > t.divergence_ratio * base and s.climb is None and self._since_promote and self.quiet:
            self._promote()  # a climb may start here: measure it against the level as of the step before
            ref = s.reference
            base = ref.level if ref is not None else s.start_loss
        if base > 0 and loss > t.divergence_ratio * base:
            climb = s.climb
            if climb is None:
                climb = s.climb = Climb(step, base, loss, step, loss)
            else:
                climb.last_step, climb.last_loss, climb.steps = step, loss, climb.steps + 1
            if ep is not None:
                ep.back_run = 0
            elif climb.steps >= t.divergence_steps and not s.divergence_noted:
                self._pending.extend(self._finite_divergence(climb))
            return
        s.climb = None
        if s.divergence_noted and (base <= 0 or loss <= HEALTHY_RISE * base):
            s.divergence_noted = False
        if ep is not None:
            ep.back_run = ep.back_run + 1 if base <= 0 or loss <= HEALTHY_RISE * base else 0
        s.losses.append(loss)
        s.loss_steps.append(step)
        self._since_promote += 1
        if self._since_promote >= _PROMOTE_EVERY and self.quiet:
            self._promote()

    def _promote(self) -> None:
        """Make the candidate stretch the healthy level, if it looks healthy: enough finite losses, its newer half
        not climbing over its older half, and not a slow build above the level before it."""
        self._since_promote = 0
        s = self.state
        losses = list(s.losses)
        n = len(losses)
        if n < _LEVEL_MIN_LOSSES:
            return
        # statistics.median's arithmetic (the middle of the sorted values, or the mean of the two middle ones), on
        # lists made here: no per-call type checks (a log step re-judges the level about a dozen times)
        half = n // 2
        newer, older = losses[half:], losses[:half]
        newer.sort()
        older.sort()
        n_new = n - half
        mid = n_new // 2
        newer_median = newer[mid] if n_new % 2 else (newer[mid - 1] + newer[mid]) / 2
        mid = half // 2
        older_median = older[mid] if half % 2 else (older[mid - 1] + older[mid]) / 2
        if newer_median > HEALTHY_RISE * older_median:
            return
        losses.sort()
        level = losses[half] if n % 2 else (losses[half - 1] + losses[half]) / 2
        ref = s.reference
        if ref is not None and level > HEALTHY_RISE * ref.level:
            return
        steps = s.loss_steps  # the deque's ends: no list of it
        first, last = (steps[0], steps[-1]) if len(steps) == n else (s.steps_seen - n, s.steps_seen - 1)
        s.reference = Reference(level, first, last, n)

    def _finite_divergence(self, climb: Climb) -> list[Diagnosis]:
        """A loss far above the healthy base for ``divergence_steps`` losses in a row, every one finite: an alarm of
        its own (the optimisation diverges; no skip or NaN needed), dated at the climb's start, or at the skip
        just before it."""
        s, t = self.state, self.thresholds
        onset = climb.start_step
        for skip in reversed(s.recent_skips):  # skips just before the climb were its first sign
            if skip >= onset:
                continue
            if onset - skip > 2 * t.streak:
                break
            onset = skip
        ref = self.reference_for(onset)
        base_from = "the healthy level" if ref is not None else "the run's first loss"
        ev: dict[str, Any] = {
            "precision": self.mode.value, "pattern": DivergencePattern.FINITE_DIVERGENCE, "loss": climb.last_loss,
            **self.reference_evidence(onset), "loss_at_onset": climb.start_loss, "diverged_first": True,
            "climb_base": climb.level, "climb_base_from": base_from, "climb_steps": climb.steps,
            "divergence": f"loss {climb.level:.3g} -> {climb.last_loss:.3g} over steps {climb.start_step}.."
                          f"{climb.last_step}, {climb.steps} losses in a row above {t.divergence_ratio:g}x "
                          f"{base_from}, none of them NaN or inf",
            "skipped_steps": s.skipped_total, "steps": s.steps_seen,
        }
        lr = self._lr_event(onset, s.lr_last)
        if lr is not None:
            ev.update(lr)
        finding = Finding.LR_SCHEDULE if lr is not None else Finding.FP32_UNSTABLE
        if not self.divergence_opens_episode:
            s.divergence_noted = True
            return [self._make(finding, onset, ev)]
        out = self._raise(self._make(finding, onset, ev), climb.last_step)
        assert s.episode is not None
        s.episode.finite = True
        return out

    # ---------------------------------------------------------------- classification

    def _extend_streak(self, obs: Observation) -> None:
        streak = self.state.streak
        if streak is None:
            streak = self.state.streak = Streak(obs.step, obs.scale)
        streak.count += 1
        streak.scales.append(obs.scale)
        if obs.loss_finite is False:
            streak.all_loss_finite = False

    def first_sign(self, step: int) -> int:
        """Where trouble at ``step`` first showed, as far as the machine knows now (see :meth:`_first_sign`)."""
        return self._first_sign(step)

    def untouched_since(self, step: int, now: int) -> bool:
        """Every step from ``step`` to ``now`` (both included) was anomalous, in one streak: under a GradScaler they
        were all skipped, so the weights and the optimizer are as they were before ``step``."""
        streak = self.state.streak
        return streak is not None and streak.first_step <= step and streak.first_step + streak.count - 1 == now

    def _first_sign(self, step: int) -> int:
        """Where the trouble now at ``step`` first showed: the start of the anomalous streak, or earlier, the
        first skip of the cluster of skips (each within ``2 * streak`` steps of the next) that led up to it."""
        s = self.state
        start = s.streak.first_step if s.streak is not None else step
        for skip in reversed(s.recent_skips):
            if skip >= start:
                continue
            if start - skip > 2 * self.thresholds.streak:
                break
            start = skip
        return start

    def _classify(self, obs: Observation) -> Diagnosis | None:
        t, s = self.thresholds, self.state
        ev: dict[str, Any] = {"precision": self.mode.value}
        if obs.loss is not None:
            ev["loss"] = obs.loss
        if obs.scale is not None:
            ev["scale"] = obs.scale
        batch = obs.batch
        if batch is not None and batch.nonfinite:
            ev["nonfinite_where"] = batch.nonfinite_where
            return self._make(Finding.DATA_NONFINITE, obs.step, ev)

        first = self._first_sign(obs.step)
        climb = s.climb if s.climb is not None and s.climb.steps >= t.climb_steps else None
        if climb is not None:
            ev.update(self._climb_evidence(climb, first))
            if climb.start_step < first:  # divergence first: the optimisation, not reduced precision
                lr = self._lr_event(climb.start_step, max(obs.lrs, default=None))
                if lr is not None:
                    ev.update(lr)
                    return self._make(Finding.LR_SCHEDULE, climb.start_step, ev)
                return self._make(Finding.FP32_UNSTABLE, climb.start_step, ev)

        if obs.loss_finite is False:
            onset = first
            if onset != obs.step:
                ev["first_nonfinite_step"] = obs.step
        else:
            candidate = self._gradient_pattern(obs, ev)
            if candidate is None:
                return None
            onset = int(ev.pop("onset", obs.step))

        lr = self._lr_event(onset, max(obs.lrs, default=None))
        if lr is not None:
            ev.update(lr)
            return self._make(Finding.LR_SCHEDULE, onset, ev)

        if obs.loss_finite is False:
            if self.mode is PrecisionMode.FP32:
                return self._make(Finding.FP32_UNSTABLE, onset, ev)
            if self.mode in (PrecisionMode.FP16, PrecisionMode.HALF) and batch is not None and batch.absmax > t.input_limit:
                ev.update(input_absmax=batch.absmax, input_where=batch.absmax_where)
                return self._make(Finding.INPUT_RANGE, onset, ev)
            return self._make(Finding.FORWARD_OVERFLOW, onset, ev)

        if self.mode is PrecisionMode.FP16 and batch is not None and batch.absmax > t.input_limit \
                and candidate is Finding.GRADIENT_OVERFLOW:
            ev.update(input_absmax=batch.absmax, input_where=batch.absmax_where)
            return self._make(Finding.INPUT_RANGE, onset, ev)
        return self._make(candidate, onset, ev)

    def _climb_evidence(self, climb: Climb, first_sign: int) -> dict[str, Any]:
        first = climb.start_step < first_sign
        when = "before any overflow" if first else f"after the first skip at step {first_sign}"
        return {
            "loss_level": climb.level, "loss_at_onset": climb.start_loss, "diverged_first": first,
            "divergence": f"loss {climb.level:.3g} -> {climb.last_loss:.3g} over steps "
                          f"{climb.start_step}..{climb.last_step} {when}",
        }

    def _gradient_pattern(self, obs: Observation, ev: dict[str, Any]) -> Finding | None:
        """Skips with a finite loss: which overflow pattern, if any, they already form."""
        t, s = self.thresholds, self.state
        streak = s.streak
        assert streak is not None  # the current observation is in it
        ev.update(skipped_in_row=streak.count, skipped_steps=s.skipped_total, steps=s.steps_seen)
        if s.first_scale is not None:
            ev["init_scale"] = s.first_scale
        if obs.scale is not None and obs.scale < t.floor_scale and (s.streak_from_start or streak.count >= 2):
            ev.update(pattern=GradientPattern.UNSCALED_OVERFLOW, scale_history=list(streak.scales),
                      onset=streak.first_step)
            return Finding.GRADIENT_OVERFLOW
        if s.streak_from_start:
            if self.early_startup and streak.count >= t.startup_streak and streak.all_loss_finite:
                ev.update(pattern=GradientPattern.STARTUP, scale_history=list(streak.scales), onset=streak.first_step)
                return Finding.GRADIENT_OVERFLOW
            return None  # wait: the streak is judged when it ends and the safe scale is known
        if len(s.growth_skips) >= t.growth_repeats:
            span = max(1, obs.step - s.growth_skips[0] + 1)
            skips_in_span = sum(1 for step in s.recent_skips if step >= s.growth_skips[0])
            rate = max(skips_in_span, t.growth_repeats) / span
            if rate >= t.growth_skip_rate:
                ev.update(pattern=GradientPattern.GROWTH_OVERFLOW, growth_steps=list(s.growth_skips), span=span,
                          skip_rate=round(rate, 4), onset=s.growth_skips[0] + 1,
                          safe_scale=obs.scale * self.scaler_config.get("backoff_factor", 0.5) if obs.scale else None,
                          **self._scaler_ev())
                return Finding.GROWTH_OVERFLOW
        burst = [step for step in s.recent_skips if step > obs.step - 2 * t.streak]
        if len(burst) >= t.streak:
            pattern = GradientPattern.COLLAPSE if streak.count >= t.streak else GradientPattern.BURST
            ev.update(pattern=pattern, scale_history=list(streak.scales), safe_scale=s.max_safe_scale,
                      onset_scale=streak.first_scale, onset=burst[0])
            return Finding.GRADIENT_OVERFLOW
        window_steps = min(t.window, s.steps_seen)
        if window_steps >= t.window // 2 and len(s.recent_skips) >= max(3, t.window_skip_rate * window_steps):
            ev.update(pattern=GradientPattern.PERSISTENT, skip_rate=round(len(s.recent_skips) / window_steps, 4),
                      window=window_steps, safe_scale=s.max_safe_scale, onset=s.recent_skips[0])
            return Finding.GRADIENT_OVERFLOW
        return None

    def _startup_overflow(self, streak: Streak, clean: Observation) -> Diagnosis:
        below_floor = clean.scale is not None and clean.scale < self.thresholds.floor_scale
        pattern = GradientPattern.UNSCALED_OVERFLOW if below_floor else GradientPattern.STARTUP
        ev: dict[str, Any] = {
            "precision": self.mode.value, "pattern": pattern, "skipped_in_row": streak.count,
            "init_scale": streak.first_scale, "safe_scale": clean.scale, "scale_history": list(streak.scales),
        }
        return self._make(Finding.GRADIENT_OVERFLOW, streak.first_step, ev)

    def _scaler_ev(self) -> dict[str, Any]:
        keys = ("growth_interval", "growth_factor", "backoff_factor")
        return {k: self.scaler_config[k] for k in keys if k in self.scaler_config}

    # ---------------------------------------------------------------- learning rate

    def _record_lr(self, step: int, lrs: tuple[float, ...]) -> None:
        """Keep the LR's change points only (a constant LR costs nothing per step), and the latest rise."""
        if not lrs:
            return
        s = self.state
        lr = max(lrs)
        if lr == s.lr_last:
            return
        s.lr_last = lr
        previous = s.lr_history[-1] if s.lr_history else None
        if previous is not None and lr > previous.lr:
            rise = s.lr_rise
            if rise is not None and rise.top_step == previous.step and \
                    step - previous.step <= self.thresholds.lr_lookback:
                rise.top_step, rise.top_lr, rise.points = step, lr, rise.points + 1
            else:  # a new rise, from the LR just before it
                s.lr_rise = LrRise(previous.step, previous.lr, step, lr)
        s.lr_history.append(LrPoint(step, lr))

    def _lr_event(self, onset: int, now_lr: float | None = None) -> dict[str, Any] | None:
        """An LR rise in the steps just before ``onset``: a warmup that just peaked, or a plain increase. ``now_lr``
        is the LR of the latest step (not yet in the history): a warmup still rising has not ended."""
        t, s = self.thresholds, self.state
        # A warmup climbs over many steps, so its last few rise little: judge it by the whole rise (from the LR
        # it started at to a peak just before the onset). A single jump is an increase, not a warmup; and a ramp
        # whose LR is still going up at the onset (or after it) has not peaked: its warmup has not ended.
        rise = s.lr_rise
        stopped = rise is not None and (now_lr is None or now_lr <= rise.top_lr)
        if (rise is not None and stopped and rise.points >= 2 and onset - t.lr_lookback - 1 <= rise.top_step < onset
                and rise.top_lr >= t.warmup_ratio * rise.start_lr):
            return {"lr_event": LrEvent.WARMUP_END, "lr_before": rise.start_lr, "lr_after": rise.top_lr,
                    "lr_change_step": rise.top_step, "lr_ramp_start": rise.start_lr,
                    "lr_ramp_start_step": rise.start_step}
        start = onset - t.lr_lookback - 1
        in_force = [p for p in s.lr_history if p.step < start][-1:]  # the LR at the window's start
        window = [LrPoint(start, p.lr) for p in in_force]
        window += [p for p in s.lr_history if start <= p.step < onset]
        best: tuple[float, LrPoint, LrPoint] | None = None
        lowest: LrPoint | None = None
        for point in window:
            if lowest is not None and point.lr > lowest.lr:
                ratio = math.inf if lowest.lr <= 0 else point.lr / lowest.lr
                if best is None or ratio > best[0]:
                    best = (ratio, lowest, point)
            if lowest is None or point.lr < lowest.lr:
                lowest = point
        if best is None or best[0] < 1 + t.lr_rise:
            return None
        _, lo, hi = best
        ev: dict[str, Any] = {"lr_event": LrEvent.LR_INCREASE, "lr_before": lo.lr, "lr_after": hi.lr,
                              "lr_change_step": hi.step}
        if rise is not None and rise.points >= 2 and rise.start_lr < lo.lr and rise.top_step >= lo.step:
            # the rise is the end of a longer ramp: where that began is its own field, not the LR before
            ev.update(lr_ramp_start=rise.start_lr, lr_ramp_start_step=rise.start_step)
        return ev

    # ---------------------------------------------------------------- helpers

    def _recent_skips_after(self, step: int) -> bool:
        skips = self.state.recent_skips
        return bool(skips) and skips[-1] > step

    def _raise(self, alarm: Diagnosis, step: int) -> list[Diagnosis]:
        """Open the alarm's episode; withdraw a ``NORMAL_SCALING`` call whose skip turns out to have begun it."""
        s = self.state
        s.episode = Episode(alarm.finding, alarm.step)
        s.recent_skips.clear()  # the skips that made this alarm must not make the next one
        s.isolated_since = None
        s.climb = None
        call, s.normal_call = s.normal_call, None
        out = [alarm]
        if call is not None and alarm.finding is not Finding.DATA_NONFINITE \
                and alarm.step - call.step <= self.thresholds.window:
            out.append(self._make(Finding.NORMAL_SCALING, call.step, {
                **call.evidence, "withdrawn": True, "withdrawn_by": alarm.finding.value, "withdrawn_at": step,
                "alarm_onset": alarm.step,
            }))
        return out

    def _make(self, finding: Finding, step: int, evidence: dict[str, Any]) -> Diagnosis:
        kind = self.scaler_config.get("loss_scaler")
        if kind is not None and finding in (Finding.GRADIENT_OVERFLOW, Finding.GROWTH_OVERFLOW):
            evidence.setdefault("loss_scaler", kind)  # not a GradScaler (DeepSpeed's): the advice says its settings
        return Diagnosis(finding=finding, step=int(step), evidence=evidence, advice=advise(finding, evidence))
