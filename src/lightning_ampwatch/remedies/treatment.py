"""Treating an alarm: roll the run back to before the onset, apply a remedy, then watch whether it recovered.

"Fixed" is earned here. A remedy is watched for ``recovery_steps`` optimizer steps; only a run that the scaler no
longer skips (one probe aside) and whose loss is back near its level before the episode counts as recovered. A
remedy that does not recover gives way to the next rung of its ladder, and with no rung left, to
``on_unrecoverable``. A remedy applied to weights that had already diverged silences the NaNs without fixing
anything, so before it is applied the run goes back to the newest snapshot from before the onset (or the newest
checkpoint file from before it), and the episode's batches are skipped.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from lightning_ampwatch.remedies.base import REGISTRY, AppliedRemedy, Effect, RemedyContext
from lightning_ampwatch.remedies.policy import RemedyPolicy, ladder_for
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch import sharding
from lightning_ampwatch.trajectory import Snapshot, TrainState, retrain
from lightning_ampwatch.verdicts import NOT_RECOVERED, judge_recovery


#: What a rollback changes under AmpWatch's feet: the scaler's state and the optimizers' (their learning rates).
ROLLED_BACK = frozenset({Effect.SCALER, Effect.OPTIMIZERS})


@dataclass
class Site:
    """What a treatment acts on and reads, and how it reports back, handed over by the callback at an
    optimizer-step boundary."""

    trainer: Any
    ctx: RemedyContext
    machine: Any  # the AmpStateMachine: the loss level, the step and skip counts, episodes
    ledger: Any  # the StepLedger: the losses read since a step; its ``trajectory`` (snapshots), or None
    on_effects: Callable[[frozenset[Effect]], None]  # bring AmpWatch's own view in line
    decide: Callable[[Any], Any]  # rank zero's value, on every rank (identity in one process)
    agreed: bool  # the ranks meet alarms together (one process, or a scaler): a decision can be shared
    publish: Callable[[Diagnosis], None]  # a new record to every sink (an alarm without a remedy: unrecoverable)
    update: Callable[[Diagnosis, Diagnosis], None]  # a record that changed (old, new)
    unrecoverable: Callable[[Diagnosis], None]  # on_unrecoverable for a record already published
    say: Callable[[str], None]  # one line, once

    @property
    def trajectory(self) -> Any:
        """The TrajectoryControl now in use (a remedy that swaps the precision makes a new one), or None."""
        return self.ledger.trajectory


@dataclass
class Watch:
    """A remedy under watch: the record it was published with and what it is measured against."""

    diagnosis: Diagnosis
    start: int  # the first optimizer step run with the remedy (trainer.global_step when it was applied)
    steps_before: int  # the machine's step count then
    skipped_before: int  # and its skip count
    reference: float | None  # the loss the run should come back to
    reference_from: str
    snapshot: Any = None  # the snapshot the run went back to, kept for the next rung's rollback


@dataclass
class Treatment:
    """The remedies of one fit: the ladder policy, what was applied, and the remedy being watched."""

    policy: RemedyPolicy
    recovery_steps: int
    rollback: bool = True
    replay_episode: bool = False  # after a rollback, train on the episode's batches again instead of skipping them
    applied: list[AppliedRemedy] = field(default_factory=list)
    watch: Watch | None = None
    due: list[Diagnosis] = field(default_factory=list)  # alarms waiting for the next optimizer-step boundary
    _retry: tuple[int, Any] | None = None  # (onset, snapshot) of a remedy that did not recover: where to go back

    def wants(self, diagnosis: Diagnosis) -> bool:
        """Whether this alarm has an allowed remedy on its ladder (then it waits for the step boundary)."""
        return diagnosis.is_alarm and any(r in self.policy.allowed for r in ladder_for(diagnosis))

    @property
    def watching(self) -> bool:
        return self.watch is not None

    # ------------------------------------------------------------------ at a step boundary

    def at_step_boundary(self, site: Site) -> None:
        """A remedy for each waiting alarm (rolled back, applied, then watched), published with it or as
        unrecoverable; then the watched remedy's outcome, once it has run its course."""
        due, self.due = self.due, []
        for diagnosis in due:
            ended = self.interrupted(diagnosis)
            if ended is not None:
                site.update(*ended)  # the watched remedy did not hold, or is overtaken by this one
            if not site.agreed and not diagnosis.finding.is_recipe:
                # Under a scaler every rank skips the same steps and reaches the same alarms; without one the ranks
                # see anomalies at different steps and no single decision can be agreed on.
                site.say("Without a GradScaler the ranks do not see anomalies together, so AmpWatch does not "
                         "remedy them under DDP; it reports them.")
                site.publish(diagnosis)
                continue
            site.publish(self.treat(diagnosis, site))
        ended = self.check(site)
        if ended is not None:
            old, judged = ended
            site.update(old, judged)
            if judged.outcome == NOT_RECOVERED:
                retried = self.retry(judged, site)
                if retried is judged:
                    site.unrecoverable(judged)
                else:
                    site.update(judged, retried)
        if site.trajectory is not None:
            site.trajectory.paused = self.watching  # no snapshot of a run not yet known to be healthy

    # ------------------------------------------------------------------ applying

    def treat(self, diagnosis: Diagnosis, site: Site) -> Diagnosis:
        """Pick the next allowed rung, go back to before the onset, apply it, and start watching it. The diagnosis
        comes back with the remedy (and ``remedies_failed``, ``rollback`` evidence), or unchanged without one."""
        choice = site.decide(self.policy.choose(diagnosis))  # decided once, on rank zero
        if choice is None:
            return diagnosis
        site.ledger.read_losses()  # the losses up to now, for the level the run goes back to
        snapshot, where, resumed_at, episode = self._roll_back(diagnosis, site) if self.rollback else \
            (None, "off: applied in place", None, [])
        step = site.trainer.global_step
        treated, applied = self.policy.apply(site.ctx, diagnosis, choice, step=step)
        if applied is None:  # every allowed rung failed to apply; a rollback that happened is still said
            return replace(treated, evidence={**treated.evidence, "rollback": where}) if resumed_at is not None \
                else treated
        evidence = dict(treated.evidence)
        evidence["rollback"] = where
        if applied.name == "lower_init_scale":
            evidence.update(_skips_saved(applied.details))
        treated = replace(treated, evidence=evidence, outcome=None)
        site.machine.close_episode(step, f"remedy {applied.name}")
        site.on_effects(REGISTRY[applied.name].effects)  # type: ignore[index]
        if episode and site.ledger.trajectory is not None:  # the precision may have changed: the current state
            losses = retrain(site.ledger.trajectory.state, episode)
            shown = ", ".join("-" if v is None else f"{v:.4g}" for v in losses)
            evidence["rollback"] = where.replace("are skipped", f"were trained on again with the remedy (losses "
                                                                 f"{shown})")
            treated = replace(treated, evidence=evidence)
        self.applied.append(applied)
        reference, reference_from = _reference(treated, site.machine.loss_level, resumed_at,
                                               site.ledger.recent_losses, site.machine.thresholds.loss_window)
        self.watch = Watch(treated, start=step, steps_before=site.machine.steps_seen,
                           skipped_before=site.machine.skipped_total, reference=reference,
                           reference_from=reference_from, snapshot=snapshot)
        return treated

    def _roll_back(self, diagnosis: Diagnosis, site: Site) -> tuple[Any, str, int | None, list[Any]]:
        """Go back to the newest state from before the onset: a held snapshot, else a checkpoint file from before
        it. Returns the snapshot (kept for a later rung), the sentence the evidence carries, the step the run went
        back to (None when it stayed where it was), and, with ``replay_episode``, the episode's held batches."""
        now = site.trainer.global_step
        control = site.trajectory
        before = _last_good_step(diagnosis)
        retry, self._retry = self._retry, None
        snapshot = retry[1] if retry is not None and retry[0] == diagnosis.step else None
        if snapshot is None and control is not None and control.ring.enabled:
            snapshot = control.ring.newest_before(before)
        target = site.decide(None if snapshot is None else snapshot.step)  # every rank goes back to the same step
        if target is not None and snapshot is not None and snapshot.step == target:
            episode = control.ring.batches(target + 1, now - 1) if self.replay_episode else []
            if len(episode) != (now - 1 - target):
                episode = []  # not every batch is held (a retry after the ring was reset): skipped instead
            snapshot.restore(control.state)
            control.ring.reset()  # what it held after the snapshot belongs to the abandoned steps
            site.on_effects(ROLLED_BACK)
            return snapshot, (f"rolled back from step {now} to step {target + 1} (the in-memory snapshot taken "
                              f"after step {target}); the batches of steps {target + 1}..{now - 1} are skipped"), \
                target + 1, episode
        path, ckpt_step = rollback_to_checkpoint(site.trainer, before)
        if path is not None:
            site.on_effects(ROLLED_BACK)
            return None, (f"rolled back from step {now} to step {ckpt_step} (the checkpoint file {path}); the "
                          f"batches of steps {ckpt_step}..{now - 1} are skipped"), ckpt_step, []
        if before < 0:
            return None, (f"none: the episode began at step {diagnosis.step}, before any state could be kept, so the "
                          "remedy is applied in place"), None, []
        why = "snapshots are off" if control is None or not control.ring.enabled else \
            f"no snapshot from before step {before} is held"
        return None, f"none: {why} and no checkpoint file from before it was found, so the remedy is applied in " \
                     "place", None, []

    # ------------------------------------------------------------------ watching

    def check(self, site: Site) -> tuple[Diagnosis, Diagnosis] | None:
        """At a step boundary: when the watched remedy has run ``recovery_steps`` steps, its outcome, as
        (the published record, the record with the outcome)."""
        watch = self.watch
        if watch is None or site.machine.steps_seen - watch.steps_before < self.recovery_steps:
            return None
        site.ledger.read_losses()  # once per remedy: the steps since it are all read
        losses = [loss for step, loss in site.ledger.recent_losses if step >= watch.start]
        steps = site.machine.steps_seen - watch.steps_before
        recovery = site.decide(judge_recovery(losses, steps=steps, skipped=site.machine.skipped_total
                                              - watch.skipped_before, reference=watch.reference,
                                              reference_from=watch.reference_from))
        return self._end(recovery.outcome, recovery.reason, recovery.details)

    def interrupted(self, diagnosis: Diagnosis) -> tuple[Diagnosis, Diagnosis] | None:
        """A new alarm, about to be treated, while a remedy is watched. Of the same finding: the remedy did not
        hold (the policy escalates the new alarm). Of another: the watch ends unverified, since the next remedy
        (and its rollback) changes what it would measure."""
        watch = self.watch
        if watch is None:
            return None
        if diagnosis.finding is watch.diagnosis.finding:
            return self._end(NOT_RECOVERED, f"the fault came back at step {diagnosis.step}",
                             {"came_back_at": diagnosis.step})
        return self._end(None, f"a {diagnosis.finding.value} alarm at step {diagnosis.step} was treated before "
                               "this remedy could be judged", {"interrupted_at": diagnosis.step})

    def finish(self) -> None:
        """The fit ended while a remedy was watched: its outcome stays unknown (None), never assumed."""
        self.watch = None

    def forget_states(self) -> None:
        """After the fit: drop the snapshots kept for a next rung (they hold copies of the whole model)."""
        self._retry = None
        if self.watch is not None:
            self.watch = replace(self.watch, snapshot=None)

    def _end(self, outcome: str | None, reason: str, details: dict[str, Any]) -> tuple[Diagnosis, Diagnosis]:
        watch, self.watch = self.watch, None
        assert watch is not None
        old = watch.diagnosis
        new = replace(old, outcome=outcome, evidence={**old.evidence, "recovery": {**details, "reason": reason}})
        if outcome == NOT_RECOVERED:
            self._retry = (old.step, watch.snapshot)  # the next rung goes back to the same place
        return old, new

    def retry(self, diagnosis: Diagnosis, site: Site) -> Diagnosis:
        """The next rung for a remedy that did not recover: the same episode treated again, from its onset. With
        no rung left the record comes back as it was (not recovered)."""
        recovery = diagnosis.evidence.get("recovery")
        tried = [*diagnosis.evidence.get("remedies_tried", []),  # type: ignore[misc]
                 {"remedy": diagnosis.remedy, "outcome": diagnosis.outcome,
                  "reason": recovery.get("reason") if isinstance(recovery, dict) else None}]
        evidence = {k: v for k, v in diagnosis.evidence.items() if k not in ("recovery", "remedy_details", "rollback")}
        treated = self.treat(replace(diagnosis, remedy=None, outcome=None,
                                     evidence={**evidence, "remedies_tried": tried}), site)
        self._retry = None
        return treated if treated.remedy is not None else diagnosis

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state.get("policy", {}))


def _last_good_step(diagnosis: Diagnosis) -> int:
    """The step before which the run is surely healthy: the loss at the onset was computed with the weights the
    previous step's update left, so that update may be the one that did the damage; and an LR rise that set the
    episode off happened at ``lr_change_step``, earlier still."""
    step = diagnosis.step - 1
    lr_change = diagnosis.evidence.get("lr_change_step")
    return min(step, lr_change) if isinstance(lr_change, int) else step


def _reference(diagnosis: Diagnosis, level: float | None, resumed_at: int | None,
               recent: Any, window: int) -> tuple[float | None, str]:
    """What the loss must come back to. After a rollback, the loss the run had at the state it went back to (the
    steps up to it): it cannot be asked to be better than that. Where the FP32 replay confirmed an AMP fault,
    what FP32 reached on the episode's own steps, if higher (harder batches raise the loss without anything being
    broken). Else the loss level before the episode; with no level yet (a fault at the first steps), the FP32
    control's loss on the faulty batch, when it cleared the batch as an AMP fault."""
    ev = diagnosis.evidence
    if resumed_at is not None:
        then = [loss for step, loss in recent if resumed_at - window <= step <= resumed_at and math.isfinite(loss)]
        if then:
            level = max(statistics.median(then), level or 0.0)
            return level, f"the loss level where the run went back to (step {resumed_at})"
    fp32 = ev.get("trajectory_fp32_losses")
    if ev.get("trajectory_verdict") == "amp_confirmed" and isinstance(fp32, list):
        finite = [v for v in fp32 if isinstance(v, (int, float)) and math.isfinite(v)]
        if finite:
            return max(statistics.median(finite), level or 0.0), "what FP32 reached replaying the episode's steps"
    if level is not None:
        return level, "the loss level before the episode"
    control = ev.get("fp32_control_loss")
    if isinstance(control, (int, float)) and math.isfinite(control) and \
            str(ev.get("control_verdict", "")).endswith("an AMP fault"):
        return control, "the FP32 control's loss on the faulty batch"
    return None, "nothing: no loss was read before the episode"


def _skips_saved(details: dict[str, Any]) -> dict[str, Any]:
    """How many more skips the scaler would have made to halve its way down to the scale now set (about: the
    scale that holds lies between the set scale and twice it)."""
    before, after = details.get("scale_before"), details.get("scale_after")
    if not (isinstance(before, (int, float)) and isinstance(after, (int, float)) and 0 < after < before):
        return {}
    return {"skips_saved_estimate": max(0, round(math.log2(before / after)) - 1)}


def rollback_to_checkpoint(trainer: Any, before: int) -> tuple[str | None, int | None]:
    """Load the newest checkpoint (a file, or a sharded checkpoint's directory) that a ``ModelCheckpoint`` wrote
    before step ``before`` ran, through Lightning's own checkpoint connector: weights, precision plugin (the
    scaler), optimizers and schedulers; not the loops, so ``global_step`` stays monotonic. Returns (path, the step it was written at), or (None, None)."""
    candidates: set[str] = set()
    for cb in getattr(trainer, "checkpoint_callbacks", []):
        candidates.update(p for p in (getattr(cb, "last_model_path", ""), *getattr(cb, "best_k_models", {})) if p)
        dirpath = getattr(cb, "dirpath", None)
        if dirpath and os.path.isdir(dirpath):
            candidates.update(os.path.join(dirpath, f) for f in os.listdir(dirpath) if f.endswith(".ckpt"))
    connector = trainer._checkpoint_connector
    # h-shard: a sharded strategy (FSDP, ModelParallelStrategy) loads a checkpoint, a sharded directory included,
    # into the live model inside load_checkpoint, before its step can be checked: the live state is kept on the
    # host meanwhile and put back when the checkpoint turns out to be too new. FSDP1 cannot be put back in place.
    state = TrainState.from_trainer(trainer, trainer.lightning_module)
    sharded = sharding.replay_needs_all_ranks(state.root)
    if sharded and sharding.unsupported_reason(state.root) is not None:
        return None, None
    for path in sorted((p for p in candidates if os.path.exists(p)), key=os.path.getmtime, reverse=True):
        live = Snapshot.take(state, -1) if sharded else None
        checkpoint = trainer.strategy.load_checkpoint(path)
        step = checkpoint.get("global_step")
        if not isinstance(step, int) or step > before:  # written after `step` steps: before step `step` ran
            if live is not None:
                live.restore(state)
            continue
        connector._loaded_checkpoint = checkpoint
        try:
            connector.restore_model()
            connector.restore_precision_plugin_state()
            connector.restore_optimizers_and_schedulers()
        finally:
            connector._loaded_checkpoint = {}
        return path, step
    return None, None
