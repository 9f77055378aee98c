"""The taxonomy state machine: one observation per optimizer step in, diagnoses out.

Pure Python (no torch, no Lightning) so that every rule can be tested with synthetic sequences.
It decides *what* is wrong; how the numbers were measured and what to do about them live elsewhere.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Iterable, Mapping

from lightning_ampwatch.taxonomy import Diagnosis, Finding, advise


class PrecisionMode(str, Enum):
    """What arithmetic the watched run uses; decides which findings are possible."""

    FP16 = "fp16"  # float16 autocast with a GradScaler
    BF16 = "bf16"  # bfloat16 autocast, no scaler
    FP32 = "fp32"  # no reduced precision at all: the FP32 control is the run itself
    HALF = "half"  # parameters in float16 ("16-true"), no scaler

    @property
    def reduced(self) -> bool:
        return self is not PrecisionMode.FP32


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
    """The peak must be this many times the first LR for the climb to count as a warmup."""
    input_limit: float = 1e4
    """Batch values beyond this magnitude are out of float16's comfortable range."""
    recovery_steps: int = 8
    """Clean steps in a row that end an episode."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Thresholds.{f.name} must be a positive number, got {value!r}")
        if not self.window_skip_rate <= 1 or not self.growth_skip_rate <= 1:
            raise ValueError("skip rates are fractions in (0, 1]")


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
    a scaler costs nothing to watch). ``scale`` is the scale the step ran with.
    """

    step: int
    skipped: bool = False
    loss: float | None = None
    loss_finite: bool | None = None
    scale: float | None = None
    grew: bool = False
    lrs: tuple[float, ...] = ()
    batch: BatchStats | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def anomalous(self) -> bool:
        return self.skipped or self.loss_finite is False


class ScaleMirror:
    """A host-side copy of GradScaler's scale arithmetic.

    ``torch._amp_update_scale_`` is deterministic given whether each step found an inf, and the step hook
    tells us that for free; so the scale, the growth tracker and every growth event are known on the host
    without reading the device. The adapter reconciles with the real value when it reads it anyway.
    """

    def __init__(self, scale: float, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, tracker: int = 0) -> None:
        self.scale = float(scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.tracker = int(tracker)

    def update(self, found_inf: bool) -> bool:
        """Advance one step; returns True when the scale grew."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.tracker = 0
            return False
        self.tracker += 1
        if self.tracker >= self.growth_interval:
            grown = self.scale * self.growth_factor
            self.tracker = 0
            if math.isfinite(grown):
                self.scale = grown
                return True
        return False

    def reconcile(self, scale: float, tracker: int | None = None) -> None:
        self.scale = float(scale)
        if tracker is not None:
            self.tracker = int(tracker)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "tracker": self.tracker}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "ScaleMirror":
        return cls(**state)


@dataclass
class Episode:
    """An open alarm: raised once, closed when training has been clean for a while."""

    finding: Finding
    onset: int
    clean_run: int = 0
    growth_survived: int = 0


@dataclass
class _LrPoint:
    step: int
    lr: float


class AmpStateMachine:
    """Feed ``observe`` one :class:`Observation` per optimizer step, in order; it returns new diagnoses.

    An alarm is returned once per episode, dated at the episode's onset. ``NORMAL_SCALING`` is returned at most
    once per run and never opens an episode.
    """

    def __init__(self, mode: PrecisionMode | str = PrecisionMode.FP16, thresholds: Thresholds | None = None,
                 scaler_config: Mapping[str, Any] | None = None) -> None:
        self.mode = PrecisionMode(mode)
        self.thresholds = thresholds or Thresholds()
        self.scaler_config = dict(scaler_config or {})
        t = self.thresholds
        self.episode: Episode | None = None
        self.steps_seen = 0
        self.skipped_total = 0
        self.nonfinite_total = 0
        self.normal_reported = False
        self._isolated_since: int | None = None
        self._streak: list[Observation] = []
        self._streak_from_start = True
        self._recent_skips: deque[int] = deque()
        self._growths: deque[int] = deque(maxlen=max(t.growth_repeats * 4, 8))
        self._growth_skips: deque[int] = deque(maxlen=t.growth_repeats)
        self._lr_history: deque[_LrPoint] = deque(maxlen=t.window + t.lr_lookback + 2)
        self._lr_first: float | None = None
        self._lr_last: float | None = None
        self._lr_peak = 0.0
        self._lr_peak_step = -1
        self._max_safe_scale: float | None = None
        self.closed_episodes: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- public API

    def observe(self, obs: Observation) -> list[Diagnosis]:
        t = self.thresholds
        out: list[Diagnosis] = []
        self.steps_seen += 1
        if obs.skipped:
            self.skipped_total += 1
            self._recent_skips.append(obs.step)
        while self._recent_skips and self._recent_skips[0] <= obs.step - t.window:
            self._recent_skips.popleft()
        if obs.loss_finite is False:
            self.nonfinite_total += 1

        if obs.anomalous:
            if obs.skipped and self._growths and obs.step - self._growths[-1] <= t.growth_lag:
                if not self._growth_skips or self._growth_skips[-1] != self._growths[-1]:
                    self._growth_skips.append(self._growths[-1])
            self._streak.append(obs)
            if self.episode is not None:
                self.episode.clean_run = 0
            else:
                diagnosis = self._classify(obs)
                if diagnosis is not None:
                    self._open_episode(diagnosis.finding, diagnosis.step)
                    out.append(diagnosis)
        else:
            out.extend(self._on_clean(obs))

        if obs.grew:
            self._growths.append(obs.step)
        self._record_lr(obs.step, obs.lrs)
        return out

    @property
    def quiet(self) -> bool:
        """Nothing in progress (no episode, no streak, no isolated skip awaiting its verdict): a clean step can
        take :meth:`observe_clean`."""
        return self.episode is None and not self._streak and self._isolated_since is None

    def observe_clean(self, step: int, scale: float | None, grew: bool, lrs: tuple[float, ...]) -> None:
        """The per-step fast path: what :meth:`observe` does for a clean step while :attr:`quiet`, without
        building an Observation. Never produces a diagnosis (a quiet machine has nothing to conclude)."""
        self.steps_seen += 1
        skips = self._recent_skips
        if skips:
            while skips and skips[0] <= step - self.thresholds.window:
                skips.popleft()
        if scale is not None and (self._max_safe_scale is None or scale > self._max_safe_scale) \
                and self.mode is PrecisionMode.FP16:
            self._max_safe_scale = scale
        self._streak_from_start = False
        if grew:
            self._growths.append(step)
        if lrs and (lrs[0] if len(lrs) == 1 else max(lrs)) != self._lr_last:
            self._record_lr(step, lrs)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to carry on after a resume without re-announcing old episodes."""
        return {
            "mode": self.mode.value,
            "thresholds": asdict(self.thresholds),
            "scaler_config": self.scaler_config,
            "episode": None if self.episode is None else {**asdict(self.episode), "finding": self.episode.finding.value},
            "steps_seen": self.steps_seen,
            "skipped_total": self.skipped_total,
            "nonfinite_total": self.nonfinite_total,
            "normal_reported": self.normal_reported,
            "isolated_since": self._isolated_since,
            "streak_from_start": self._streak_from_start,
            "recent_skips": list(self._recent_skips),
            "growths": list(self._growths),
            "growth_skips": list(self._growth_skips),
            "lr_history": [(p.step, p.lr) for p in self._lr_history],
            "lr_first": self._lr_first,
            "lr_peak": self._lr_peak,
            "lr_peak_step": self._lr_peak_step,
            "max_safe_scale": self._max_safe_scale,
            "closed_episodes": list(self.closed_episodes),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ep = state.get("episode")
        self.episode = None if ep is None else Episode(**{**ep, "finding": Finding(ep["finding"])})
        self.steps_seen = int(state.get("steps_seen", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        self.normal_reported = bool(state.get("normal_reported", False))
        self._isolated_since = state.get("isolated_since")
        self._streak = []
        self._streak_from_start = bool(state.get("streak_from_start", self.steps_seen == 0))
        self._recent_skips = deque(state.get("recent_skips", ()))
        self._growths = deque(state.get("growths", ()), maxlen=self._growths.maxlen)
        self._growth_skips = deque(state.get("growth_skips", ()), maxlen=self._growth_skips.maxlen)
        self._lr_history = deque((_LrPoint(s, lr) for s, lr in state.get("lr_history", ())),
                                 maxlen=self._lr_history.maxlen)
        self._lr_first = state.get("lr_first")
        self._lr_last = self._lr_history[-1].lr if self._lr_history else None
        self._lr_peak = float(state.get("lr_peak", 0.0))
        self._lr_peak_step = int(state.get("lr_peak_step", -1))
        self._max_safe_scale = state.get("max_safe_scale")
        self.closed_episodes = list(state.get("closed_episodes", ()))

    @property
    def streak(self) -> int:
        """Anomalous steps in a row so far (0 on a healthy step)."""
        return len(self._streak)

    def close_episode(self, step: int, reason: str) -> None:
        """A remedy was applied: the episode is over, so a recurrence is a new episode (and escalates)."""
        if self.episode is not None:
            self.closed_episodes.append({"finding": self.episode.finding.value, "onset": self.episode.onset,
                                         "end": int(step), "reason": reason})
            self.episode = None
        self._streak = []
        self._recent_skips.clear()
        self._growth_skips.clear()

    def reconfigure(self, mode: PrecisionMode | str | None = None, scaler_config: Mapping[str, Any] | None = None) -> None:
        """The run's arithmetic changed under us (bf16 fallback, slower growth): keep the history, switch rules."""
        if mode is not None:
            self.mode = PrecisionMode(mode)
        if scaler_config is not None:
            self.scaler_config = dict(scaler_config)

    def revise(self, finding: Finding) -> None:
        """The FP32 control renamed the open episode's finding (e.g. FORWARD_OVERFLOW -> FP32_UNSTABLE)."""
        if self.episode is not None:
            self.episode.finding = finding

    @property
    def max_safe_scale(self) -> float | None:
        """The largest scale at which a step went through: what ``lower_init_scale`` falls back to."""
        return self._max_safe_scale

    # ---------------------------------------------------------------- healthy steps

    def _on_clean(self, obs: Observation) -> list[Diagnosis]:
        t = self.thresholds
        out: list[Diagnosis] = []
        if obs.scale is not None and self.mode is PrecisionMode.FP16:
            if self._max_safe_scale is None or obs.scale > self._max_safe_scale:
                self._max_safe_scale = obs.scale
        streak, from_start = self._streak, self._streak_from_start
        self._streak = []
        self._streak_from_start = False
        if streak and self.episode is None:
            if from_start and len(streak) >= t.startup_streak and all(o.loss_finite is not False for o in streak):
                out.append(self._startup_overflow(streak, obs))
                self._open_episode(Finding.GRADIENT_OVERFLOW, streak[0].step)
            elif not self.normal_reported and self._isolated_since is None:
                self._isolated_since = streak[0].step
        if self._isolated_since is not None and self.episode is None and not self.normal_reported \
                and not self._recent_skips_after(obs.step - t.recovery_steps):
            # an isolated skip, then a clean stretch: the scaler found its level again by itself
            self.normal_reported = True
            out.append(self._make(Finding.NORMAL_SCALING, self._isolated_since, {
                "skipped_steps": self.skipped_total, "steps": self.steps_seen, "scale": obs.scale,
            }))
            self._isolated_since = None
        ep = self.episode
        if ep is not None:
            ep.clean_run += 1
            if ep.finding is Finding.GROWTH_OVERFLOW:
                # Closed only when a growth survives; otherwise it would reopen every growth interval.
                last = self._growths[-1] if self._growths else None
                if last is not None and obs.step - last == t.growth_lag + 1 and \
                        (not self._growth_skips or self._growth_skips[-1] != last):
                    ep.growth_survived += 1
                done = ep.growth_survived >= t.growth_repeats
            else:
                done = ep.clean_run >= t.recovery_steps
            if done:
                self.closed_episodes.append({"finding": ep.finding.value, "onset": ep.onset, "end": obs.step})
                self.episode = None
                self._growth_skips.clear()
        return out

    # ---------------------------------------------------------------- classification

    def _classify(self, obs: Observation) -> Diagnosis | None:
        t = self.thresholds
        ev: dict[str, Any] = {"precision": self.mode.value}
        if obs.loss is not None:
            ev["loss"] = obs.loss
        if obs.scale is not None:
            ev["scale"] = obs.scale
        ev.update(obs.extra)
        batch = obs.batch
        if batch is not None and batch.nonfinite:
            ev["nonfinite_where"] = batch.nonfinite_where
            return self._make(Finding.DATA_NONFINITE, obs.step, ev)

        if obs.loss_finite is False:
            onset = obs.step
        else:
            candidate = self._gradient_pattern(obs, ev)
            if candidate is None:
                return None
            onset = int(ev.pop("onset", obs.step))

        lr = self._lr_event(onset)
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

    def _gradient_pattern(self, obs: Observation, ev: dict[str, Any]) -> Finding | None:
        """Skips with a finite loss: which overflow pattern, if any, they already form."""
        t = self.thresholds
        streak = self._streak
        ev.update(skipped_in_row=len(streak), skipped_steps=self.skipped_total, steps=self.steps_seen)
        if obs.scale is not None and obs.scale < t.floor_scale and (self._streak_from_start or len(streak) >= 2):
            ev.update(pattern="unscaled_overflow", scale_history=[o.scale for o in streak][-24:], onset=streak[0].step)
            return Finding.GRADIENT_OVERFLOW
        if self._streak_from_start:
            return None  # wait: the streak is judged when it ends and the safe scale is known
        if len(self._growth_skips) >= t.growth_repeats:
            span = max(1, obs.step - self._growth_skips[0] + 1)
            skips_in_span = sum(1 for s in self._recent_skips if s >= self._growth_skips[0])
            rate = max(skips_in_span, t.growth_repeats) / span
            if rate >= t.growth_skip_rate:
                ev.update(pattern="growth_overflow", growth_steps=list(self._growth_skips), span=span,
                          skip_rate=round(rate, 4), onset=self._growth_skips[0] + 1, safe_scale=(obs.scale or 0) * self.scaler_config.get(
                              "backoff_factor", 0.5) if obs.scale else None, **self._scaler_ev())
                return Finding.GROWTH_OVERFLOW
        burst = [step for step in self._recent_skips if step > obs.step - 2 * t.streak]
        if len(burst) >= t.streak:
            pattern = "collapse" if len(streak) >= t.streak else "burst"
            ev.update(pattern=pattern, scale_history=[o.scale for o in streak][-24:],
                      safe_scale=self._max_safe_scale, onset=burst[0])
            return Finding.GRADIENT_OVERFLOW
        window_steps = min(t.window, self.steps_seen)
        if window_steps >= t.window // 2 and len(self._recent_skips) >= max(3, t.window_skip_rate * window_steps):
            ev.update(pattern="persistent", skip_rate=round(len(self._recent_skips) / window_steps, 4),
                      window=window_steps, safe_scale=self._max_safe_scale, onset=self._recent_skips[0])
            return Finding.GRADIENT_OVERFLOW
        return None

    def _startup_overflow(self, streak: list[Observation], clean: Observation) -> Diagnosis:
        below_floor = clean.scale is not None and clean.scale < self.thresholds.floor_scale
        ev: dict[str, Any] = {
            "precision": self.mode.value, "pattern": "unscaled_overflow" if below_floor else "startup",
            "skipped_in_row": len(streak),
            "init_scale": streak[0].scale, "safe_scale": clean.scale,
            "scale_history": [o.scale for o in streak][-24:],
        }
        onset = streak[0].step
        return self._make(Finding.GRADIENT_OVERFLOW, onset, ev)

    def _scaler_ev(self) -> dict[str, Any]:
        keys = ("growth_interval", "growth_factor", "backoff_factor")
        return {k: self.scaler_config[k] for k in keys if k in self.scaler_config}

    # ---------------------------------------------------------------- learning rate

    def _record_lr(self, step: int, lrs: tuple[float, ...]) -> None:
        """Keep the LR's change points only: a constant LR costs nothing per step."""
        if not lrs:
            return
        lr = max(lrs)
        if lr == self._lr_last:
            return
        self._lr_last = lr
        if self._lr_first is None:
            self._lr_first = lr
        if lr > self._lr_peak:
            self._lr_peak = lr
            self._lr_peak_step = step
        self._lr_history.append(_LrPoint(step, lr))

    def _lr_event(self, onset: int) -> dict[str, Any] | None:
        """An LR rise in the steps just before ``onset``: a warmup that just peaked, or a plain increase."""
        t = self.thresholds
        # A warmup climbs over many steps, so its last few rise little: judge it by the whole climb (first LR to
        # a peak reached by rising steps just before the onset). A single jump is an increase, not a warmup.
        climb = [p.lr for p in self._lr_history if p.step <= self._lr_peak_step][-3:]
        if (self._lr_first is not None and onset - t.lr_lookback - 1 <= self._lr_peak_step < onset
                and self._lr_peak >= t.warmup_ratio * self._lr_first
                and len(climb) == 3 and climb[0] < climb[1] < climb[2]):
            return {"lr_event": "warmup_end", "lr_before": self._lr_first, "lr_after": self._lr_peak,
                    "lr_change_step": self._lr_peak_step}
        start = onset - t.lr_lookback - 1
        in_force = [p for p in self._lr_history if p.step < start][-1:]  # the LR at the window's start
        window = [_LrPoint(start, p.lr) for p in in_force]
        window += [p for p in self._lr_history if start <= p.step < onset]
        best: tuple[float, _LrPoint, _LrPoint] | None = None
        lowest: _LrPoint | None = None
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
        return {"lr_event": "lr_increase", "lr_before": lo.lr, "lr_after": hi.lr, "lr_change_step": hi.step}

    # ---------------------------------------------------------------- helpers

    def _recent_skips_after(self, step: int) -> bool:
        return bool(self._recent_skips) and self._recent_skips[-1] > step

    def _open_episode(self, finding: Finding, onset: int) -> None:
        self.episode = Episode(finding, onset)
        self._recent_skips.clear()  # the skips that made this alarm must not make the next one
        self._isolated_since = None

    def _make(self, finding: Finding, step: int, evidence: dict[str, Any]) -> Diagnosis:
        return Diagnosis(finding=finding, step=int(step), evidence=evidence, advice=advise(finding, evidence))


def replay(machine: AmpStateMachine, observations: Iterable[Observation]) -> list[Diagnosis]:
    """Feed a whole sequence; handy for tests and for ``ampwatch report`` re-analysis."""
    out: list[Diagnosis] = []
    for obs in observations:
        out.extend(machine.observe(obs))
    return out


#: Findings that blame reduced precision, and so are put to the FP32 control.
AMP_BLAMING = frozenset({Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.GRADIENT_OVERFLOW,
                         Finding.GROWTH_OVERFLOW})

#: How far above the run's loss level a finite control loss must be to read as instability rather than AMP.
CONTROL_LEVEL_RATIO = 1e3


def judge_control(finding: Finding, *, control_loss: float | None, control_grads_finite: bool | None,
                  batch_nonfinite: bool, loss_level: float | None) -> tuple[Finding, str]:
    """What the FP32 control says about a finding: (the finding it leaves standing, why, in a few words).

    A control that fails too clears AMP: the data (if the batch holds NaN/inf) or the optimisation is at fault.
    A control that is finite but orders of magnitude above the run's usual loss reads as divergence, not AMP.
    Findings that do not blame reduced precision (data, LR schedule) keep their name; the control is evidence.
    """
    if control_loss is None:
        return finding, "control not run"
    control_failed = not math.isfinite(control_loss) or control_grads_finite is False
    if finding not in AMP_BLAMING:
        return finding, "control failed too" if control_failed else "control finite"
    if control_failed:
        if batch_nonfinite:
            return Finding.DATA_NONFINITE, "control failed too; the batch holds non-finite values"
        return Finding.FP32_UNSTABLE, "control failed too: not an AMP fault"
    if loss_level is not None and loss_level > 0 and control_loss > CONTROL_LEVEL_RATIO * loss_level:
        return Finding.FP32_UNSTABLE, (f"control finite but {control_loss / loss_level:.3g}x the run's loss level: "
                                       "the optimisation is diverging (or this batch is far outside the data "
                                       "seen so far)")
    return finding, "control finite: an AMP fault"
