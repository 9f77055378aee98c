"""The taxonomy state machine: one observation per optimizer step in, diagnoses out.

Pure Python (no torch, no Lightning) so that every rule can be tested with synthetic sequences.
It decides *what* is wrong; how the numbers were measured and what to do about them live elsewhere. It keeps the
transitions and reads what its parts return:

- the loss level it compares with (the healthy reference, the climb, the level after a rollback) is tracked by the
  :class:`~lightning_ampwatch.machine.reference.HealthyReference` it owns, which reports a climb that lasts and leaves
  its finding and the alarm to the machine;
- the gradient-overflow patterns are read from the skip history by ``overflow.py``'s functions;
- each optimizer's own skips and safe scale, where several step through one scaler, are kept by
  :class:`~lightning_ampwatch.machine.optimizers.OptimizerRows`;
- the episode an alarm opens, its end, and the ``NORMAL_SCALING`` call are kept by
  :class:`~lightning_ampwatch.machine.episode_tracker.EpisodeTracker`;
- what every step adds to its counts and histories is counted by ``tally.py``'s functions;
- what it carries from step to step, and its checkpoint, is ``state.py``'s.

The last module of the package: it imports the others, none of them imports it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from lightning_ampwatch.machine.episode_tracker import EpisodeTracker
from lightning_ampwatch.machine.lr_history import lr_event, record_lr
from lightning_ampwatch.machine.optimizers import OptimizerRows
from lightning_ampwatch.machine.overflow import (
    Overflow, extend_streak, first_sign, skip_counts, skip_pattern, startup_overflow, unscaled_overflow,
)
from lightning_ampwatch.machine.reference import HealthyReference, LevelAt
from lightning_ampwatch.machine.state import Climb, Episode, Reference, fresh_state, load_state, plain
from lightning_ampwatch.machine.tally import count_clean_run, count_step
from lightning_ampwatch.machine.vocabulary import FP16_MAX, Observation, PrecisionMode, Thresholds
from lightning_ampwatch.taxonomy import Diagnosis, Finding, advise

__all__ = ["AmpStateMachine"]


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
        self.state = fresh_state(self.thresholds)
        self._pending: list[Diagnosis] = []  # alarms raised while losses read after the fact were taken in
        self.healthy = HealthyReference(self, self._climb_lasted)
        """The healthy-reference tracker: the loss level, the climb, the level after a rollback."""
        self.rows = OptimizerRows(self)
        """Each optimizer's own skips and safe scale, where several step through one scaler."""
        self.episode_tracker = EpisodeTracker(self)
        """The open episode, its end, and the ``NORMAL_SCALING`` call."""
        self.optimizer_names: tuple[str, ...] = ()
        """Each optimizer in a few words ("Adam over disc.*"), by index, where several step through one scaler."""
        self.divergence_opens_episode = True
        """A finite divergence opens an episode (later alarms are part of it). Off under DDP, where each rank finds
        it in its own losses while the ranks must keep meeting the agreed alarms (skips) together: it is then
        reported once, until its loss is back, and opens nothing."""

    # ---------------------------------------------------------------- public API

    def observe(self, obs: Observation) -> list[Diagnosis]:
        t, s = self.thresholds, self.state
        # a finite divergence found in losses taken in since the last observation comes out first (one raised by
        # this observation's own loss comes out at the next, or through take_pending: the fast path's timing)
        out: list[Diagnosis] = self.take_pending() if self._pending else []
        count_step(s, t, self.mode, obs)
        if obs.optimizer is not None and obs.skipped:
            self.rows.skipped(obs, obs.optimizer)

        if obs.anomalous:
            if self.quiet:  # the first sign of whatever comes: the healthy level stands as it was before it
                self.healthy.promote()
                s.reference_before_skip = s.reference
            extend_streak(s, t, obs)
            if self.episode_tracker.judged_apart(obs):
                diagnosis = self._classify(obs)
                if diagnosis is not None:
                    out.extend(self._raise(diagnosis, obs.step))
            elif s.episode is not None:
                s.episode.clean_run = 0
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
        in step order; every step taken while :attr:`quiet`, with no loss read): the same state as one call per step
        (:func:`.tally.count_clean_run`)."""
        count_clean_run(self.state, self.thresholds, self.mode, steps, scales, grews, lrss)

    # ---------------------------------------------------------------- the healthy reference (HealthyReference's)

    def note_losses(self, losses: Iterable[tuple[int, float]]) -> None:
        """Healthy steps' losses read after the fact, in step order (:meth:`HealthyReference.note_losses`): they
        feed :attr:`loss_level` and mark a climb exactly as ``observe_clean(loss=...)`` would. The adapter hands them
        over before it observes any later anomalous step."""
        self.healthy.note_losses(losses)

    # the healthy reference's fast path and counter, as tests read them on the machine
    def _note_healthy_run(self, batch: list[tuple[int, float]]) -> int:
        return self.healthy.note_healthy_run(batch)

    @property
    def _since_promote(self) -> int:
        """Candidate losses taken since the healthy level was last judged (the healthy reference's)."""
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

    # has_reference, loss_level and start_loss read the healthy reference's fields in the state they share, with no
    # call into it (has_reference is read on every snapshot step)

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
        return self.rows.safe_scale if self.state.optimizers else self.state.max_safe_scale

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
        self.state = load_state(state, self.thresholds)

    def close_episode(self, step: int, reason: str) -> None:
        """A remedy was applied: the episode is over, so a recurrence is a new episode (and escalates)."""
        self.episode_tracker.close(step, reason)
        self.rows.end_rows()

    def reconfigure(self, mode: PrecisionMode | str | None = None,
                    scaler_config: Mapping[str, Any] | None = None) -> None:
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
            row = self.rows.stepped(obs, obs.optimizer)
            if row is not None and self.episode_tracker.judged_apart(None):
                out.extend(self._raise(self._found(row), obs.step))
        if streak is not None and from_start and streak.all_loss_finite and not streak.data:
            s.startup_until = streak.first_step + streak.count - 1
        if streak is not None and self.episode_tracker.judged_apart(None):
            if from_start and streak.count - streak.data >= t.startup_streak and streak.all_loss_finite:
                out.extend(self._raise(self._found(startup_overflow(streak, obs.scale, t)), obs.step))
            elif s.episode is None and not s.normal_reported and s.isolated_since is None:
                s.isolated_since = streak.first_step
        call = self.episode_tracker.normal_call(obs.step, obs.scale)
        if call is not None:
            out.append(self._make(Finding.NORMAL_SCALING, call.step, call.evidence))
        ep = s.episode
        if ep is not None and ep is episode_before:  # an alarm this very loss raised counts from the next step
            self.episode_tracker.clean_step(ep, obs.step)
        return out

    # ---------------------------------------------------------------- classification

    def first_sign(self, step: int) -> int:
        """Where trouble at ``step`` first showed, as far as the machine knows now: the start of the anomalous
        streak, or earlier, the first skip of the cluster of skips that led up to it (:func:`.overflow.first_sign`)."""
        return first_sign(self.state, self.thresholds, step)

    def untouched_since(self, step: int, now: int) -> bool:
        """Every step from ``step`` to ``now`` (both included) was anomalous, in one streak: under a GradScaler they
        were all skipped, so the weights and the optimizer are as they were before ``step``."""
        streak = self.state.streak
        return streak is not None and streak.first_step <= step and streak.first_step + streak.count - 1 == now

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

        first = first_sign(s, t, obs.step)
        climb = s.climb if s.climb is not None and s.climb.steps >= t.climb_steps else None
        # Under several ranks the climb is this rank's own losses, while the alarm is met by every rank together: it
        # neither names the alarm nor adds to its evidence there (ranks whose losses differ would publish different
        # findings for one episode: one "FP32_UNSTABLE" at its climb's start, the other the overflow). It is its own
        # finite divergence, reported as such (divergence_opens_episode False).
        if climb is not None and self.divergence_opens_episode:
            ev.update(self.healthy.climb_evidence(climb, first))
            if climb.start_step < first:  # divergence first: the optimisation, not reduced precision
                return self._divergence(climb.start_step, ev, max(obs.lrs, default=None))

        if obs.loss_finite is False:
            onset = first
            if onset != obs.step:
                ev["first_nonfinite_step"] = obs.step
        else:
            found = self._overflow(obs)
            if found is None:
                return None
            candidate, onset = found.finding, found.onset
            ev.update(found.entries)

        now_lr = max(obs.lrs, default=None)
        if obs.loss_finite is False and self.mode is PrecisionMode.FP32:  # no reduced precision to blame
            return self._divergence(onset, ev, now_lr)
        # batch values beyond float16's comfortable range are the cause: of a forward overflow in float16 arithmetic,
        # of a gradient overflow under a scaler
        out_of_range = batch is not None and batch.absmax > t.input_limit
        if obs.loss_finite is False:
            in_float16 = self.mode in (PrecisionMode.FP16, PrecisionMode.HALF)
            finding = Finding.INPUT_RANGE if out_of_range and in_float16 else Finding.FORWARD_OVERFLOW
        else:
            scaled = self.mode is PrecisionMode.FP16 and candidate is Finding.GRADIENT_OVERFLOW
            finding = Finding.INPUT_RANGE if out_of_range and scaled else candidate
        lr = lr_event(s, t, onset, now_lr)
        if lr is not None:
            ev.update(lr)
            if not (finding is Finding.INPUT_RANGE and obs.loss_finite is False and batch is not None
                    and batch.absmax > FP16_MAX):
                return self._make(Finding.LR_SCHEDULE, onset, ev)  # (a batch float16 cannot hold goes before it)
        if finding is Finding.INPUT_RANGE:
            assert batch is not None
            ev.update(input_absmax=batch.absmax, input_where=batch.absmax_where)
        return self._make(finding, onset, ev)

    def _overflow(self, obs: Observation) -> Overflow | None:
        """Skips with a finite loss: which overflow pattern, if any, they already form. Where several optimizers step
        through one scaler, this optimizer's own row of skips and the largest scale at which it (not another) stepped
        decide (:meth:`OptimizerRows.pattern`)."""
        t, s = self.thresholds, self.state
        if obs.optimizer is not None and str(obs.optimizer) in s.optimizers:
            return self.rows.pattern(obs, obs.optimizer)
        streak = s.streak
        assert streak is not None  # the current observation is in it
        scales = list(streak.scales)
        found = unscaled_overflow(obs.scale, t, s.streak_from_start or streak.count >= 2, streak.first_step, scales)
        if found is None:
            found = skip_pattern(s, t, obs.step, obs.scale, s.max_safe_scale, scales, early_startup=self.early_startup,
                                 scaler_config=self.scaler_config)
        return None if found is None else \
            Overflow(found.finding, found.onset, {**skip_counts(s, streak.count), **found.entries})

    # ---------------------------------------------------------------- the alarms

    def _climb_lasted(self, climb: Climb) -> None:
        """The healthy reference found a climb that lasted (a finite divergence): the machine names it (the LR
        schedule's where an LR event came just before its onset, otherwise the optimisation's) and raises it now (an
        episode, unless it is off under DDP, where it is noted once), among the pending alarms."""
        s = self.state
        onset, found = self.healthy.finite_divergence(climb)
        alarm = self._divergence(onset, {"precision": self.mode.value, **found}, s.lr_last)
        if not self.divergence_opens_episode:
            s.divergence_noted = True
            self._pending.append(alarm)
            return
        out = self._raise(alarm, climb.last_step)
        assert s.episode is not None
        s.episode.finite = True
        self._pending.extend(out)

    def _divergence(self, onset: int, ev: dict[str, Any], now_lr: float | None) -> Diagnosis:
        """A divergence of the loss (no reduced precision to blame): the LR schedule's where an LR event came just
        before its onset (``now_lr``: the latest LR), otherwise the optimisation's."""
        lr = lr_event(self.state, self.thresholds, onset, now_lr)
        if lr is None:
            return self._make(Finding.FP32_UNSTABLE, onset, ev)
        ev.update(lr)
        return self._make(Finding.LR_SCHEDULE, onset, ev)

    def _raise(self, alarm: Diagnosis, step: int) -> list[Diagnosis]:
        """Open the alarm's episode; withdraw a ``NORMAL_SCALING`` call whose skip turns out to have begun it."""
        call = self.episode_tracker.open(alarm.finding, alarm.step)
        if call is None:
            return [alarm]
        return [alarm, self._make(Finding.NORMAL_SCALING, call.step, {
            **call.evidence, "withdrawn": True, "withdrawn_by": alarm.finding.value, "withdrawn_at": step,
            "alarm_onset": alarm.step,
        })]

    def _found(self, found: Overflow) -> Diagnosis:
        """The diagnosis of an overflow a part found, the run's precision first in its evidence."""
        return self._make(found.finding, found.onset, {"precision": self.mode.value, **found.entries})

    def _make(self, finding: Finding, step: int, evidence: dict[str, Any]) -> Diagnosis:
        kind = self.scaler_config.get("loss_scaler")
        if kind is not None and finding in (Finding.GRADIENT_OVERFLOW, Finding.GROWTH_OVERFLOW):
            evidence.setdefault("loss_scaler", kind)  # not a GradScaler (DeepSpeed's): the advice says its settings
        return Diagnosis(finding=finding, step=int(step), evidence=evidence, advice=advise(finding, evidence))
