"""The FP32 trajectory control's judgement of one alarm (:class:`TrajectoryJudge`): the steps since the newest
snapshot before the onset run again in FP32, at the run's own precision and with each intervention (then the live
state is put back exactly), across ranks where every rank replays together. Its verdict is the one that stands.

The snapshots it replays from are taken by :class:`~lightning_ampwatch.trajectory.control.TrajectoryControl`, which
owns this judge (``control.judgement``); the investigations call it with the alarm. What the interventions decide is
a function of its own (:func:`_by_interventions`)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Collection, Sequence

import torch

from lightning_ampwatch import compat, distributed, protocol, sharding
from lightning_ampwatch.interventions import Intervention, InterventionReport, Interventions, decide
from lightning_ampwatch.machine import Thresholds
from lightning_ampwatch.measured import LrRise
from lightning_ampwatch.records import ControlVerdict, facts_of
from lightning_ampwatch.remedies.precision import bf16_supported
from lightning_ampwatch.replays import (
    APART,
    BACKWARD,
    InvestigationError,
    replay_went_nonfinite,
    supersede_amp_evidence,
)
from lightning_ampwatch.signals import inspect_batch
from lightning_ampwatch.taxonomy import Diagnosis, Finding, GradientPattern, advise, format_pow2
from lightning_ampwatch.trajectory.replay import replay_trajectory
from lightning_ampwatch.trajectory.ring import SnapshotRing
from lightning_ampwatch.trajectory.state import TrainState
from lightning_ampwatch.verdicts import (
    AMP_BLAMING,
    LOWER_LR_FACTOR,
    LowerLrKind,
    LowerLrVerdict,
    TrajectoryKind,
    TrajectoryResult,
    TrajectoryVerdict,
    fp32_reference,
    judge_lower_lr,
    judge_trajectory,
    trains_down,
)


#: Which verdict stands when the ranks disagree: a rank whose FP32 run fails clears AMP for all; one that
#: reproduces the fault confirms it over ranks that did not.
_VERDICT_ORDER = (TrajectoryKind.FP32_NONFINITE, TrajectoryKind.FP32_DIVERGES, TrajectoryKind.AMP_CONFIRMED,
                  TrajectoryKind.NOT_REPRODUCED)
_RENAMED_BY = {TrajectoryKind.FP32_NONFINITE: Finding.FP32_UNSTABLE, TrajectoryKind.FP32_DIVERGES: Finding.FP32_UNSTABLE,
               TrajectoryKind.NOT_REPRODUCED: Finding.NOT_REPRODUCED}


class TrajectoryJudge:
    """Judges an alarm that blames reduced precision by replaying the steps since the newest snapshot before its
    onset from ``ring`` (see the module docstring). ``state``: what a replay drives; ``thresholds``: the replay-step
    cap, how far past the onset to replay, the margins of a decisive fall and of the lower-LR verdict."""

    def __init__(self, ring: SnapshotRing, state: TrainState, divergence_ratio: float, thresholds: Thresholds) -> None:
        self.ring = ring
        self.state = state
        self.divergence_ratio = divergence_ratio
        self.replay_steps = thresholds.replay_steps  # the interventions' replay-step cap per alarm
        self.replay_past = thresholds.replay_past
        self.fall_margin = thresholds.fall_margin  # a decisive fall of an FP32 replay with no level
        self.lr_cause_margin = thresholds.lr_cause_margin  # what the lower-LR verdict needs
        self.bf16 = bf16_supported(state.device) and state.scaler is not None  # bf16 is tried where fp16 failed

    def window(self, snapshot_step: int, onset: int, alarm_step: int) -> tuple[list[tuple[int, Any]], int | None]:
        """The steps the interventions replay: from the snapshot through the alarm's step, and at least
        ``replay_past`` steps past the onset (past the alarm, the window's own batches again, in order); a window
        longer than a third of the replay-step cap ends there (or ``replay_past`` past the onset, if later).
        Returns the steps and the first repeated one (None: none)."""
        held = self.ring.batches(snapshot_step + 1, alarm_step)
        past = max(onset, snapshot_step + 1) + self.replay_past
        # through the alarm's step at least (what the run itself saw), but never so long that the cap leaves room
        # for fewer than three replays of it
        end = max(past, min(alarm_step, snapshot_step + max(1, self.replay_steps // 3)))
        # the cap leaves room for the two replays every verdict needs (nothing changed, FP32) at least
        end = min(end, snapshot_step + max(1, self.replay_steps // 2))
        steps = [(s, b) for s, b in held if s <= end]
        repeated = None
        source = list(steps)
        k = 0
        while source and steps[-1][0] < end:
            nxt = steps[-1][0] + 1
            repeated = nxt if repeated is None else repeated
            steps.append((nxt, source[k % len(source)][1]))
            k += 1
        return steps, repeated

    def _no_snapshot(self, before: int, onset: int) -> str:
        """Why this rank holds no snapshot from before step ``before``."""
        return self.ring.reason or self.ring.dropped or (
            f"no snapshot from before step {before} (the update before the onset at step {onset}) is held; one is "
            f"taken every {self.ring.every} steps")

    def judge(self, diagnosis: Diagnosis, alarm_step: int, loss_level: float | None, agree: bool, *,
              rename: bool = True, fault_ranks: Sequence[int] = (),
              skipped: Collection[int] = ()) -> tuple[Diagnosis, Finding | None]:
        """The diagnosis with the trajectory's verdict (and the finding it renames, if it does). ``loss_level`` is
        the healthy level from before the onset, or None when there was none (the FP32 run is then judged by its
        own shape). Three replays from the newest snapshot from before the step whose update may have done the
        damage: FP32, the run's own precision, and the run's own precision with the learning rate lowered (the
        counterfactual: does a lower LR train clean?). ``rename=False``: evidence only (a finite divergence,
        already named by its loss). Where every rank replayed (``agree``), the gravest verdict stands; among
        equally grave ones, a rank at fault's (its batches are the ones that went wrong), and the evidence names
        the rank. ``skipped``: the steps the scaler skipped (the machine's latest), which let a snapshot taken after
        the onset stand in where none from before it is held (:func:`after_onset`)."""
        ev = dict(diagnosis.evidence)
        unavailable = self.state.replay_unavailable or self.state.fp32_unavailable
        if unavailable is not None:  # the same on every rank: none of them gathers below
            ev["trajectory_control"] = f"not run: {unavailable}"
            return replace(diagnosis, evidence=ev), None
        before = max(diagnosis.step - 1, 0)
        snapshot = self.ring.newest_before(before) if self.ring.enabled else None
        held_since: str | None = None  # what a snapshot from after the onset stands for (a fit resumed mid-episode)
        if snapshot is None and self.ring.enabled and skipped:
            found = after_onset(self.ring.snapshots, diagnosis.step, alarm_step, frozenset(skipped))
            if found is not None:  # (said only where every rank replays from it: see below)
                snapshot, held_since = found
        stale = snapshot.stale(self.state) if snapshot is not None else None
        if snapshot is not None and stale is None and [len(g) for g in snapshot.groups] != [
                len(o.param_groups) for o in self.state.optimizers]:
            # a param group was added since (a backbone unfrozen): a replay from it would train the new group from
            # the snapshot's step on, which the run did not; no verdict on the run can be drawn from it
            ev["trajectory_control"] = (f"not run: the optimizers gained a param group after the snapshot of step "
                                        f"{snapshot.step}, so a replay from it would train that group from there on, "
                                        "as the run did not")
            return replace(diagnosis, evidence=ev), None
        if stale is not None:  # a frozen parameter changed in place: no snapshot that left it out is valid now
            self.ring.turn_off(f"the snapshot ring is off for this run: {stale}")
            snapshot = None
        if snapshot is not None and not agree and distributed.world_size() > 1:
            if sharding.replay_needs_all_ranks(self.state.root):
                ev["trajectory_control"] = (f"not run: the model is sharded, so a replay talks to every rank, and "
                                            f"{APART}: a replay on this rank alone would wait for the others")
                return replace(diagnosis, evidence=ev), None
            if self.state.split:
                ev["trajectory_control"] = (f"not run: each rank holds part of the snapshot, so a restore talks to "
                                            f"every rank, and {APART}: a restore on this rank alone would wait for "
                                            "the others")
                return replace(diagnosis, evidence=ev), None
            # a replay on this rank alone has no gradient all-reduce: its trajectory is not the run's (the other
            # ranks' gradients, a NaN among them, are missing), so no verdict on the run can be drawn from it
            ev["trajectory_control"] = (f"not run: {APART}, and a replay on this rank alone would train on its own "
                                        "gradients without the other ranks' (no all-reduce), so its trajectory "
                                        "could not stand for the run's")
            return replace(diagnosis, evidence=ev), None
        disagreed = None
        if agree and distributed.world_size() > 1:
            # every rank replays together, so every rank must start from the same snapshot: each ring keeps and
            # drops snapshots on its own budget, and a restore of a split snapshot broadcasts entry by entry
            # (with each rank's reason where it holds none: every rank then says the same)
            pairs = distributed.gather((None, self._no_snapshot(before, diagnosis.step)) if snapshot is None
                                       else (snapshot.step, None))
            held = [step for step, _ in pairs]
            if set(held) == {None}:
                disagreed = protocol.said_alike([why for _, why in pairs])
            elif len(set(held)) > 1:
                snapshot = None
                disagreed = (f"the ranks do not hold the same snapshot from before step {before} (steps by rank: "
                             f"{held}), and a replay from different states would not meet in its collectives")
        if snapshot is not None and distributed.world_size() == 1:
            dirty = _data_steps(self.ring.batches(snapshot.step + 1, alarm_step))
            if dirty:  # (one process only: under several, whether to replay is every rank's decision alike)
                snapshot = None
                disagreed = (f"the batch{'es' if len(dirty) > 1 else ''} of step{'s' if len(dirty) > 1 else ''} "
                             f"{', '.join(str(s) for s in dirty)} hold{'' if len(dirty) > 1 else 's'} NaN/inf, which "
                             "FP32 training from the snapshot would take in: a replay would show the data's fault, not "
                             "whether reduced precision is at fault")
        local: tuple[TrajectoryVerdict, LowerLrVerdict, bool, Any] | _CapTooSmall | str | None = None  # or an error
        if snapshot is None:
            reason = disagreed or self._no_snapshot(before, diagnosis.step)
            ev["trajectory_control"] = f"not run: {reason}"
        else:
            if held_since is not None:
                ev["trajectory_from"] = held_since
            local = self._replay(diagnosis, snapshot, alarm_step, loss_level, agree, held_since is not None)
        gathered = distributed.gather(local) if agree else [local]
        ranked = [(rank if agree else distributed.rank(), r) for rank, r in enumerate(gathered) if r is not None]
        # the rank whose replay raised first, before those that stopped with it (distributed.Lockstep)
        failed = sorted((r for _, r in ranked if isinstance(r, str)), key=lambda e: e.startswith("ReplayAborted"))
        if failed:
            raise InvestigationError(f"the trajectory replay failed: {failed[0]}")
        capped = next((r for _, r in ranked if isinstance(r, _CapTooSmall)), None)
        if capped is not None:
            ev["trajectory_control"] = str(capped)
            return replace(diagnosis, evidence=ev), None
        verdicts = [(rank, r) for rank, r in ranked if isinstance(r, tuple)]
        if not verdicts:
            return replace(diagnosis, evidence=ev), None
        judged_on, (verdict, lower, fp32_down, report) = min(
            verdicts, key=lambda rv: (_VERDICT_ORDER.index(rv[1][0].kind), rv[0] not in fault_ranks, rv[0]))
        if agree and len(gathered) > 1:
            ev["trajectory_rank"] = judged_on
        ev["trajectory_verdict"] = verdict.kind
        ev.update({f"trajectory_{k}": v for k, v in verdict.evidence.items()
                   if k not in ("loss_level", "divergence_ratio")})
        ev.update(lower_lr_verdict=lower.kind, lower_lr_reason=lower.reason, lower_lr_factor=lower.factor,
                  lower_lr_losses=lower.evidence["losses"], lower_lr_skipped=lower.evidence["skipped"],
                  lower_lr_margin=lower.evidence["margin"])
        facts = replace(facts_of(diagnosis), trajectory=verdict, lower_lr=lower)
        if not rename:
            ev["trajectory_reason"] = verdict.reason
            return replace(diagnosis, evidence=ev, advice=advise(diagnosis.finding, ev), facts=facts), None
        batch_verdict = ev.pop("control_verdict", None)
        control = facts_of(diagnosis).control
        if batch_verdict is not None and control is not None and control.verdict is not ControlVerdict.NOT_RUN:
            ev["batch_control_verdict"] = batch_verdict
        ev["control_verdict"] = verdict.reason
        if verdict.kind is TrajectoryKind.AMP_CONFIRMED and control is not None \
                and control.verdict is ControlVerdict.AMP_FAULT and batch_verdict is not None:
            # both controls blame AMP: the single-batch verdict stands as said, the trajectory's sentence beside it
            ev["control_verdict"] = ev.pop("batch_control_verdict", batch_verdict)
            ev["trajectory_reason"] = verdict.reason
        finding = _RENAMED_BY.get(verdict.kind, diagnosis.finding)
        if verdict.kind is TrajectoryKind.AMP_CONFIRMED and lower.kind is LowerLrKind.LR_IS_THE_CAUSE \
                and not fp32_down:
            # FP32 at the full LR stays finite but does not train; the same steps at a lower LR fall decisively and
            # end well under it: the LR. An inconclusive lower-LR replay renames nothing: the AMP verdict stands
            finding = Finding.FP32_UNSTABLE
            ev["control_verdict"] = (f"FP32 training from the snapshot after step {snapshot.step if snapshot else '?'}"
                                     f" stays finite but its loss does not fall, and {lower.reason}: not an AMP "
                                     "fault")
        location = diagnosis.location
        finding, location = _by_interventions(report, verdict, diagnosis, ev, finding, location)
        facts = replace(facts, interventions=report)
        renamed = finding if finding is not diagnosis.finding else None
        if renamed is not None and finding not in AMP_BLAMING:
            supersede_amp_evidence(ev, diagnosis.finding)
        return replace(diagnosis, finding=finding, location=location, evidence=ev, advice=advise(finding, ev),
                       facts=facts), renamed

    def _replay(self, diagnosis: Diagnosis, snapshot: Any, alarm_step: int, loss_level: float | None,
                agree: bool, held_since: bool = False) -> tuple[TrajectoryVerdict, LowerLrVerdict, bool, Any] | \
            _CapTooSmall | str:
        """This rank's replays from ``snapshot`` (every rank's together where they ``agree``): the verdicts (the
        trajectory's, the lower LR's, whether FP32 trained down, the interventions' report), the reason the cap
        cannot hold them, or this rank's error; never raised, since every rank must reach the gather that follows."""
        # a sharded model's replays talk to every rank: a rank that fails before one's first forward stops every
        # rank there (distributed.Lockstep), so that every rank reaches the gather below
        sharded = agree and distributed.world_size() > 1 and sharding.replay_needs_all_ranks(self.state.root)
        # a snapshot split across DDP ranks: each replay starts with a restore that broadcasts entry by entry from
        # every rank; the ranks meet once per replay (protocol.Meeting), after every check of the replay and of
        # its restore and right before the first broadcast. A rank whose preparation failed, or whose last replay
        # raised, enters that meeting to say so: every rank stops there, and every rank reaches the gather below
        split = agree and distributed.world_size() > 1 and self.state.split and not sharded

        def lockstep() -> Any:
            return distributed.Lockstep(self.state.root) if sharded else contextlib.nullcontext()

        error: str | None = None
        state = self.state

        together = agree and distributed.world_size() > 1
        told = False  # this rank's error was said at a meeting every rank entered (every rank stopped there)

        def before_each() -> bool:
            """Before each intervention's replay, the ranks that replay together meet (protocol.meet): one that
            failed since says so there, and every rank stops at that meeting, so the next replay's restore and
            the interventions' agreements are entered by every rank or by none."""
            nonlocal error, told
            if told or not together:
                return error is not None
            try:
                stop = protocol.meet(error)
            except protocol.ReplayAborted as err:  # another rank's failed: stop here too, as every rank does
                error, stop = f"ReplayAborted: {err}", True
            told = stop
            return stop

        try:
            steps, repeated_from = self.window(snapshot.step, diagnosis.step, alarm_step)
            if steps[-1][0] < diagnosis.step:
                raise _CapTooSmall(f"not run: the {diagnosis.step - snapshot.step} steps from the snapshot after step "
                                   f"{snapshot.step} to the onset at step {diagnosis.step} do not fit twice in the "
                                   f"replay-step cap of {self.replay_steps} (Thresholds.replay_steps)")
            alone = distributed.world_size() == 1  # ranks stop together only where each replay runs to its end

            def replay(**options: Any) -> Any:
                nonlocal error, told
                options["stop_on_fault"] = options.get("stop_on_fault", False) and alone
                limit = options.pop("limit", None)  # a replay shortened to the cap (the lower LR's, after a rise)
                use = steps if limit is None else steps[:limit]
                # a split snapshot's restore meets once, after every check and before its first broadcast
                # (protocol.Meeting); a sharded replay meets at each micro-batch (Lockstep.next)
                meeting, lock = protocol.Meeting(split), None
                try:
                    with lockstep() as lock, meeting:
                        return replay_trajectory(state, snapshot, use, ready=meeting.ready,
                                                 before_micro_batch=lock.next if lock else None, **options)
                except Exception as err:  # noqa: BLE001 - said at the next meeting, or below
                    error = f"{type(err).__name__}: {err}"
                    told = isinstance(err, protocol.ReplayAborted) or meeting.failed or bool(lock and lock.told)
                    return None

            facts = facts_of(diagnosis)
            nothing_nonfinite = replay_went_nonfinite(facts.replay) if facts.replay is not None else False
            # which replays run must be every rank's alike (their collectives meet): under several ranks only the
            # agreed replay record says whether the fault is in the forward pass, not this rank's own losses
            forward = nothing_nonfinite or (alone and diagnosis.measured.first_nonfinite_step is not None)
            located = owning_module(state.module, facts.replay.module if facts.replay is not None else None)
            owner = owning_module(state.module, diagnosis.location) if located is None else None
            unlocated = "the fault was not located in a module"
            if owner is not None and forward:  # a forward fault titled with a parameter: its owning module
                located = owner
            elif owner is not None:  # a gradient fault: the loss scale reaches it, and the cap is kept for that
                unlocated = (f"the fault is in the gradients of {diagnosis.location}, not in a forward output of "
                             f"{owner}: a lower loss scale is what reaches it")
            together = agree and distributed.world_size() > 1
            runner = Interventions(replay, window=[s for s, _ in steps], cap=self.replay_steps,
                                   bf16=self.bf16, before_each=before_each,
                                   agree=(lambda clean: all(distributed.gather(clean))) if together else
                                   (lambda clean: clean))
            with compat.uncompiled(state.module):
                report = runner.run(
                    module=state.module, located=located,
                    forward=forward,
                    onset_scale=_number(diagnosis.measured.onset_scale) or _number(diagnosis.measured.scale) or (
                        _number(snapshot.scaler_state_dict().get("scale")) if snapshot.scaler is not None else None),
                    scale_hint=_number(diagnosis.measured.safe_scale),
                    scaled=state.scaler is not None, from_step=snapshot.step, onset=diagnosis.step,
                    repeated_from=repeated_from, lr_factor=_lower_lr_factor(diagnosis.measured.lr),
                    lr_cap=_lr_cap(diagnosis.measured.lr), lr_rose=_lr_rise(diagnosis.measured.lr) is not None,
                    lower_lr_moot=(f"the replays start from the snapshot after step {snapshot.step}, past the onset: "
                                   "they cannot show whether a lower learning rate would have prevented it")
                    if held_since else None,
                    unlocated=unlocated,
                    fp32_fails=lambda nothing, fp32: judge_trajectory(
                        fp32.result, nothing.result, loss_level, self.divergence_ratio).kind in (
                        TrajectoryKind.FP32_NONFINITE, TrajectoryKind.FP32_DIVERGES))
            if error is not None:
                raise InvestigationError(error)
            fp32t, amp = report.get(Intervention.FP32), report.get(Intervention.NOTHING)
            if fp32t is None or amp is None:  # stopped with another rank, whose own error is the one said
                raise InvestigationError("ReplayAborted: the replays stopped before the FP32 control, with "
                                         "another rank's")
            fp32 = fp32t.result
            verdict = judge_trajectory(fp32, amp.result, loss_level, self.divergence_ratio)
            # what the snapshot held on this rank (trained state only: frozen parameters are left out); and what
            # the FP32 trajectory offers a remedy's recovery check as a reference (only when it was healthy)
            verdict = replace(verdict, evidence={**verdict.evidence, "snapshot_bytes": snapshot.nbytes},
                              fp32_reference=fp32_reference(fp32.losses, level=loss_level,
                                                            margin=self.fall_margin))
            lower_t = report.get(Intervention.LOWER_LR)
            lower = lower_t.result if lower_t is not None else TrajectoryResult("amp", snapshot.step, [], [],
                                                                                 [], True)
            lower_verdict = judge_lower_lr(lower, report.lr_factor, full=fp32, margin=self.lr_cause_margin)
            return verdict, lower_verdict, trains_down(fp32), report
        except _CapTooSmall as err:  # the same on every rank: a reason, not a failure
            return err
        except InvestigationError as err:  # a replay's own error, as it was raised
            return str(err)
        except Exception as err:  # noqa: BLE001 - every rank must still reach the gather below
            return f"{type(err).__name__}: {err}"


def after_onset(snapshots: Sequence[Any], onset: int, alarm_step: int,
                skipped: Collection[int]) -> tuple[Any, str] | None:
    """Of ``snapshots`` (oldest first), where none from before the update that preceded the onset is held (a fit
    resumed in the middle of an episode): one taken since, and what replays from it can stand for. The oldest one
    the scaler skipped every step to from the onset holds the state the onset's own step ran on (a skipped step
    changes no weight and no optimizer state); failing that, the oldest one with a later fault of the episode (a
    skipped step) after it and by the alarm. None when neither is held."""
    held = [s for s in snapshots if onset - 1 <= s.step < alarm_step]
    for snapshot in held:
        if all(k in skipped for k in range(onset, snapshot.step + 1)):
            skips = ", and the scaler skipped every step from the onset to it" if snapshot.step >= onset else ""
            return snapshot, (
                f"the snapshot after step {snapshot.step}: none from before the update that preceded the onset at "
                f"step {onset} is held{skips}, so it holds the weights and the optimizer state the onset's step ran "
                "on; the replays start at the fault, so they show what cures it, not what set it off")
    for snapshot in held:
        later = sorted(k for k in skipped if snapshot.step < k <= alarm_step)
        if later:
            steps = ", ".join(str(k) for k in later[:6]) + (", ..." if len(later) > 6 else "")
            return snapshot, (
                f"the snapshot after step {snapshot.step}, taken after the onset at step {onset}: none from before "
                f"it is held; the replays start past the onset, over the episode's later faults (step"
                f"{'s' if len(later) > 1 else ''} {steps}), so they show what cures those, not what set it off")
    return None


class _CapTooSmall(Exception):
    """The replay-step cap cannot hold the window twice (nothing changed and FP32): the replays are not run."""


def _data_steps(steps: Sequence[tuple[int, Sequence[Any]]]) -> list[int]:
    """The steps of a replay window whose batches hold NaN/inf (one device read per tensor: on an alarm only)."""
    return [step for step, micro_batches in steps
            if micro_batches and inspect_batch([mb[0] for mb in micro_batches]).nonfinite]


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _rise(lr: LrRise | None) -> tuple[float | None, float | None]:
    """The measured LR before and after the rise, as floats (None where not measured)."""
    return (None, None) if lr is None else (_number(lr.before), _number(lr.after))


def _lower_lr_factor(lr: LrRise | None) -> float:
    """The lower-LR intervention's factor: a tenth, or after a known rise of more than 10x, the factor that undoes
    it (the counterfactual "without the rise")."""
    before, after = _rise(lr)
    if before is not None and after is not None and after > 0 and 0 < before < after:
        return min(LOWER_LR_FACTOR, before / after)
    return LOWER_LR_FACTOR


def _lr_cap(lr: LrRise | None) -> float | None:
    """After a rise of more than 10x, the LR before it: the lower-LR intervention then replays the window with no LR
    above it (the counterfactual "without the rise", as ``reduce_lr``'s ceiling would run it). None otherwise."""
    before, after = _rise(lr)
    if before is not None and after is not None and 0 < before and after > before / LOWER_LR_FACTOR:
        return before
    return None


def _lr_rise(lr: LrRise | None) -> str | None:
    """The LR rise before the onset the machine noted, in words ("0.0006 -> 0.0018 at step 8"), or None."""
    return None if lr is None else lr.words()


def _by_interventions(report: InterventionReport, verdict: TrajectoryVerdict, diagnosis: Diagnosis,
                      ev: dict[str, Any], finding: Finding, location: str | None) -> tuple[Finding, str | None]:
    """What cured decides (:func:`~lightning_ampwatch.interventions.decide`): the finding, its location and
    reason, the co-factors; the safe scale is the one measured over the window. Evidence written in place (the
    measurements read are ``diagnosis``'s: ``ev`` is its evidence with the trajectory control's added)."""
    measured = diagnosis.measured
    ev["interventions"] = report.evidence()
    ev["tried"] = report.headline()  # the panel's one line per intervention
    a, b = report.window
    if report.safe_scale is not None:
        ev["safe_scale"] = report.safe_scale
        ev["safe_scale_from"] = (f"the largest loss scale that replayed steps {a}-{b} from the snapshot without a "
                                 "skip" + ("" if report.safe_scale_bounded else (
                                     f" among those tried ({format_pow2(2 * report.safe_scale)} was not: the "
                                     "replay-step cap)")))
        if measured.pattern is GradientPattern.UNSCALED_OVERFLOW:
            # the single step's gradients overflowed at scale 1, but a lower scale ran the whole window clean
            ev["pattern"] = (measured.pattern_before_replay or GradientPattern.STARTUP).value
    elif report.safe_scale_tried:
        ev.pop("safe_scale", None)  # measured: no scale tried held, whatever one step suggested
        low = [s for s, ok in report.safe_scale_tried if not ok and s <= 1.0]
        if measured.pattern is GradientPattern.UNSCALED_OVERFLOW and not low:
            # "no scaler setting can help" only where replays at scales of 1 and below were measured to fail
            ev["pattern"] = (measured.pattern_before_replay or GradientPattern.STARTUP).value
        ev["safe_scale_from"] = (f"none: no loss scale tried ({', '.join(format_pow2(s) for s, _ in report.safe_scale_tried)}) "
                                 f"replayed steps {a}-{b} without a skip")
    ev.pop("pattern_before_replay", None)
    fp32_failed = verdict.kind in (TrajectoryKind.FP32_NONFINITE, TrajectoryKind.FP32_DIVERGES)
    facts = facts_of(diagnosis)
    located = location if finding not in BACKWARD else (facts.replay.module if facts.replay else None)
    nothing = report.get(Intervention.NOTHING)
    decision = decide(report, finding=finding, located=located, lr_rise=_lr_rise(measured.lr),
                      batch_nonfinite=measured.nonfinite_batch,
                      forward=bool(nothing is not None and nothing.nonfinite) or (
                          facts.replay is not None and replay_went_nonfinite(facts.replay)),
                      onset=diagnosis.step, fp32_cured=not fp32_failed)
    if decision is None:
        return finding, location
    if decision.finding is Finding.NOT_REPRODUCED and verdict.kind is not TrajectoryKind.NOT_REPRODUCED:
        return finding, location
    if decision.finding is finding:  # the replays confirm it: the control's verdict stands, theirs beside it
        ev["trajectory_reason"] = decision.reason
    else:
        ev["control_verdict"] = decision.reason
    if decision.cofactors:
        ev["cofactors"] = list(decision.cofactors)
    if decision.finding is not Finding.GRADIENT_OVERFLOW and decision.finding not in AMP_BLAMING:
        ev.pop("safe_scale", None)
    return decision.finding, decision.location or location


def owning_module(module: Any, name: str | None) -> str | None:
    """The submodule ``name`` names, or the one owning the parameter it names (``head.weight`` -> ``head``); None for
    the model itself, the code around it (``training_step``, a file:line) or no name."""
    if not name:
        return None
    if compat.has_submodule(module, name):
        return name
    owner, _, leaf = name.rpartition(".")
    if owner and compat.has_submodule(module, owner) and isinstance(
            getattr(module.get_submodule(owner), leaf, None), torch.nn.Parameter):
        return owner
    return None
