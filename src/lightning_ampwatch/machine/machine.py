"""The taxonomy state machine: one observation per optimizer step in, diagnoses out.

Pure Python (no torch, no Lightning) so that every rule can be tested with synthetic sequences.
It decides *what* is wrong; how the numbers were measured and what to do about them live elsewhere. The loss level
it compares with (the healthy reference, the climb, the level after a rollback) is tracked by the
:class:`~lightning_ampwatch.machine.reference.HealthyReference` it owns, which reports a climb that lasts and leaves
the alarm to the machine; what it carries from step to step, and its checkpoint, is ``state.py``'s. The last module of
the package: it imports the others, none of them imports it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import fields
from itertools import compress
from typing import Any, Iterable, Mapping, Sequence

from lightning_ampwatch.machine.lr_history import lr_event, record_lr
from lightning_ampwatch.machine.reference import SKIP_LOG, HealthyReference, LevelAt
from lightning_ampwatch.machine.state import (
    SCALE_HISTORY,
    Climb,
    Episode,
    MachineState,
    NormalCall,
    OptimizerSteps,
    Streak,
    decode,
    plain,
)
from lightning_ampwatch.machine.vocabulary import Observation, PrecisionMode, Thresholds
from lightning_ampwatch.taxonomy import Diagnosis, Finding, GradientPattern, advise, format_pow2


#: Findings whose episode is a divergence of the loss: it lasts until the loss is back, whatever the skips do.
DIVERGENCE_FINDINGS = frozenset({Finding.FP32_UNSTABLE, Finding.LR_SCHEDULE})


# ------------------------------------------------------------------------------------ the machine


def _data_step(obs: Observation) -> bool:
    """A step whose loss its own batch made non-finite (NaN/inf in the data that reached the loss)."""
    return obs.loss_finite is False and obs.batch is not None and obs.batch.nonfinite


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
        self.healthy = HealthyReference(self, self._climb_lasted)
        """The healthy-reference tracker: the loss level, the climb, the level after a rollback."""
        self.optimizer_names: tuple[str, ...] = ()
        """Each optimizer in a few words ("Adam over disc.*"), by index, where several step through one scaler."""
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
        if obs.optimizer is not None and obs.skipped:
            self._optimizer_skipped(obs)

        if obs.anomalous:
            if self.quiet:  # the first sign of whatever comes: the healthy level stands as it was before it
                self.healthy.promote()
                s.reference_before_skip = s.reference
            if s.start_loss is None and obs.loss is not None and math.isfinite(obs.loss):
                s.start_loss = obs.loss  # a skipped step leaves the weights as they were: still the start
            if obs.skipped and s.growths and obs.step - s.growths[-1] <= t.growth_lag:
                if not s.growth_skips or s.growth_skips[-1] != s.growths[-1]:
                    s.growth_skips.append(s.growths[-1])
            self._extend_streak(obs)
            if s.episode is not None and not self._beside_data(s.episode, obs):
                s.episode.clean_run = 0
            else:
                diagnosis = self._classify(obs)
                if diagnosis is not None:
                    out.extend(self._raise(diagnosis, obs.step))
        else:
            out.extend(self._on_clean(obs))

        if obs.grew:
            s.growths.append(obs.step)
        record_lr(s, t, obs.step, obs.lrs)
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
            record_lr(s, self.thresholds, step, lrs)
        if loss is not None:
            self.healthy.take_loss(step, loss)

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
                record_lr(s, self.thresholds, steps[0], first)
            return
        previous: tuple[float, ...] | None = None
        for step, lrs in zip(steps, lrss):
            if lrs is not previous:
                previous = lrs
                if lrs and (lrs[0] if len(lrs) == 1 else max(lrs)) != s.lr_last:
                    record_lr(s, self.thresholds, step, lrs)

    # ---------------------------------------------------------------- the healthy reference (HealthyReference's)

    def note_losses(self, losses: Iterable[tuple[int, float]]) -> None:
        """Healthy steps' losses read after the fact, in step order (:meth:`HealthyReference.note_losses`): they
        feed :attr:`loss_level` and mark a climb exactly as ``observe_clean(loss=...)`` would. The adapter hands them
        over before it observes any later anomalous step."""
        self.healthy.note_losses(losses)

    # the tracker's fast path and counter, as tests read them on the machine
    def _note_healthy_run(self, batch: list[tuple[int, float]]) -> int:
        return self.healthy.note_healthy_run(batch)

    @property
    def _since_promote(self) -> int:
        """Candidate losses taken since the healthy level was last judged (the tracker's)."""
        return self.healthy.since_promote

    def reference_for(self, onset: int) -> Reference | None:
        """The healthy level from before ``onset``, or None (:meth:`HealthyReference.reference_for`)."""
        return self.healthy.reference_for(onset)

    def reference_evidence(self, onset: int) -> dict[str, Any]:
        """``loss_reference`` before ``onset``, or why there is none (:meth:`HealthyReference.reference_evidence`)."""
        return self.healthy.reference_evidence(onset)

    def level_before(self, recent: Iterable[tuple[int, float]], resumed_at: int) -> LevelAt:
        """The loss level the run had where a rollback takes it back to (:meth:`HealthyReference.level_before`)."""
        return self.healthy.level_before(recent, resumed_at)

    def rebase(self, at: LevelAt) -> None:
        """The run went back to an earlier state: its healthy level is the one it had there
        (:meth:`HealthyReference.rebase`)."""
        self.healthy.rebase(at)

    # has_reference, loss_level and start_loss read the tracker's fields in the state they share, with no call into it
    # (has_reference is read on every snapshot step)

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

    @property
    def start_loss(self) -> float | None:
        """The first finite loss of the fit: the weights it started with, before any update."""
        return self.state.start_loss

    @property
    def max_safe_scale(self) -> float | None:
        """The largest scale at which a step went through: what ``lower_init_scale`` falls back to. Where several
        optimizers step through one scaler, the largest at which every one of them did (None until each one has)."""
        records = self.state.optimizers
        if records:
            scales = [r.safe_scale for r in records.values()]
            return None if None in scales else min(scales)  # type: ignore[type-var]
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
        return plain(self.state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up a checkpointed state. A malformed one (not a dict, an unknown Finding, a wrong type) raises
        ValueError naming the bad entry, and leaves this machine as it was."""
        loaded = decode(MachineState, state, "machine state")
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
        for record in s.optimizers.values():
            record.skips_in_row = 0

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
            self.healthy.take_loss(obs.step, obs.loss)
        streak, from_start = s.streak, s.streak_from_start
        s.streak = None
        s.streak_from_start = False
        if obs.optimizer is not None:
            # several optimizers through one scaler: a start-up streak is each optimizer's own (another's clean step
            # does not end it, nor say at what scale it holds)
            from_start = False
            out.extend(self._optimizer_stepped(obs))
        if streak is not None and (s.episode is None or self._beside_data(s.episode, None)):
            if from_start and streak.count - streak.data >= t.startup_streak and streak.all_loss_finite:
                out.extend(self._raise(self._startup_overflow(streak, obs), obs.step))
            elif s.episode is None and not s.normal_reported and s.isolated_since is None:
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

    # ---------------------------------------------------------------- classification

    def _extend_streak(self, obs: Observation) -> None:
        streak = self.state.streak
        if streak is None:
            streak = self.state.streak = Streak(obs.step, obs.scale)
        streak.count += 1
        streak.scales.append(obs.scale)
        if _data_step(obs):
            streak.data += 1  # (a loss its own NaN batch made non-finite says nothing of the scale)
        elif obs.loss_finite is False:
            streak.all_loss_finite = False

    def _beside_data(self, episode: Episode, obs: Observation | None) -> bool:
        """Under a GradScaler, a data episode (a NaN batch, skipped: the weights stay clean) does not hide a fault
        of its own kind in the steps around it, such as a start-up gradient overflow: an anomaly whose own batch is
        clean (``obs``; None: the end of a streak) is judged as if no episode were open."""
        return episode.finding is Finding.DATA_NONFINITE and self.mode is PrecisionMode.FP16 \
            and (obs is None or not _data_step(obs))

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
            if obs.loss_finite is not True:
                return self._make(Finding.DATA_NONFINITE, obs.step, ev)
            # a finite loss from a batch that holds NaN/inf: they never reached it (an additive -inf attention mask,
            # a column the model does not read), so they are not what went wrong; the evidence keeps where they are

        first = self._first_sign(obs.step)
        climb = s.climb if s.climb is not None and s.climb.steps >= t.climb_steps else None
        # Under several ranks the climb is this rank's own losses, while the alarm is met by every rank together: it
        # neither names the alarm nor adds to its evidence there (ranks whose losses differ would publish different
        # findings for one episode: one "FP32_UNSTABLE" at its climb's start, the other the overflow). It is its own
        # finite divergence, reported as such (divergence_opens_episode False).
        if climb is not None and self.divergence_opens_episode:
            ev.update(self.healthy.climb_evidence(climb, first))
            if climb.start_step < first:  # divergence first: the optimisation, not reduced precision
                lr = lr_event(s, t, climb.start_step, max(obs.lrs, default=None))
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

        lr = lr_event(s, t, onset, max(obs.lrs, default=None))
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
        t, s = self.thresholds, self.state
        streak = s.streak
        assert streak is not None  # the current observation is in it
        ev.update(skipped_in_row=streak.count, skipped_steps=s.skipped_total, steps=s.steps_seen)
        if s.first_scale is not None:
            ev["init_scale"] = s.first_scale
        record = s.optimizers.get(str(obs.optimizer)) if obs.optimizer is not None else None
        safe_scale = s.max_safe_scale
        if record is not None:
            # several optimizers through one scaler: this optimizer's own row of skips, and the largest scale at which
            # it (not another) stepped
            return self._optimizer_pattern(obs, record, ev)
        if obs.scale is not None and obs.scale < t.floor_scale and (s.streak_from_start or streak.count >= 2):
            ev.update(pattern=GradientPattern.UNSCALED_OVERFLOW, scale_history=list(streak.scales),
                      onset=streak.first_step)
            return Finding.GRADIENT_OVERFLOW
        return self._skip_pattern(obs, ev, safe_scale)

    def _skip_pattern(self, obs: Observation, ev: dict[str, Any], safe_scale: float | None) -> Finding | None:
        """The patterns of skips later in the run (start-up, growth, burst, collapse, persistent), ``safe_scale`` the
        largest scale known to hold."""
        t, s = self.thresholds, self.state
        streak = s.streak
        assert streak is not None
        if s.streak_from_start:
            if self.early_startup and streak.count - streak.data >= t.startup_streak and streak.all_loss_finite:
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
            ev.update(pattern=pattern, scale_history=list(streak.scales), safe_scale=safe_scale,
                      onset_scale=streak.first_scale, onset=burst[0])
            return Finding.GRADIENT_OVERFLOW
        window_steps = min(t.window, s.steps_seen)
        if window_steps >= t.window // 2 and len(s.recent_skips) >= max(3, t.window_skip_rate * window_steps):
            ev.update(pattern=GradientPattern.PERSISTENT, skip_rate=round(len(s.recent_skips) / window_steps, 4),
                      window=window_steps, safe_scale=safe_scale, onset=s.recent_skips[0])
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

    # ---------------------------------------------------------------- several optimizers through one scaler

    def _optimizer_skipped(self, obs: Observation) -> None:
        """An optimizer's step was skipped: its own row of skips grows."""
        key = str(obs.optimizer)
        record = self.state.optimizers.get(key)
        if record is None:
            record = self.state.optimizers[key] = OptimizerSteps()
        record.skipped += 1
        if not record.skips_in_row:
            record.first_skip, record.scales, record.all_loss_finite = obs.step, [], True
        record.skips_in_row += 1
        record.scales.append(obs.scale)
        del record.scales[:-SCALE_HISTORY]
        if obs.loss_finite is False and not _data_step(obs):
            record.all_loss_finite = False

    def _optimizer_stepped(self, obs: Observation) -> list[Diagnosis]:
        """An optimizer's step went through: its safe scale, and the end of its row of skips. A row that began with
        its first step and lasted ``startup_streak`` skips is a start-up overflow of this optimizer, the scale it now
        stepped at its measured safe scale (as for one optimizer, judged when the row ends)."""
        t, s = self.thresholds, self.state
        key = str(obs.optimizer)
        record = s.optimizers.get(key)
        if record is None:
            record = s.optimizers[key] = OptimizerSteps()
        out: list[Diagnosis] = []
        if not record.stepped and record.skips_in_row >= t.startup_streak and record.all_loss_finite \
                and (s.episode is None or self._beside_data(s.episode, None)):
            below_floor = obs.scale is not None and obs.scale < t.floor_scale
            ev: dict[str, Any] = {
                "precision": self.mode.value,
                "pattern": GradientPattern.UNSCALED_OVERFLOW if below_floor else GradientPattern.STARTUP,
                "skipped_in_row": record.skips_in_row, "init_scale": s.first_scale, "safe_scale": obs.scale,
                "safe_scale_from": f"the scale optimizer {obs.optimizer} first stepped at without a skip (step "
                                   f"{obs.step})",
                "scale_history": list(record.scales),
                **self._optimizer_ev(obs.optimizer, record),  # type: ignore[arg-type]
            }
            assert record.first_skip is not None
            out.extend(self._raise(self._make(Finding.GRADIENT_OVERFLOW, record.first_skip, ev), obs.step))
        record.stepped += 1
        record.last_step = obs.step
        record.skips_in_row = 0
        if obs.scale is not None and self.mode is PrecisionMode.FP16 and \
                (record.safe_scale is None or obs.scale > record.safe_scale):
            record.safe_scale = obs.scale
        return out

    def _optimizer_pattern(self, obs: Observation, record: OptimizerSteps, ev: dict[str, Any]) -> Finding | None:
        """:meth:`_gradient_pattern` for a skip of one of several optimizers through one scaler: its own row of skips
        and its own safe scale decide, and the evidence names it."""
        t = self.thresholds
        ev.update(self._optimizer_ev(obs.optimizer, record))  # type: ignore[arg-type]
        ev["skipped_in_row"] = record.skips_in_row
        if obs.scale is not None and obs.scale < t.floor_scale and (not record.stepped or record.skips_in_row >= 2):
            ev.update(pattern=GradientPattern.UNSCALED_OVERFLOW, scale_history=list(record.scales),
                      onset=record.first_skip)
            return Finding.GRADIENT_OVERFLOW
        if not record.stepped:
            # every one of its steps skipped so far (while another optimizer's went through): its start-up row, judged
            # when it first steps and its safe scale is known. Not at once, even where a remedy could lower the scale
            # (``early_startup``): no replay measures the scale that holds here (several optimizers step only in
            # manual optimization, whose training_step is not replayed), and the scaler halves its way down to it
            # on this optimizer's skips anyway
            return None
        found = self._skip_pattern(obs, ev, record.safe_scale)
        if found is not None and "scale_history" in ev:
            ev["scale_history"] = list(record.scales)
        return found

    def _optimizer_ev(self, index: int, record: OptimizerSteps) -> dict[str, Any]:
        """``optimizer`` (its index) and a line that says what its steps and the others' did."""
        names = self.optimizer_names

        def name(i: int) -> str:
            return f"optimizer {i}" + (f" ({names[i]})" if 0 <= i < len(names) else "")

        n = record.skips_in_row
        line = f"{name(index)} skipped {'its first ' if not record.stepped else ''}{n} step{'s' if n != 1 else ''}"
        if record.stepped:
            line += " in a row"
        scales = [v for v in record.scales if v is not None]
        if scales:
            top, low = max(scales), min(scales)
            line += f", at {format_pow2(top)}" if top == low else \
                f", at every scale from {format_pow2(top)} down to {format_pow2(low)}"
        since = record.first_skip if record.first_skip is not None else 0
        others = sorted((int(k) for k, r in self.state.optimizers.items()
                         if k != str(index) and r.last_step is not None and r.last_step >= since))
        if others:
            line += ", while " + " and ".join(name(i) for i in others) + " stepped"
        if record.safe_scale is not None:
            line += f"; the largest scale it stepped at is {format_pow2(record.safe_scale)}"
        return {"optimizer": index, "optimizer_skips": line}

    def _scaler_ev(self) -> dict[str, Any]:
        keys = ("growth_interval", "growth_factor", "backoff_factor")
        return {k: self.scaler_config[k] for k in keys if k in self.scaler_config}

    # ---------------------------------------------------------------- helpers

    def _recent_skips_after(self, step: int) -> bool:
        skips = self.state.recent_skips
        return bool(skips) and skips[-1] > step

    def _climb_lasted(self, climb: Climb) -> None:
        """The healthy reference found a climb that lasted (a finite divergence): the machine raises it now (an
        episode, unless it is off under DDP, where it is noted once), among the pending alarms."""
        finding, onset, found = self.healthy.finite_divergence(climb)
        ev: dict[str, Any] = {"precision": self.mode.value, **found}
        s = self.state
        if not self.divergence_opens_episode:
            s.divergence_noted = True
            self._pending.append(self._make(finding, onset, ev))
            return
        out = self._raise(self._make(finding, onset, ev), climb.last_step)
        assert s.episode is not None
        s.episode.finite = True
        self._pending.extend(out)

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
