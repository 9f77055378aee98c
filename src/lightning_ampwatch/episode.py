"""The episode owner: what happens between an alarm and its outcome, in one class (:class:`Episodes`).

An alarm is investigated (the controls, the live probe, the trajectory replays), held for the optimizer-step
boundary when a remedy on its ladder may treat it, decided there (rolled back, applied, watched), judged once the
remedy has run its course (recovered, not recovered: the next rung, or ``on_unrecoverable``) and published, first
and again whenever a later fact changes its record. :class:`Episodes` keeps the journal of what was published
(``diagnoses``) and makes every decision; it never changes the run itself. What changes the run, or reaches a sink,
is a typed action (:class:`Publish`, :class:`Rollback`, :class:`Apply`, :class:`Realign`, :class:`Stop`) handed to
the front (:class:`~lightning_ampwatch.core.RunWatcher`), which applies it and answers with what it did.

The actions are handed over one at a time, where the episode makes them, rather than gathered and returned at the
end of a call: the episode reads what a rollback and a remedy did before it goes on (where the run went back to,
which rung applied), and ``on_unrecoverable="raise"`` must stop the episode where it is, as the user asked.

The rooms (the ledger, the machine, the investigations, the trajectory control, the cross-rank talk) are the front's:
built at ``start`` and rebuilt when a remedy changes the precision. The episode reads them through the front's public
attributes (:class:`Run`) and feeds them what the episode decides.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, Union

from lightning_ampwatch import protocol
from lightning_ampwatch.records import Outcome
from lightning_ampwatch.remedies import REGISTRY, Effect
from lightning_ampwatch.remedies.rollback import ROLLED_BACK, rollback_failed
from lightning_ampwatch.remedies.treatment import Treatment
from lightning_ampwatch.steps import ResolvedStep
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis, Finding, withdrawn_by
from lightning_ampwatch.trajectory.replay import retrain

# ------------------------------------------------------------------------------------------------ the actions


@dataclass(frozen=True)
class Publish:
    """A diagnosis to the sinks (event log, console panel, timeline marker, loggers): a new record, or one a later
    fact updated. ``remedy_at``: the step whose timeline marker names its remedy, when that remedy is new."""

    diagnosis: Diagnosis
    remedy_at: int | None = None


@dataclass(frozen=True)
class Rollback:
    """Go back to before the onset of ``diagnosis`` (a snapshot, a checkpoint, or nowhere when none is usable).
    ``now``: the step the run is at; ``untouched``: the scaler skipped every step since the onset at the fit's
    start (the starting weights are as they were). Answered with the treatment's ``(snapshot, rollback, episode)``."""

    diagnosis: Diagnosis
    now: int
    untouched: bool


@dataclass(frozen=True)
class Apply:
    """Apply the remedy ``choice`` for ``diagnosis`` at ``step`` (the next rung that applies, if it fails).
    Answered with the policy's ``(treated, applied)``."""

    diagnosis: Diagnosis
    choice: Any
    step: int


@dataclass(frozen=True)
class Realign:
    """Bring the watch's own view (the ledger's precision and scaler mirror, the machine, the guards, the
    trajectory control) in line with what a rollback or a remedy changed: each declares its ``effects``."""

    effects: frozenset[Effect]


@dataclass(frozen=True)
class Stop:
    """``on_unrecoverable``: stop the run after ``diagnosis`` (``raise_error``: raise it into the training loop)."""

    diagnosis: Diagnosis
    raise_error: bool


Action = Union[Publish, Rollback, Apply, Realign, Stop]


class Run(Protocol):
    """What the episode reads of the front (:class:`~lightning_ampwatch.core.RunWatcher`): its rooms, as they are
    now, and its one-line voice."""

    config: Any
    host: Any
    ledger: Any
    machine: Any
    investigations: Any
    trajectory: Any
    world_size: int

    @property
    def ranks(self) -> Any: ...

    @property
    def timeline(self) -> Any: ...

    @property
    def log_every(self) -> int: ...

    def say_once(self, message: str, key: str | None = None) -> None: ...

    def internal_failure(self, where: str, err: Exception) -> None: ...


# ------------------------------------------------------------------------------------------------ the owner


class Episodes:
    """Alarm, investigation, decision, remedy, outcome and publication of one run (see the module docstring).

    ``act``: the front's hand, which applies an action and answers with what it did. ``probe_changed``: called after
    an investigation may have armed or finished a live probe (the front's per-step calls follow it)."""

    def __init__(self, run: Run, treatment: Treatment, *, act: Callable[[Action], Any],
                 probe_changed: Callable[[], None]) -> None:
        self.run = run
        self.treatment = treatment
        self.act = act
        self.probe_changed = probe_changed
        self.diagnoses: list[Diagnosis] = []  # the journal: every published diagnosis, updated in place
        self._said_alone = False  # on_unrecoverable could not be carried out by this rank alone: said once

    # ------------------------------------------------------------------ steps -> machine -> diagnoses

    def take(self, resolved: list[ResolvedStep]) -> None:
        """Feed resolved steps to the machine (and the timeline); a new alarm is investigated before it is
        published."""
        run = self.run
        machine, investigations, ledger = run.machine, run.investigations, run.ledger
        assert machine is not None and ledger is not None
        timeline = run.timeline
        treatment = self.treatment
        for step in resolved:
            if step.losses_before:
                machine.note_losses(step.losses_before)
            obs = step.obs
            if timeline is not None:
                timeline.record_step(obs.step, skipped=obs.skipped, scale=obs.scale, loss=obs.loss,
                                     loss_finite=obs.loss_finite, lrs=obs.lrs)
            agreed = self.agreed  # read after the step was resolved: a skip's gather may have ended the agreement
            if not ledger.agree:
                self.note_agreement()
            if investigations is not None:
                investigations.before_observe(step, agreed)
            renamed_alarm: tuple[str, Finding] | None = None  # (as the machine named it, as the controls did)
            for diagnosis in machine.observe(obs):
                if diagnosis.is_alarm and investigations is not None:
                    refined, renamed = investigations.investigate(diagnosis, step, ledger.scaler_active,
                                                                  run.trajectory, agree=agreed)
                    self.probe_changed()  # a live probe may be armed for the next step
                    if renamed is not None:
                        machine.revise(renamed)  # the FP32 control renamed the open episode's finding
                    if refined is None:
                        continue  # published after the next step, with what its live probe saw
                    if refined.finding is not diagnosis.finding:
                        renamed_alarm = (diagnosis.finding.value, refined.finding)
                    diagnosis = refined
                elif diagnosis.withdrawn and renamed_alarm is not None \
                        and diagnosis.measured.withdrawn_by == renamed_alarm[0]:
                    diagnosis = withdrawn_by(diagnosis, renamed_alarm[1])  # the alarm as it was published
                if diagnosis.is_alarm and not treatment.wants(diagnosis):  # (a treated one is seen in _treat)
                    relapsed = treatment.relapse(diagnosis)
                    if relapsed is not None:
                        self.update(relapsed.old, relapsed.new)
                self.emit(diagnosis)
            batch = obs.batch
            if treatment.watch is not None and obs.skipped:
                treatment.note_skip(obs.step)
            if treatment.watch is not None and batch is not None and batch.nonfinite \
                    and obs.loss_finite is False and not (renamed_alarm and renamed_alarm[0] == "DATA_NONFINITE"):
                # its own batch made this step's loss non-finite (unless the controls found otherwise): the data's
                # fault, not a sign that the watched remedy failed
                treatment.note_data_step(obs.step, obs.skipped)

    def take_divergences(self) -> None:
        """Alarms the machine raised from losses read after the fact (a finite divergence): investigated with the
        trajectory replays where a snapshot allows, then published or treated like any other."""
        run = self.run
        machine, investigations, ledger = run.machine, run.investigations, run.ledger
        assert machine is not None and ledger is not None
        for diagnosis in machine.take_pending():  # the alarm, and a NORMAL_SCALING call it withdraws, if any
            if investigations is not None and diagnosis.is_alarm:
                diagnosis = investigations.investigate_divergence(diagnosis, ledger.step_index - 1, run.trajectory)
            self.emit(diagnosis)

    def read_losses(self) -> None:
        """Every held loss read (one copy), and handed to the machine's loss level."""
        ledger, machine = self.run.ledger, self.run.machine
        assert ledger is not None and machine is not None
        ledger.read_losses()
        machine.note_losses(ledger.take_unnoted())

    def emit(self, diagnosis: Diagnosis) -> None:
        """Publish a diagnosis, or hold an alarm that has a remedy on its ladder until the step boundary. A finite
        divergence under DDP is each rank's own (its losses differ from the other ranks'): reported, not treated,
        since a treatment is a decision every rank must take together."""
        run = self.run
        ledger = run.ledger
        if ledger is not None:  # the steps before it taken in (the timeline dates its marker by them), and none held
            ledger.hold()  # back until the next batch end has looked (a recipe guard emits from inside a step)
        if run.world_size > 1 and ledger is not None and not ledger.agree and diagnosis.is_alarm:
            diagnosis = replace(diagnosis, evidence={**diagnosis.evidence, "judged_alone": (
                f"{run.ranks.why_alone}: this rank judged it alone, with no replay that needs every rank and no "
                "remedy")})
        if run.world_size > 1 and diagnosis.measured.finite_divergence:
            self.publish(diagnosis)
        elif self.treatment.folds(diagnosis) or self.treatment.wants(diagnosis):
            # held for the step boundary: a remedy on its ladder, or an AMP alarm during a divergence (part of it)
            self.treatment.due.append(diagnosis)
        else:
            self.publish(diagnosis)

    # ------------------------------------------------------------------ remedies, at an optimizer-step boundary

    def at_step_boundary(self) -> None:
        """A remedy for each waiting alarm (rolled back, applied, then watched), published with it or as
        unrecoverable; then the watched remedy's outcome, once it has run its course. The treatment decides and
        returns records; the changes to the run, the machine and the ledger are made here and by the front."""
        run, treatment = self.run, self.treatment
        machine, ledger = run.machine, run.ledger
        assert machine is not None and ledger is not None
        agreed = self.agreed
        for diagnosis in treatment.take_due():
            if not agreed and not (diagnosis.finding.is_recipe and ledger.agree):
                # Under a scaler every rank skips the same steps and reaches the same alarms; without one the ranks
                # see anomalies at different steps and no single decision can be agreed on (a recipe finding is
                # every rank's at once, until a rank's watch switched itself off). Nor may an alarm this rank judged
                # alone end, or fold into, a remedy every rank watches together (a bf16_fallback's): its judgement
                # starts with a gather, which this rank would then skip while the others wait in it.
                if ledger.agree:
                    run.say_once("Without a GradScaler the ranks do not see anomalies together, so AmpWatch does "
                                 "not remedy them under DDP; it reports them.")
                self.publish(diagnosis)
                continue
            if treatment.folds(diagnosis):
                self._fold(diagnosis)
                continue
            ended = treatment.interrupted(diagnosis)
            if ended is not None:
                self.update(ended.old, ended.new)  # the watched remedy did not hold, or is overtaken by this one
            try:
                treated = self._treat(diagnosis)
            except AmpWatchError:
                raise
            except Exception as err:  # noqa: BLE001 - the alarm is published all the same, saying what failed
                run.internal_failure("a remedy", err)
                treated = replace(diagnosis, evidence={**diagnosis.evidence,
                                                       "treatment_failed": f"{type(err).__name__}: {err}"})
            self.publish(treated)
        if treatment.judgement_due(machine.steps_seen):
            self.read_losses()  # once per remedy: the steps since it are all read
            host = run.host
            if host is not None:  # when no healthy level exists (every rank here: judged together)
                # (a rank switched off since the remedy joins this gather to say so: the rest is each rank's own)
                treatment.fp32_reference(run.trajectory, host.global_step,
                                         gather=run.ranks.gather(ledger) if ledger.agree else lambda v: [v])
                self.note_agreement()
            recovery = self.decide(lambda: treatment.judge(ledger.recent_losses, steps_seen=machine.steps_seen,
                                                           skipped_total=machine.skipped_total))
            if recovery is not None:  # None: judged later (a stall's remedy, still falling)
                self._ended(treatment.end(recovery))
        control = run.trajectory
        if control is not None:
            control.paused = treatment.watching  # no snapshot of a run not yet known to be healthy

    def finish(self) -> None:
        """The fit's end: what is in flight resolved (the steps held, the losses unread, the alarms that waited for a
        live probe), the alarms due decided; a remedy still watched keeps its outcome unknown, never assumed, and the
        record says why."""
        run, treatment = self.run, self.treatment
        if run.ledger is not None:
            self.take(run.ledger.drain(force=True))
            self.read_losses()
            self.take_divergences()
        if run.investigations is not None:
            for diagnosis in run.investigations.finish_probe():  # the run ended before the armed step
                self.emit(diagnosis)
            self.probe_changed()
        if treatment.due or treatment.watch is not None:
            self.at_step_boundary()
        machine = run.machine
        ended = treatment.finish(machine.steps_seen if machine is not None else 0)
        if ended is not None:
            self.update(ended.old, ended.new)

    def _ended(self, ended: Any) -> None:
        """A watched remedy's outcome is known: the record updated, and after one that did not recover, the next
        rung of its ladder (or, with none left, ``on_unrecoverable``)."""
        treatment = self.treatment
        self.update(ended.old, ended.new)
        treatment.ended(ended.new)
        if ended.recovery.outcome is Outcome.NOT_RECOVERED:
            retried = self._treat(treatment.for_retry(ended))
            treatment.retry_done()
            if retried.remedy is None:  # no rung left: the record stays as it was (not recovered)
                self._unrecoverable(ended.new)
            else:
                self.update(ended.new, retried)
                treatment.ended(retried)

    def _fold(self, alarm: Diagnosis) -> None:
        """An alarm that blames reduced precision, raised while the run diverges (a divergence's remedy watched, or
        one that did not recover): the same episode going on, not a new AMP fault with a remedy of its own. The
        divergence's record notes it; a watched remedy did not hold, and the next rung of the LR ladder follows."""
        treatment = self.treatment
        note = {"finding": alarm.finding.value, "step": alarm.step, "location": alarm.location}
        if treatment.watch is not None:
            ended = treatment.end_for(alarm, note)
            self._ended(ended)
            return
        record = treatment.diverging
        if record is None:
            return
        during = [*record.evidence.get("alarms_during_episode", []), note]  # type: ignore[misc]
        new = replace(record, evidence={**record.evidence, "alarms_during_episode": during})
        self.update(record, new)
        treatment.ended(new)

    def _treat(self, diagnosis: Diagnosis) -> Diagnosis:
        """Pick the next allowed rung, go back to before the onset, apply it, and start watching it. The diagnosis
        comes back with the remedy (and its rollback), or unchanged without one; after a rollback that failed,
        without a remedy, its evidence saying what failed."""
        run, treatment = self.run, self.treatment
        machine, ledger, host = run.machine, run.ledger, run.host
        assert machine is not None and ledger is not None and host is not None
        relapsed = treatment.relapse(diagnosis)  # the same fault back after a recovery: taken back, at any step
        if relapsed is not None:
            self.update(relapsed.old, relapsed.new)
        if not ledger.agree:  # a rank's watch switched itself off: no decision can be taken by every rank
            return diagnosis
        choice = self.decide(lambda: treatment.policy.choose(diagnosis))  # agreed, then rank zero's
        if choice is None:
            return diagnosis
        self.read_losses()  # the losses up to now, for the level the run goes back to
        healthy = machine.reference_for(diagnosis.step)  # before a rollback rebases the machine
        now = host.global_step
        # an episode from the fit's first step that the scaler skipped throughout left the starting weights as they
        # were: going back to the starting state would only undo the scaler's backoffs
        control = run.trajectory
        untouched = ledger.scaler_active and control is not None and diagnosis.step <= control.start_step \
            and machine.untouched_since(diagnosis.step, now - 1)
        try:
            snapshot, rollback, episode = self.act(Rollback(diagnosis, now, untouched))
        except AmpWatchError:
            raise
        except Exception as err:  # noqa: BLE001 - published without a remedy, the evidence saying why
            run.internal_failure("a rollback", err)
            return rollback_failed(diagnosis, err)
        then = None  # the level where a rollback took the run back to, if that stretch was healthy
        if rollback.resumed_at is not None:
            self.act(Realign(ROLLED_BACK))
            then = machine.level_before(ledger.recent_losses, rollback.resumed_at)
            machine.rebase(then)
        diagnosis = treatment.with_lr_tried(diagnosis, choice)
        treated, applied = self.act(Apply(diagnosis, choice, now))
        if applied is None:  # every allowed rung failed to apply; a rollback that happened is still said
            return treatment.treated(treated, None, rollback)
        machine.close_episode(now, f"remedy {applied.name}")
        if run.investigations is not None:
            run.investigations.remedy_applied()  # a recurrence after it is replayed again
        self.act(Realign(REGISTRY[applied.name].effects))
        control = run.trajectory  # the precision may have changed: the current state
        if episode and control is not None:
            rollback = rollback.after_retraining(retrain(control.state, episode))
        treated = treatment.treated(treated, applied, rollback)
        treatment.start_watch(treated, applied, snapshot, level=None if healthy is None else healthy.level,
                              then=then, steps_seen=machine.steps_seen, skipped_total=machine.skipped_total)
        return treated

    def decide(self, choose: Callable[[], Any]) -> Any:
        """Rank zero's ``choose()`` on every rank, after the ranks agreed that every one could choose
        (:func:`protocol.decide`; only on steps every rank is in: an alarm under a scaler); this rank's own once the
        ranks stopped agreeing."""
        run = self.run
        agree = run.ledger is None or run.ledger.agree
        return protocol.decide(choose) if run.world_size > 1 and agree else choose()

    # ------------------------------------------------------------------ publication

    def publish(self, diagnosis: Diagnosis) -> None:
        """Every sink gets it (each fails alone); the decision that follows never depends on a sink. A withdrawal
        replaces the record it takes back; the event log gets one more line saying so."""
        ranks = self.run.ranks
        if ranks.defers(diagnosis, self.agreed):
            # judged alone: published on every rank alike once the ranks compared their alarms at the next exchange
            # (the log step's, or the fit end's), as the rank the fault began on found it (distributed.reconcile)
            ranks.relay.defer(diagnosis)
            if diagnosis.remedy is None:
                self._unrecoverable(diagnosis)  # (a request to end the run, carried by the log step's sum)
            return
        if diagnosis.withdrawn:
            self.diagnoses = [d for d in self.diagnoses
                              if not (d.finding is diagnosis.finding and d.step == diagnosis.step)]
        self.diagnoses.append(diagnosis)
        ranks.hold(diagnosis, self.agreed)  # rank zero hears of it at the next agreement point, if it must
        applied = self.treatment.applied
        self.act(Publish(diagnosis, applied[-1].step if diagnosis.remedy is not None and applied else None))
        if diagnosis.is_alarm and diagnosis.remedy is None:
            self._unrecoverable(diagnosis)

    def publish_relayed(self, diagnosis: Diagnosis) -> None:
        """Rank zero publishes a diagnosis another rank reached alone (its evidence names the rank). The decision
        it led to was that rank's; rank zero only reports it. One rank zero reached itself (an agreed alarm
        published after a remedy took the scaler away) is not repeated."""
        if any(d.finding is diagnosis.finding and d.step == diagnosis.step for d in self.diagnoses):
            return
        self.diagnoses.append(diagnosis)
        self.act(Publish(diagnosis))

    def publish_exchanged(self, relayed: list[Diagnosis]) -> list[Diagnosis]:
        """After an exchange across ranks (a log step's, the fit end's): what other ranks reached alone, published by
        rank zero (``relayed``), then the alarms the ranks judged alone, as they agreed on them, on every rank alike.
        Returns both, the agreed ones first."""
        for diagnosis in relayed:
            self.publish_relayed(diagnosis)
        return self.publish_reconciled() + relayed

    def publish_reconciled(self) -> list[Diagnosis]:
        """Every rank, after an exchange: the alarms the ranks judged alone, as they agreed on them
        (:func:`distributed.reconcile`), published alike on every rank. Returns them."""
        agreed = self.run.ranks.relay.take_reconciled()
        for diagnosis in agreed:
            self.publish_relayed(diagnosis)
        return agreed

    def update(self, old: Diagnosis, new: Diagnosis) -> None:
        """A later fact changed a diagnosis (a remedy's outcome, the next rung): ``diagnoses`` holds the updated
        record, and the sinks get it once more."""
        at = next((i for i, d in enumerate(self.diagnoses) if d is old), None)
        if at is None:
            self.diagnoses.append(new)
        else:
            self.diagnoses[at] = new
        fresh = new.remedy is not None and new.remedy != old.remedy
        self.act(Publish(new, self.treatment.applied[-1].step if fresh else None))

    # ------------------------------------------------------------------ across ranks

    @property
    def agreed(self) -> bool:
        """Whether the ranks meet anomalies together (one process; or a scaler, every rank skipping the same steps,
        and every rank's watch still on), so that a collective on an anomalous step is entered by every rank."""
        run = self.run
        ledger = run.ledger
        return run.world_size == 1 or (ledger is not None and ledger.scaler_active and ledger.agree)

    def note_agreement(self) -> None:
        """The ranks stopped agreeing (another rank's watch switched itself off): said once, and the snapshots stop
        where a replay from them needs every rank (split across DDP ranks, or sharded), since none can be agreed on
        any more."""
        run = self.run
        if run.ledger is not None and not run.ledger.agree:
            run.ranks.note_agreement_ended(run.ledger, run.trajectory, run.say_once)

    def _unrecoverable(self, diagnosis: Diagnosis) -> None:
        run = self.run
        mode = run.config.on_unrecoverable
        if mode in ("stop", "raise") and not self._judged_by_every_rank(diagnosis):
            # The other ranks did not meet this alarm: a rank that stopped (or raised) alone would leave them waiting
            # in their next collective. The request goes with the log step's cross-rank sum, and every rank ends the
            # run at that log step (the front's log step); with no log step, no point is shared where it could.
            if run.log_every:
                run.ranks.ask_to_end(diagnosis)
            elif not self._said_alone:
                self._said_alone = True
                warnings.warn(f"AmpWatch: on_unrecoverable={mode!r} cannot be carried out by one rank alone: this rank "
                              f"judged {diagnosis.finding.value} at step {diagnosis.step} without the others (they do "
                              "not meet anomalies together), and with no log step (log_every_n_steps=0) there is no "
                              "point where every rank learns of it. Stopping this rank alone would leave the others "
                              "waiting for it; training goes on.", RuntimeWarning, stacklevel=3)
            return
        if mode in ("stop", "raise"):
            self.act(Stop(diagnosis, raise_error=mode == "raise"))

    def _judged_by_every_rank(self, diagnosis: Diagnosis) -> bool:
        """Whether every rank reached this alarm at the same step (one process; or the ranks agree, and it is no
        rank's own finite divergence), so that each can act on it at once."""
        return self.run.world_size == 1 or (
            self.agreed and not diagnosis.measured.finite_divergence)
