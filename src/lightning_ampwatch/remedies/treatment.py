"""Treating an alarm: roll the run back to before the onset (:mod:`lightning_ampwatch.remedies.rollback`), apply a
remedy, then watch whether it recovered.

"Fixed" is earned here. A remedy is watched for ``recovery_steps`` optimizer steps; only a run that the scaler no
longer skips (one probe aside) and whose loss is back near its level before the episode counts as recovered. A
remedy that does not recover gives way to the next rung of its ladder, and with no rung left, to
``on_unrecoverable``. A remedy applied to weights that had already diverged silences the NaNs without fixing
anything, so before it is applied the run goes back to before the onset; where that rollback went is kept for the
next rung of the same episode.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from lightning_ampwatch import distributed, protocol, sharding
from lightning_ampwatch.records import (
    Outcome,
    Recovery,
    Rollback,
    RollbackKind,
    Unverified,
    facts_of,
    with_facts,
)
from lightning_ampwatch.remedies.base import AppliedRemedy, RemedyName
from lightning_ampwatch.measured import Tried
from lightning_ampwatch.remedies.policy import RemedyPolicy, ladder_for
from lightning_ampwatch.remedies.reference import cured_replay_track
from lightning_ampwatch.remedies.reference import recovery_reference as _reference
from lightning_ampwatch.remedies.rollback import roll_back as go_back
from lightning_ampwatch.taxonomy import Diagnosis, Finding
from lightning_ampwatch.trajectory.replay import replay_trajectory
from lightning_ampwatch.machine import DIVERGENCE_FINDINGS, LevelAt, Thresholds
from lightning_ampwatch.verdicts import (AMP_BLAMING, fp32_reference, judge_decisive_fall, judge_recovery,
                                        judge_tracking)


#: Findings whose fault is a stall (training cannot progress, nothing goes non-finite): with no reference to track,
#: their remedy is recovered when the loss falls decisively, watched up to ``STALL_WATCHES`` more ``recovery_steps``.
STALL_FINDINGS = frozenset({Finding.CLIP_BEFORE_UNSCALE})
STALL_WATCHES = 3
#: Findings and remedies about the loss scale itself: skips after them count against the remedy, even at the start.
SCALE_FINDINGS = frozenset({Finding.GRADIENT_OVERFLOW, Finding.GROWTH_OVERFLOW})
SCALE_REMEDIES = frozenset({RemedyName.LOWER_INIT_SCALE.value, RemedyName.SLOW_GROWTH.value})
#: Clean steps after a start-up search's skips, at least, before they are taken as the scaler's own search.
SEARCH_CLEAN_AFTER = 3


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"


@dataclass
class Watch:
    """A remedy under watch: the record it was published with and what it is measured against."""

    diagnosis: Diagnosis
    start: int  # the first optimizer step run with the remedy (the global step when it was applied)
    steps_before: int  # the machine's step count then
    skipped_before: int  # and its skip count
    reference: float | None  # the loss the run should come back to
    reference_from: str
    snapshot: Any = None  # the snapshot the run went back to, kept for the next rung's rollback
    data_steps: dict[int, bool] = field(default_factory=dict)  # steps whose own batch made the loss non-finite
    #: with no reference level: a reference trajectory (step -> loss) the run must track, and what it is
    track: dict[int, float] | None = None
    track_from: str = ""
    track_same: bool = True  # the track ran the run's own batches (FP32 from the same state), not the window's
    extended: int = 0  # times the judgement was put off by ``recovery_steps`` (a stall's fix, still falling)
    skip_steps: list[int] = field(default_factory=list)  # the steps since it that the scaler skipped


@dataclass
class Ended:
    """A watched remedy's watch is over: the record it was published with, the record with its outcome, and the
    recovery that decided it."""

    old: Diagnosis
    new: Diagnosis
    recovery: Recovery


@dataclass
class Treatment:
    """The remedies of one run: the ladder policy, what was applied, the alarms waiting for a step boundary and the
    remedy being watched. It decides and returns records; the core changes the run and its other rooms."""

    policy: RemedyPolicy
    recovery_steps: int
    rollback: bool = True
    replay_episode: bool = False  # after a rollback, train on the episode's batches again instead of skipping them
    applied: list[AppliedRemedy] = field(default_factory=list)
    watch: Watch | None = None
    due: list[Diagnosis] = field(default_factory=list)  # alarms waiting for the next optimizer-step boundary
    _retry: tuple[int, Any] | None = None  # (onset, snapshot) of a remedy that did not recover: where to go back
    lr_tried: list[float] | None = None  # the learning rates the latest reduce_lr set: a next rung compounds on them
    diverging: Diagnosis | None = None  # the published record of a divergence not (yet) recovered from
    recovered: dict[str, Diagnosis] = field(default_factory=dict)  # finding -> its latest record that recovered
    fall_margin: float = Thresholds.fall_margin  # the user's Thresholds: a decisive fall
    track_tolerance: float = Thresholds.track_tolerance  # how closely a run must track its reference trajectory
    unjudged: dict[str, Any] | None = None  # the watch the run's end cut short: a checkpoint written after it resumes it

    @classmethod
    def for_run(cls, config: Any) -> "Treatment":
        """The treatment of one run, as the watch's configuration asks (``remedies``, ``rollback``,
        ``replay_episode``, and the thresholds' recovery window, decisive fall and tracking tolerance)."""
        thresholds = config.thresholds
        return cls(RemedyPolicy(config.remedies), recovery_steps=thresholds.recovery_steps, rollback=config.rollback,
                   replay_episode=config.replay_episode, fall_margin=thresholds.fall_margin,
                   track_tolerance=thresholds.track_tolerance)

    def across_ranks(self, world_size: int) -> str | None:
        """Under several ranks ``replay_episode`` is off: a rerun of the episode outside the loop would not all-reduce
        its gradients, and the ranks' weights would drift apart. Returns the line that says so, where it was asked
        for (the episode's batches are skipped after a rollback instead)."""
        if not (self.replay_episode and world_size > 1):
            return None
        self.replay_episode = False
        return ("replay_episode is off under DDP (a rerun of the episode would not all-reduce its gradients); the "
                "episode's batches are skipped after a rollback.")

    def folds(self, diagnosis: Diagnosis) -> bool:
        """An alarm that blames reduced precision while the run diverges (a divergence's remedy is watched, or one
        did not recover): part of that episode, not a new fault with a remedy of its own."""
        if diagnosis.finding not in AMP_BLAMING:
            return False
        watched = self.watch.diagnosis if self.watch is not None else self.diverging
        return watched is not None and watched.finding in DIVERGENCE_FINDINGS

    def ended(self, record: Diagnosis) -> None:
        """The latest published version of a treated record: a divergence stays open until it recovered."""
        if record.outcome == Outcome.RECOVERED.value:
            self.lr_tried = None  # it held: a later episode starts its LR ladder afresh
            self.recovered[record.finding.value] = record  # until the same fault comes back, if it does
        if record.finding in DIVERGENCE_FINDINGS:
            self.diverging = None if record.outcome == Outcome.RECOVERED.value else record

    def relapse(self, alarm: Diagnosis) -> Ended | None:
        """A new alarm of a finding whose remedy recovered earlier in the run, at any later step: that record is
        re-opened as ``relapsed`` (its recovery taken back, the earlier judgement kept under ``recovered_first``)."""
        old = self.recovered.get(alarm.finding.value)
        if old is None or not alarm.is_alarm or alarm.step <= old.step:
            return None
        del self.recovered[alarm.finding.value]
        before = old.evidence.get("recovery") if isinstance(old.evidence.get("recovery"), dict) else {}
        where = f" in {alarm.location}" if alarm.location else ""
        reason = f"it had recovered, but the same fault came back at step {alarm.step}{where}: the recovery is taken back"
        details = {k: v for k, v in before.items() if k != "reason"}
        recovery = Recovery(Outcome.RELAPSED, reason, {**details, "relapsed_at": alarm.step})
        new = with_facts(replace(old, outcome=Outcome.RELAPSED.value, evidence={
            **old.evidence, "recovery": {**details, "relapsed_at": alarm.step, "reason": reason,
                                         "recovered_first": before.get("reason")}}), recovery=recovery)
        return Ended(old, new, recovery)

    def end_for(self, alarm: Diagnosis, note: dict[str, Any]) -> Ended:
        """The watched divergence's remedy did not hold: an alarm of its own came up during it (``note``)."""
        watch = self.watch
        assert watch is not None
        original = watch.diagnosis
        ended = self.end(Recovery(Outcome.NOT_RECOVERED, (
            f"the run still diverges: a {alarm.finding.value} alarm came up at step {alarm.step}, during the "
            "episode"), {"came_back_at": alarm.step, "came_back_as": alarm.finding.value}))
        during = [*original.evidence.get("alarms_during_episode", []), note]  # type: ignore[misc]
        return Ended(original, replace(ended.new, evidence={**ended.new.evidence, "alarms_during_episode": during}),
                     ended.recovery)

    def wants(self, diagnosis: Diagnosis) -> bool:
        """Whether this alarm has an allowed remedy on its ladder (then it waits for the step boundary)."""
        return diagnosis.is_alarm and any(r in self.policy.allowed for r in ladder_for(diagnosis))

    @property
    def watching(self) -> bool:
        return self.watch is not None

    def take_due(self) -> list[Diagnosis]:
        due, self.due = self.due, []
        return due

    # ------------------------------------------------------------------ rolling back

    def roll_back(self, diagnosis: Diagnosis, *, now: int, **how: Any) -> tuple[Any, Rollback, list[Any]]:
        """Go back to before the onset, from step ``now`` (:func:`~lightning_ampwatch.remedies.rollback.roll_back`,
        ``how``: the control, the host, how the ranks agree), unless rollbacks are off; the next rung of a remedy
        that did not recover goes back where it went. Returns the snapshot (kept for a later rung), the record and
        the episode's batches."""
        retry, self._retry = self._retry, None  # (a rollback that raises leaves none: published without a remedy)
        if not self.rollback:
            return None, Rollback(RollbackKind.OFF, now), []
        return go_back(diagnosis, now=now, retry=retry, replay_episode=self.replay_episode, **how)

    # ------------------------------------------------------------------ applying and watching

    def treated(self, diagnosis: Diagnosis, applied: AppliedRemedy | None, rollback: Rollback) -> Diagnosis:
        """The diagnosis as published with its remedy (or without one: every allowed rung failed to apply), its
        rollback said in the evidence."""
        if applied is None:
            if rollback.resumed_at is None:
                return diagnosis
            return with_facts(replace(diagnosis, evidence={**diagnosis.evidence, "rollback": rollback.sentence()}),
                              rollback=rollback)
        evidence = dict(diagnosis.evidence)
        evidence["rollback"] = rollback.sentence()
        if applied.name is RemedyName.LOWER_INIT_SCALE:
            evidence.update(_skips_saved(applied.details))
        return with_facts(replace(diagnosis, evidence=evidence, outcome=None), rollback=rollback, remedy=applied)

    def start_watch(self, treated: Diagnosis, applied: AppliedRemedy, snapshot: Any, *, level: float | None,
                    then: LevelAt | None, steps_seen: int, skipped_total: int) -> None:
        """The remedy is in effect from step ``applied.step``: watch it for ``recovery_steps`` steps. ``level``: the
        healthy level from before the episode (None: there was none); ``then``: the level where a rollback took the
        run back to (:meth:`~lightning_ampwatch.machine.AmpStateMachine.level_before`; None without a rollback)."""
        self.applied.append(applied)
        if applied.name is RemedyName.REDUCE_LR and isinstance(applied.details.get("lr_after"), list):
            self.lr_tried = list(applied.details["lr_after"])
        reference, reference_from = _reference(treated, level, then, self.fall_margin, self.recovery_steps)
        track = cured_replay_track(treated) if reference is None else None
        self.watch = Watch(treated, start=applied.step, steps_before=steps_seen, skipped_before=skipped_total,
                           reference=reference, reference_from=reference_from, snapshot=snapshot,
                           track=None if track is None else track[0], track_from="" if track is None else track[1],
                           track_same=False)
        self.ended(treated)

    def fp32_reference(self, control: Any, now: int, gather: Callable[[Any], list[Any]] = lambda v: [v]) -> None:
        """A watched remedy with no healthy level to come back to (its episode began before any healthy stretch):
        replay FP32 training from the state the remedy started from (the newest snapshot before it; the fit's start
        where the scaler skipped every step up to the remedy) over the same steps the remedied run took. Where that
        replay stays finite, the run is held to it step by step (``judge_tracking``, same batches); otherwise there
        is still no reference, the outcome stays unverified, and its reason says why. ``gather``: every rank's value
        (several ranks judge a remedy together, under a scaler): a replay runs only where every rank can run the
        same one, since restoring a split snapshot and a sharded forward talk to every rank."""
        watch = self.watch
        if watch is None:  # (a remedy is watched on every rank alike; its reference, from each rank's losses, not)
            return
        snapshot = control.ring.newest_before(watch.start) \
            if watch.reference is None and control is not None and control.ring.enabled else None
        rollback = facts_of(watch.diagnosis).rollback
        origin = None if snapshot is None else f"the snapshot after step {snapshot.step}"
        if snapshot is not None and rollback is not None and rollback.untouched and snapshot.step < watch.start - 1:
            # every step from the fit's start to the remedy was skipped: the state the remedy began from is the
            # snapshot's, so FP32 starts from it on the remedy's first step, not on steps the run never trained on
            snapshot = replace(snapshot, step=watch.start - 1)
            origin = f"the fit's start: the scaler skipped every step before step {watch.start}"
        steps = control.ring.batches(snapshot.step + 1, now - 1) if snapshot is not None else []
        ready = snapshot is not None and len(steps) >= 3 and len(steps) == now - 1 - snapshot.step
        held = gather(snapshot.step if ready else None)  # type: ignore[union-attr]
        if not ready or len(set(held)) > 1:
            return
        together = len(held) > 1
        # (every rank, after one meeting before the restore, where a rank that cannot replay says so; a sharded
        # model's replay meets again before each micro-batch's forward, distributed.Lockstep)
        sharded = together and sharding.replay_needs_all_ranks(control.state.root)
        try:
            with (distributed.Lockstep(control.state.root) if sharded else contextlib.nullcontext()) as lock:
                fp32 = protocol.together(together, lambda ready: replay_trajectory(
                    control.state, snapshot, steps, precision="fp32", ready=ready,
                    before_micro_batch=lock.next if lock else None))
        except Exception:  # noqa: BLE001 - no reference, the outcome stays unverified
            return
        # the run is held to that replay step by step, on the very batches it trained on (its loss on each step
        # against FP32's on the same step: never a window's median against where FP32's fall ended)
        track = {s: v for s, v in zip(fp32.steps, fp32.losses) if v is not None} \
            if fp32.params_finite and all(math.isfinite(v) for v in fp32.losses if v is not None) else None
        if not track:
            losses = fp32.losses if fp32.params_finite else [*fp32.losses, math.nan]  # weights gone non-finite
            found = fp32_reference(losses, level=None, margin=self.fall_margin)
            replayed = f"FP32 training from {origin} over the steps the remedied run took ({snapshot.step + 1}-{now - 1})"
            self.watch = replace(watch, reference_from=(
                f"nothing: there was no healthy loss level before the episode, and {replayed} {found.why}"))
            return
        self.watch = replace(watch, track=track, track_same=True, track_from=(
            f"FP32 training from the same state ({origin}) on the same steps"))

    def with_lr_tried(self, diagnosis: Diagnosis, choice: Any) -> Diagnosis:
        """Before a ``reduce_lr`` rung that follows an earlier one: the learning rates that one set, in the evidence
        (``lr_tried``), so that the rung compounds on them rather than on what a rollback restored."""
        if self.lr_tried is None or choice is None or choice[1] is not RemedyName.REDUCE_LR:
            return diagnosis
        return replace(diagnosis, evidence={**diagnosis.evidence, "lr_tried": list(self.lr_tried)})

    def steps_left(self, steps_seen: int) -> int | None:
        """Optimizer steps until the watched remedy is judged (by ``recovery_steps``), None when none is watched."""
        watch = self.watch
        return None if watch is None else self.recovery_steps - (steps_seen - watch.steps_before)

    def judgement_due(self, steps_seen: int) -> bool:
        watch = self.watch
        return watch is not None and steps_seen - watch.steps_before >= self.recovery_steps * (1 + watch.extended)

    def watch_state(self) -> dict[str, Any] | None:
        """The remedy being watched, as plain data for a checkpoint (None when none is): a run resumed from a
        checkpoint written during the watch judges it when its steps are run. The snapshot the run went back to is
        not kept (a next rung after a resume goes back as a first one does)."""
        watch = self.watch
        if watch is None:  # (after the fit: the watch its end cut short, judged by a fit resumed from here)
            return None if self.unjudged is None else {**self.unjudged, "run_ended": True}
        return {"diagnosis": watch.diagnosis.to_dict(), "start": watch.start, "steps_before": watch.steps_before,
                "skipped_before": watch.skipped_before, "reference": watch.reference,
                "reference_from": watch.reference_from, "data_steps": sorted(watch.data_steps.items()),
                "lr_tried": self.lr_tried, "track": None if watch.track is None else sorted(watch.track.items()),
                "track_from": watch.track_from, "track_same": watch.track_same, "extended": watch.extended}

    def load_watch(self, state: Any, diagnoses: Sequence[Diagnosis]) -> None:
        """Take up a watch :meth:`watch_state` wrote; its record is the one among ``diagnoses`` it was published as."""
        if not state:
            return
        written = Diagnosis.from_dict(state["diagnosis"])
        ended = "not_verified" if state.get("run_ended") else None  # published so when the earlier fit ended
        at, held = next(((i, d) for i, d in enumerate(diagnoses) if d.finding is written.finding and
                         d.step == written.step and d.remedy == written.remedy and d.outcome in (None, ended)),
                        (None, written))
        if at is not None and held.outcome is not None and isinstance(diagnoses, list):
            # watched again: the record is as it was published while watched, until this fit judges it
            held = diagnoses[at] = replace(held, outcome=None, evidence={
                k: v for k, v in held.evidence.items() if k != "recovery"})
        reference = state.get("reference")
        self.watch = Watch(held, start=int(state["start"]), steps_before=int(state["steps_before"]),
                           skipped_before=int(state["skipped_before"]),
                           reference=None if reference is None else float(reference),
                           reference_from=str(state.get("reference_from", "")),
                           data_steps={int(s): bool(k) for s, k in state.get("data_steps", ())},
                           track=None if state.get("track") is None else
                           {int(s): float(v) for s, v in state["track"]},
                           track_from=str(state.get("track_from", "")), track_same=bool(state.get("track_same", True)),
                           extended=int(state.get("extended", 0)))
        tried = state.get("lr_tried")
        self.lr_tried = [float(v) for v in tried] if isinstance(tried, list) else self.lr_tried

    def recovered_state(self) -> list[list[Any]]:
        """The records whose remedy recovered, as (finding, step) pairs for a checkpoint: a relapse after a resume
        re-opens them as it would have without the resume."""
        return [[finding, record.step] for finding, record in self.recovered.items()]

    def load_recovered(self, state: Any, diagnoses: Sequence[Diagnosis]) -> None:
        """Take up :meth:`recovered_state`: each pair's record among ``diagnoses`` (the checkpoint's own)."""
        for finding, step in state or ():
            record = next((d for d in diagnoses if d.finding.value == finding and d.step == int(step)
                           and d.outcome == Outcome.RECOVERED.value), None)
            if record is not None:
                self.recovered[str(finding)] = record

    def note_data_step(self, step: int, skipped: bool) -> None:
        """A step of the watch whose own batch made its loss non-finite (NaN/inf in the data): left out of the
        remedy's judgement, loss and skip alike, since no precision setting could have kept it finite."""
        watch = self.watch
        if watch is not None and step >= watch.start:
            watch.data_steps[step] = skipped

    def note_skip(self, step: int) -> None:
        """A step the scaler skipped while a remedy is watched (for :meth:`startup_search`)."""
        watch = self.watch
        if watch is not None and step >= watch.start:
            watch.skip_steps.append(step)

    def startup_search(self, steps: int) -> list[int]:
        """The skips of the watched remedy's first steps that are GradScaler's own search for its first scale, left
        out of a remedy that does not act on the loss scale: the scaler had not stepped once since the fit's start
        (every step before the remedy was skipped), its skips since run in a row from the remedy's first step, and
        every step after them, at least :data:`SEARCH_CLEAN_AFTER`, stepped. A fault that the remedy left in place
        keeps skipping; this is the scaler halving its scale down to one that fits, as it does in any run."""
        watch = self.watch
        assert watch is not None
        remedy = watch.diagnosis.remedy
        if watch.diagnosis.finding in SCALE_FINDINGS or remedy in SCALE_REMEDIES or not watch.skip_steps \
                or watch.skipped_before != watch.steps_before:
            return []
        run = sorted(watch.skip_steps)
        if run != list(range(watch.start, watch.start + len(run))) or steps - len(run) < SEARCH_CLEAN_AFTER:
            return []
        return run

    def judge(self, recent: Any, *, steps_seen: int, skipped_total: int) -> Recovery | None:
        """The watched remedy's recovery, from the losses read since it (``recent``: (step, loss) pairs), less the
        steps whose batch held the NaN/inf (:meth:`note_data_step`). With no reference level, the run is judged by
        how it tracks its reference trajectory (FP32 from the same state, or its cured replay), within
        ``track_tolerance``. None: not yet (a stall's fix with neither, still clean, is watched
        ``recovery_steps`` longer, up to :data:`STALL_WATCHES` times, for a decisive fall)."""
        watch = self.watch
        assert watch is not None
        data = watch.data_steps
        pairs = [(step, loss) for step, loss in recent if step >= watch.start and step not in data]
        losses = [loss for _, loss in pairs]
        steps = steps_seen - watch.steps_before
        skipped = skipped_total - watch.skipped_before - sum(data.values())
        search = self.startup_search(steps)
        skipped -= len(search)
        if watch.reference is None and watch.track:
            recovery = judge_tracking(pairs, watch.track, steps=steps, skipped=skipped, track_from=watch.track_from,
                                      tolerance=self.track_tolerance, same_batches=watch.track_same)
        else:
            recovery = judge_recovery(losses, steps=steps, skipped=skipped,
                                      reference=watch.reference, reference_from=watch.reference_from)
        if recovery.outcome is Outcome.NOT_VERIFIED and watch.reference is None and not watch.track \
                and watch.diagnosis.finding in STALL_FINDINGS:
            fell = judge_decisive_fall(losses, steps=steps, skipped=skipped, margin=self.fall_margin, why=(
                "the fault was that training could not progress, and with the remedy it does"))
            if fell is not None:
                recovery = fell
            elif watch.extended < STALL_WATCHES and skipped <= 1 and all(math.isfinite(x) for x in losses):
                watch.extended += 1
                return None
        if search:
            recovery = replace(recovery, details={**recovery.details, "startup_search_steps": search},
                               reason=f"{recovery.reason} (the scaler's skips at {_steps(search)} left out: it had "
                                      "not stepped once since the fit's start and was halving its first scale down to "
                                      "one that fits, as GradScaler does in any run; the remedy does not act on the "
                                      "loss scale)")
        if not data:
            return recovery
        steps = sorted(data)
        named = f"step{'s' if len(steps) > 1 else ''} {', '.join(str(s) for s in steps)}"
        return replace(recovery, details={**recovery.details, "data_steps_left_out": steps},
                       reason=f"{recovery.reason} ({named} left out: the batch itself held NaN/inf, a data fault no "
                              "remedy of precision could prevent)")

    def interrupted(self, diagnosis: Diagnosis) -> Ended | None:
        """A new alarm, about to be treated, while a remedy is watched. Of the same finding: the remedy did not
        hold (the policy escalates the new alarm). Of another: the watch ends unverified, since the next remedy
        (and its rollback) changes what it would measure."""
        if self.watch is None:
            return None
        if diagnosis.finding is self.watch.diagnosis.finding:
            return self.end(Recovery(Outcome.NOT_RECOVERED, f"the fault came back at step {diagnosis.step}",
                                     {"came_back_at": diagnosis.step}))
        return self.end(Recovery(Outcome.NOT_VERIFIED, f"a {diagnosis.finding.value} alarm at step {diagnosis.step} "
                                 "was treated before this remedy could be judged", {"interrupted_at": diagnosis.step},
                                 Unverified.INTERRUPTED))

    def end(self, recovery: Recovery) -> Ended:
        """The watch is over with ``recovery``: the record it was published with, and the record with the outcome."""
        watch, self.watch = self.watch, None
        assert watch is not None
        old = watch.diagnosis
        new = with_facts(replace(old, outcome=recovery.outcome.published,
                                 evidence={**old.evidence, "recovery": {**recovery.details,
                                                                        "reason": recovery.reason}}),
                         recovery=recovery)
        if recovery.outcome is Outcome.NOT_RECOVERED:
            self._retry = (old.step, watch.snapshot)  # the next rung goes back to the same place
        return Ended(old, new, recovery)

    def for_retry(self, ended: Ended) -> Diagnosis:
        """A remedy that did not recover: the same episode, to be treated again from its onset with the next rung
        (the remedies tried so far in its evidence)."""
        d = ended.new
        tried = [t.entry() for t in (*(d.measured.remedies_tried or ()), Tried(d.remedy, d.outcome,
                                                                                   ended.recovery.reason))]
        evidence = {k: v for k, v in d.evidence.items() if k not in ("recovery", "remedy_details", "rollback")}
        return replace(d, remedy=None, outcome=None, evidence={**evidence, "remedies_tried": tried},
                       facts=replace(facts_of(d), rollback=None, remedy=None, recovery=None))

    def retry_done(self) -> None:
        self._retry = None

    def finish(self, steps_seen: int) -> Ended | None:
        """The run ended while a remedy was watched, before its ``recovery_steps`` were run: its outcome stays unknown
        (None), never assumed, and its evidence says why (``Unverified.RUN_ENDED``)."""
        watch = self.watch
        if watch is None:
            return None
        ran = steps_seen - watch.steps_before
        self.unjudged = self.watch_state()
        return self.end(Recovery(Outcome.NOT_VERIFIED, (
            f"the run ended {ran} optimizer step{'s' if ran != 1 else ''} after the remedy, before the "
            f"{self.recovery_steps} its recovery is judged over"), {"steps": ran, "recovery_steps": self.recovery_steps},
            Unverified.RUN_ENDED))

    def forget_states(self) -> None:
        """After the run: drop the snapshots kept for a next rung (they hold copies of the whole model)."""
        self._retry = None
        if self.watch is not None:
            self.watch = replace(self.watch, snapshot=None)


def _skips_saved(details: dict[str, Any]) -> dict[str, Any]:
    """How many more skips the scaler would have made to halve its way down to the scale now set (about: the
    scale that holds lies between the set scale and twice it)."""
    before, after = details.get("scale_before"), details.get("scale_after")
    if not (isinstance(before, (int, float)) and isinstance(after, (int, float)) and 0 < after < before):
        return {}
    return {"skips_saved_estimate": max(0, round(math.log2(before / after)) - 1)}
