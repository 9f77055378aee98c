"""What happens on the first alarm of an episode: localise (which module, which parameter) and run the FP32
control, on the rank(s) where the fault arose, then agree on one answer across ranks; for an alarm that blames
reduced precision, the FP32 trajectory control
(:class:`~lightning_ampwatch.trajectory.control.TrajectoryControl`, owned by the core) has the last word.

Bounded by construction: it runs once per new alarm, and the machine raises an alarm once per episode. What it
concludes comes back as records (the refined diagnosis with its :class:`~lightning_ampwatch.records.Facts`, the
finding to rename); the core tells the machine.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from lightning_ampwatch import compat, deepspeed_state, distributed, sharding
from lightning_ampwatch.machine import AmpStateMachine, BatchStats, PrecisionMode, Thresholds
from lightning_ampwatch.machine.lr_history import added_group
from lightning_ampwatch.probes import (
    FP16_MAX,
    LiveProbe,
    MicroBatch,
    ReducedInputs,
    Replayer,
    ReplayResult,
    capture_rng,
    uses_rng,
)
from lightning_ampwatch.records import ControlVerdict, facts_of
from lightning_ampwatch.replays import (
    APART,
    BACKWARD,
    InvestigationError,
    ReplayRecord,
    replay_went_nonfinite,
    supersede_amp_evidence,
)
from lightning_ampwatch.measured import Measured
from lightning_ampwatch.taxonomy import (
    Diagnosis,
    Finding,
    GradientPattern,
    advise,
    format_pow2,
)
from lightning_ampwatch.verdicts import AMP_BLAMING, LevelOrigin, control_result

if TYPE_CHECKING:  # the core hands its control to :meth:`Investigations.investigate`; never imported at run time
    from lightning_ampwatch.trajectory.control import TrajectoryControl

#: Findings located by the first non-finite forward output (by the first non-finite gradient: ``BACKWARD``).
_FORWARD = {Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.DATA_NONFINITE, Finding.FP32_UNSTABLE}
_INVESTIGATED = _FORWARD | BACKWARD | {Finding.LR_SCHEDULE}
#: Alarms a live probe of the next step can locate when the faulty step cannot be replayed.
LIVE_PROBED = BACKWARD | {Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.LR_SCHEDULE}


class Investigator:
    """Replays a faulty step's batches with probes (under autocast) and without autocast (the control)."""

    def __init__(self, module: Any, forward_context: Any, device: torch.device, mode: PrecisionMode,
                 localize: bool, control: bool, automatic: bool,
                 step_loss: Callable[[Any, int], Any] | None = None,
                 outside_modules: Callable[[], str] | None = None, root: Any = None,
                 refused: Callable[[], str | None] | None = None) -> None:
        # root: the module as the strategy wraps it (or a callable giving it), for what a replay must know of it;
        # refused: why no replay may run now (the host's ``replays_refused``), asked at each one
        self.replayer = Replayer(module, forward_context, device, step_loss, root)
        self.module = module
        # where a fault that no module's output shows is placed: the adapter's name for the code around the model
        self.outside_modules = outside_modules
        self.mode = mode
        self.localize = localize
        self.control = control and mode is not PrecisionMode.FP32  # in FP32 the run is its own control
        self.automatic = automatic
        self.refused = refused

    def collect(self, batches: Sequence[MicroBatch], *, scale: float | None, fault_ranks: Sequence[int],
                weights_stepped: bool, loss_level: float | None, agree: bool,
                loss_level_origin: LevelOrigin = LevelOrigin.HEALTHY,
                reference: dict[str, Any] | None = None) -> ReplayRecord | None:
        """Replay on the rank(s) at fault; with ``agree`` every rank must call this together and all get one record.

        ``agree`` holds only where the ranks meet the anomaly at the same step (under a GradScaler every rank skips
        the same steps). Without it each rank replays alone and no collective is made: a rank waiting in a
        collective the others never enter would hang the run.
        ``loss_level`` is this rank's usual loss; the record carries the investigating rank's, so that every rank
        judges the control against the same number.
        """
        if not (self.localize or self.control):
            return None
        refused = self.refused() if self.refused is not None else None  # alike on every rank: the loop's shape
        if refused is not None:
            return ReplayRecord(evidence={"replay": f"not run: {refused}", "fp32_control": f"not run: {refused}"})
        batches = [mb if isinstance(mb, MicroBatch) else MicroBatch(*mb) for mb in batches]
        local: ReplayRecord | None = None
        refused = deepspeed_state.batch_replay_unavailable(self.replayer.root_module())  # alike on every rank
        if refused is not None:
            return ReplayRecord(evidence={"replay": refused})
        # A sharded model's forward is collective (FSDP's all-gathers): every rank replays together on
        # this agreed step, or, where the ranks do not meet anomalies together (no scaler), none does
        everyone = sharding.replay_needs_all_ranks(self.replayer.root_module()) and distributed.world_size() > 1
        if everyone and not agree:
            return ReplayRecord(evidence={"replay": (
                f"not run: the model is sharded, so a replay's forward talks to every rank, and {APART}: a replay on "
                "this rank alone would wait for the others")})
        if not agree or distributed.rank() in fault_ranks or everyone:
            try:
                with compat.uncompiled(self.module):  # the user's modules, hooked and named as written
                    local = self._local(batches, scale, weights_stepped)
                local.loss_level, local.loss_level_origin = loss_level, loss_level_origin
                local.evidence.update(reference or {})
            except Exception as err:  # noqa: BLE001 - every rank must still reach the gather below
                local = ReplayRecord(error=f"{type(err).__name__}: {err}")
        results = distributed.gather(local) if agree else [local]
        failed = [(r, res.error) for r, res in enumerate(results) if res is not None and res.error]
        if failed:
            raise InvestigationError(f"the replay failed on rank {failed[0][0]}: {failed[0][1]}")
        order = [r for r in fault_ranks if r < len(results)] + list(range(len(results)))
        for r in order:  # the first rank at fault that replayed (every rank replays a sharded model)
            res = results[r]
            if res is not None:
                if agree and distributed.world_size() > 1:
                    res.evidence.update(fault_ranks=list(fault_ranks), investigated_on_rank=r)
                return res
        return None

    def apply(self, diagnosis: Diagnosis, record: ReplayRecord | None, *,
              batch: BatchStats | None) -> tuple[Diagnosis, Finding | None]:
        """The diagnosis with location and control evidence; and the new finding if the control renamed it."""
        if record is None or diagnosis.finding not in _INVESTIGATED:
            return diagnosis, None
        loss_level = record.loss_level
        ev = dict(diagnosis.evidence)
        ev.update(record.evidence)
        control = control_result(
            diagnosis.finding, control_loss=record.control_loss,
            control_grads_finite=record.control_grads_finite,
            batch_nonfinite=bool(batch and batch.nonfinite), loss_level=loss_level,
            level_origin=record.loss_level_origin, amp_nonfinite=replay_went_nonfinite(record),
        )
        finding = control.finding
        ev["control_verdict"] = control.reason
        where = str(diagnosis.measured.input_where).rsplit(": ", 1)[-1]  # ("rank 1: batch[0]" under DDP)
        if finding is Finding.INPUT_RANGE and record.reduced_precision_inputs is not None \
                and where not in record.reduced_precision_inputs:
            # the large values never enter a float16 op (a target used in a float32 loss): not an input-range fault
            finding = Finding.FORWARD_OVERFLOW if replay_went_nonfinite(record) and record.module is not None \
                else Finding.GRADIENT_OVERFLOW
            ev["input_not_in_reduced_precision"] = (
                f"{ev.pop('input_where', None)} holds values up to {ev.pop('input_absmax', 0):.3g}, but the replay "
                "shows it enters no float16 op (it is used in float32 only)")
        if loss_level is not None:
            ev["loss_level"] = loss_level
            if record.loss_level_origin is not LevelOrigin.HEALTHY:
                ev["loss_level_from"] = record.loss_level_origin.words
        finding = _gradient_scale_evidence(finding, ev, diagnosis.measured, record)
        if batch is not None and batch.nonfinite:
            ev.setdefault("nonfinite_where", batch.nonfinite_where)
        if finding is Finding.DATA_NONFINITE:
            location = diagnosis.location  # the data, not a module: where is in evidence["nonfinite_where"]
        else:
            location = record.param if finding in BACKWARD else record.module
            location = location or record.module or record.param or diagnosis.location
        renamed = finding if finding is not diagnosis.finding else None
        if renamed is not None and diagnosis.finding in AMP_BLAMING and finding not in AMP_BLAMING:
            supersede_amp_evidence(ev, diagnosis.finding)
        refined = Diagnosis(finding=finding, step=diagnosis.step, location=location, evidence=ev,
                            advice=advise(finding, ev, control_diverging=control.verdict is ControlVerdict.DIVERGING,
                                          against_first_loss=record.loss_level_origin is LevelOrigin.FIRST_LOSS),
                            remedy=diagnosis.remedy, facts=replace(facts_of(diagnosis), replay=record, control=control))
        return refined, renamed

    def _local(self, batches: Sequence[MicroBatch], scale: float | None, weights_stepped: bool) -> ReplayRecord:
        """Both probes at once (the finding may not be known yet): forward outputs, and gradients at ``scale``."""
        out = ReplayRecord(evidence={"batch_idx": [mb.batch_idx for mb in batches]})
        ev = out.evidence
        if not self.automatic:
            ev["replay"] = ("not run: manual optimization (replaying training_step would step the optimizer); "
                            "the step's own measurements stand")
            return out
        if weights_stepped and not _weights_finite(self.module):
            ev["replay"] = "not run: the weights already hold non-finite values (no scaler protected them)"
            ev["weights_lost"] = ("the weights now hold non-finite values (no scaler skipped this step): every later "
                                  "step trains on them, and the run cannot recover by itself")
            return out
        if weights_stepped:
            ev["replay_note"] = "the optimizer stepped after this batch: replayed with the updated weights"
        probe_scale = scale if scale is not None else 1.0
        if self.localize:
            use_autocast = self.mode is not PrecisionMode.FP32
            tracer = ReducedInputs(batches) if use_autocast else None
            with tracer if tracer is not None else contextlib.nullcontext():
                amp = self.replayer.run(batches, use_autocast=use_autocast, grad_scale=probe_scale, probe=True)
            entered = tracer.entered() if tracer is not None and amp.error is None else None
            if entered is not None:
                ev["reduced_precision_inputs"] = entered
                out.reduced_precision_inputs = list(entered)
            if amp.error is not None:  # a sharded replay failed on some rank: every rank says so, and goes no further
                ev["replay"] = f"failed: {amp.error}"
                if self.control:
                    ev["fp32_control"] = f"not run: {amp.error}"
                return out
            ev.update(_replay_evidence(amp, "replay"))
            out.loss, out.grads_finite, out.grad_absmax = amp.loss, amp.grads_finite, amp.grad_absmax
            out.unscaled_grads_finite = amp.unscaled_grads_finite if amp.grad_scale != 1.0 else None
            out.module = amp.first_nonfinite_module
            if amp.nonfinite_outside_modules:
                out.module = self.outside_modules() if self.outside_modules is not None else \
                    f"{sharding.class_name(self.module)}.training_step"
            out.param = amp.first_nonfinite_param
            if amp.headroom:
                ev["fp16_headroom_log2"] = dict(amp.headroom)
        half = sharding.half_param_dtype(self.replayer.root_module()) if self.control else None
        ds_half = deepspeed_state.half_module_dtype(self.replayer.root_module()) if self.control else None
        if half is not None:  # FSDP computes in its param dtype whatever autocast says
            ev["fp32_control"] = (f"not run: FSDP gathers the parameters in {str(half).replace('torch.', '')} for "
                                  "compute, so a replay without autocast would not be FP32")
        elif ds_half is not None:  # DeepSpeed casts the module itself; its float32 weights are its optimizer's
            ev["fp32_control"] = (f"not run: DeepSpeed keeps the module's parameters in "
                                  f"{str(ds_half).replace('torch.', '')} (its float32 master weights live in its "
                                  "optimizer), so a replay without autocast would not be FP32")
        elif self.control:
            ctl = self.replayer.run(batches, use_autocast=False, grad_scale=1.0, probe=False)
            if ctl.error is not None:
                ev["fp32_control"] = f"not run: {ctl.error}"
                return out
            ev.update(_replay_evidence(ctl, "fp32_control"))
            out.control_loss = ctl.loss
            out.control_grads_finite = ctl.grads_finite
        return out


#: The measured safe scale keeps the largest parameter gradient this many times under float16's maximum: the
#: activations' gradients, which the replay does not see, can be larger.
SAFE_SCALE_MARGIN = 2.0


def _gradient_scale_evidence(finding: Finding, ev: dict[str, Any], measured: Measured,
                             record: ReplayRecord) -> Finding:
    """What the replay's gradients say about the loss scale. Gradients that overflow at scale 1 are an
    ``unscaled_overflow``: no loss scale helps, whatever the scaler's history suggested. Otherwise the largest
    power of two that keeps the largest gradient under float16's maximum (with a margin) is the measured safe
    scale, in place of the scaler's history, which only knows the scales that once held: the gradients may have
    grown since (after an LR rise, say). A start-up streak judged when it ended keeps the scale the scaler settled
    at, measured on these very weights; one decided early (to be remedied at once) has none yet and takes the
    measured one. ``measured``: the diagnosis's own measurements; ``record``: the replay's. Evidence written in
    ``ev``."""
    if finding in BACKWARD and (record.unscaled_grads_finite is False or (
            record.grads_finite is False and measured.scale == 1.0)):
        if measured.pattern not in (None, GradientPattern.UNSCALED_OVERFLOW):
            ev["pattern_before_replay"] = measured.pattern.value  # for the interventions, should a lower scale hold
        ev["pattern"] = GradientPattern.UNSCALED_OVERFLOW.value
        ev.pop("safe_scale", None)
        return Finding.GRADIENT_OVERFLOW
    absmax = record.grad_absmax
    settled = measured.pattern is GradientPattern.STARTUP and measured.safe_scale_sought
    wanted = measured.safe_scale_sought or finding is Finding.GRADIENT_OVERFLOW
    if wanted and not settled and isinstance(absmax, (int, float)) and 0 < absmax < math.inf:
        safe = 2.0 ** math.floor(math.log2(FP16_MAX / absmax)) / SAFE_SCALE_MARGIN
        ev["safe_scale"] = safe
        ev["safe_scale_from"] = f"the replay's largest unscaled gradient ({absmax:.4g}), with a {SAFE_SCALE_MARGIN:g}x margin"
        replayed_at = measured.scale
        if record.grads_finite is False and replayed_at is not None and 0 < replayed_at <= safe:
            # the replay overflowed at this very scale: an intermediate gradient (in a model computing wholly in
            # float16, DeepSpeed's) was larger than any parameter's, so the parameters' say nothing safe above it
            ev["safe_scale"] = 2.0 ** math.floor(math.log2(replayed_at)) / 2
            ev["safe_scale_from"] = (f"half the scale the replay's gradients overflowed at ({format_pow2(replayed_at)}"
                                     f"; its largest parameter gradient, {absmax:.4g}, would have allowed more)")
    return finding


def _replay_evidence(result: ReplayResult, prefix: str) -> dict[str, Any]:
    ev: dict[str, Any] = {f"{prefix}_loss": result.loss}
    if result.grads_unavailable is not None:
        ev[f"{prefix}_grads"] = f"unavailable: {result.grads_unavailable}"
    if result.grads_finite is not None:
        ev[f"{prefix}_grads_finite"] = result.grads_finite
    if result.unscaled_grads_finite is not None and result.grad_scale != 1.0:  # at scale 1 it is grads_finite
        ev[f"{prefix}_unscaled_grads_finite"] = result.unscaled_grads_finite
    if result.grad_absmax is not None:
        ev[f"{prefix}_grad_absmax"] = result.grad_absmax
    if result.first_nonfinite_module:
        ev[f"{prefix}_first_nonfinite_module"] = result.first_nonfinite_module
    if result.first_nonfinite_param:
        ev[f"{prefix}_first_nonfinite_param"] = result.first_nonfinite_param
    return ev


def _weights_finite(module: torch.nn.Module) -> bool:
    params = [p.detach() for p in module.parameters()]
    if not params:
        return True
    return bool(torch.stack([torch.isfinite(p).all() for p in params]).all())


def located_live(diagnosis: Diagnosis, first_module: str | None, first_param: str | None,
                 headroom: list[tuple[str, float]], outside: str | None = None) -> Diagnosis:
    """A diagnosis that waited for a :class:`~lightning_ampwatch.probes.LiveProbe`, with what the probe saw. A forward
    fault with no module output non-finite is placed at ``outside`` (the training step's own code: see
    :func:`in_training_step`)."""
    ev = dict(diagnosis.evidence)
    ev["live_probe"] = ("the next training step watched as it ran (manual optimization: no replay)"
                        if (first_module or first_param) else
                        "the next training step watched as it ran: the fault did not recur there")
    if first_module:
        ev["live_first_nonfinite_module"] = first_module
    if first_param:
        ev["live_first_nonfinite_param"] = first_param
    if headroom:
        ev["fp16_headroom_log2"] = dict(headroom)
    if diagnosis.finding in BACKWARD:
        location = first_param or first_module
    elif diagnosis.finding in _FORWARD:
        location = first_module  # a forward fault is where a module's output went non-finite, never a parameter
    else:
        location = first_module or first_param
    located = replace(diagnosis, location=location or diagnosis.location, evidence=ev)
    return in_training_step(located, outside, "no module's output was non-finite in the step watched")


def in_training_step(diagnosis: Diagnosis, place: str | None, why: str) -> Diagnosis:
    """A forward fault under manual optimization that no module's output explains, placed where it can be defended:
    the training step (``place``, ``<Model>.training_step``), whose own code computed the loss handed to
    ``manual_backward`` (every forward ran inside it, and the step cannot be replayed). ``why``: why no module is
    named, said in the evidence (``location_why``)."""
    if diagnosis.location is not None or place is None or diagnosis.finding not in _FORWARD \
            or diagnosis.finding is Finding.DATA_NONFINITE:
        return diagnosis
    return replace(diagnosis, location=place, evidence={**diagnosis.evidence, "location_why": (
        f"{why}; the non-finite loss came out of {place} (manual optimization: the step cannot be replayed), so "
        "that is the place named")})



class Investigations:
    """When to look, and what waits for a look.

    A start-up streak is replayed at the skip that makes it alarm-length, while the weights are still those of the
    faulty steps (the alarm itself is only decided when the streak ends, after the optimizer moved); any other new
    alarm is replayed at once. Manual optimization cannot be replayed (``training_step`` steps the optimizer
    itself), so live probes watch the next real step and the alarm waits for it.
    """

    def __init__(self, investigator: Investigator | None, machine: Any, *, window: int, world_size: int,
                 capture_rng: bool, on_failure: Callable[[str, Exception], None]) -> None:
        self.investigator = investigator
        self.machine = machine
        self.window = window
        self.world_size = world_size
        self.capture_rng = capture_rng  # the model draws random numbers: replays must redraw the same ones
        self.batch_rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # RNG at this batch's start
        self.on_failure = on_failure
        self._evidence: tuple[int, ReplayRecord | None] | None = None  # (step, record) awaiting an alarm
        self._awaiting_probe: list[Diagnosis] = []
        self._probe_next = False
        self._live_probe: LiveProbe | None = None
        self._confirmed: dict[tuple[Finding, str | None], tuple[int, Any]] = {}  # (finding, where) -> (step, report)

    @staticmethod
    def _agreed_ranks(step: Any) -> Sequence[int]:
        """The ranks at fault as every rank knows them: merged on a skipped step; on any other (the clean step that
        ends a start-up streak) each rank knows only itself, and naming itself would make each rank judge by its own
        replay and publish different evidence: none, then."""
        return step.fault_ranks if step.obs.skipped else ()

    def remedy_applied(self) -> None:
        """A remedy changed the run: a recurrence after it is a new question, replayed again."""
        self._confirmed.clear()

    @classmethod
    def for_run(cls, config: Any, host: Any, machine: AmpStateMachine, world_size: int,
                on_failure: Callable[[str, Exception], None]) -> "Investigations":
        """The investigations of one run, as the watch's configuration asks (``localize``, ``control_replay``, the
        window), replaying through the host: its module, autocast and loss, and the optional ``outside_modules``,
        ``wrapped_module`` and ``replays_refused`` where it has them (see :class:`~lightning_ampwatch.host.Host`)."""
        investigator = Investigator(host.module, host.forward_context, host.device, machine.mode,
                                    localize=config.localize, control=config.control_replay,
                                    automatic=host.automatic, step_loss=host.step_loss,
                                    outside_modules=getattr(host, "outside_modules", None),
                                    root=getattr(host, "wrapped_module", None),
                                    refused=getattr(host, "replays_refused", None))
        return cls(investigator, machine, window=config.thresholds.window, world_size=world_size,
                   capture_rng=uses_rng(host.module), on_failure=on_failure)

    def switch_mode(self, mode: PrecisionMode) -> None:
        """A remedy swapped the run's precision: replays run at the new one."""
        if self.investigator is not None:
            self.investigator.mode = mode

    @property
    def wants_batch_start(self) -> bool:
        return self.capture_rng or self._probe_next

    def batch_start(self, module: Any, device: torch.device) -> None:
        if self._probe_next:
            self._probe_next = False
            self._live_probe = LiveProbe(module)
        if self.capture_rng:
            self.batch_rng = capture_rng(device)

    def micro_batch(self, batch: Any, batch_idx: int) -> tuple[Any, ...]:
        """What a replay needs of this batch (a plain tuple: one is made every batch)."""
        rng = self.batch_rng
        return (batch, batch_idx) if rng is None else (batch, batch_idx, *rng)

    def before_observe(self, step: Any, agree: bool) -> None:
        """Before the machine sees ``step``: drop stale evidence, and replay now if this skip makes an alarm due.
        ``agree``: the ranks meet this step together (see :meth:`Investigator.collect`)."""
        opened = step.opened
        if self._evidence is not None and self._evidence[0] < opened.step - self.window:
            self._evidence = None  # a suspicion that never became an alarm
        machine = self.machine
        if self.investigator is not None and step.obs.skipped and self._evidence is None \
                and machine.alarm_imminent:
            self._evidence = (opened.step, self._collect(step, weights_stepped=False, agree=agree))

    def investigate(self, diagnosis: Diagnosis, step: Any, scaler_active: bool,
                    trajectory: "TrajectoryControl | None" = None,
                    agree: bool | None = None) -> tuple[Diagnosis | None, Finding | None]:
        """Localise and run the FP32 control for a new alarm (at most once per episode), then the FP32 trajectory
        control (``trajectory``, the core's) for an alarm that blames AMP; either may rename the finding. Returns
        the diagnosis to publish (``None``: it waits for the next step's live probe, see :meth:`optimizer_step`)
        and the finding the open episode is renamed to, if it is (the caller tells the machine). A finite
        divergence is named by its losses: it gets the trajectory replays as evidence only. ``agree``: the ranks
        meet this alarm together (default: under a scaler; not once a rank's watch switched itself off)."""
        agree = scaler_active if agree is None else agree
        if diagnosis.measured.finite_divergence:
            return self.investigate_divergence(diagnosis, step.opened.step, trajectory), None
        if self.investigator is None:
            return diagnosis, None
        skipped = step.obs.skipped
        if self._evidence is not None:
            record = self._evidence[1]
        elif skipped or not scaler_active:
            record = self._collect(step, weights_stepped=not skipped, agree=agree)
        else:
            record = None  # decided on a clean step with nothing replayed while the fault was fresh
        self._evidence = None
        if self.investigator is None:  # the replay failed just now: the plain diagnosis still goes out
            return replace(diagnosis, evidence={**diagnosis.evidence, "replay": "failed (see the warning)"}), None
        refined, renamed = self.investigator.apply(diagnosis, record, batch=step.obs.batch)
        if (refined.finding in AMP_BLAMING or renamed is not None) and "loss_reference" not in refined.evidence:
            refined = replace(refined, evidence={**refined.evidence,
                                                 **self.machine.reference_evidence(diagnosis.step)})
        log = trajectory.state.lr_log if trajectory is not None else None
        added = added_group(log.entries if log is not None else (), diagnosis.step,
                            self.machine.thresholds.lr_lookback) if refined.finding in _RISE_FIRST else None
        if added is not None:
            # a param group added just before the onset, at an LR far above the others': the LR is looked at before
            # the scaler (its rise is what the interventions weigh, and where they cannot run, what stands)
            ev = {**refined.evidence, **added}
            if isinstance(ev.get("control_verdict"), str) and ev["control_verdict"].startswith("control finite"):
                ev["control_verdict"] = ("control finite: one batch replayed in FP32 is finite, which says nothing "
                                         "of training at the new group's learning rate")
            refined = replace(refined, finding=Finding.LR_SCHEDULE, evidence=ev,
                              advice=advise(Finding.LR_SCHEDULE, ev))
            renamed = Finding.LR_SCHEDULE
        key = (refined.finding, refined.location)
        first = self._confirmed.get(key) if self.world_size == 1 else None  # (several ranks would have to agree)
        if trajectory is not None and first is not None:  # a recurring cause, replayed once, not at every glitch
            # its remedy is chosen from what those replays measured, never from the finding's unmeasured table row
            refined = replace(refined, facts=replace(facts_of(refined), interventions=first[1]), evidence={
                **refined.evidence, "trajectory_control": (
                    f"not run again: the replays of the alarm at step {first[0]} named this finding in this place, "
                    "and no remedy was applied since")})
        elif trajectory is not None and (refined.finding in AMP_BLAMING or refined.finding is Finding.LR_SCHEDULE):
            # an LR rise is timing, not a measurement: the interventions decide whether the LR is the cause
            try:
                reference = self.machine.reference_for(diagnosis.step)
                refined, renamed_again = trajectory.judgement.judge(refined, step.opened.step,
                                                                    None if reference is None else reference.level,
                                                                    agree=agree, fault_ranks=self._agreed_ranks(step),
                                                                    skipped=self.machine.state.skip_log)
                renamed = renamed_again or renamed
                report = facts_of(refined).interventions
                if report:  # what the replays named, where: a recurrence named so is theirs
                    self._confirmed.setdefault((refined.finding, refined.location), (diagnosis.step, report))
            except Exception as err:  # noqa: BLE001 - degrade to the single-batch control, never to a crash
                # off for the rest of the run: no more snapshots, nor batches kept for it
                trajectory.ring.turn_off(f"the trajectory control failed earlier ({type(err).__name__})")
                self.on_failure("the FP32 trajectory control", err)
                refined = replace(refined, evidence={**refined.evidence, "trajectory_control": f"failed: {err}"})
        refined.evidence.pop("pattern_before_replay", None)
        if (not self.investigator.automatic and self.investigator.localize and refined.location is None
                and refined.finding in LIVE_PROBED and self.world_size == 1):
            self._awaiting_probe.append(refined)  # published after the next step, with its location
            self._probe_next = True
            return None, renamed
        if not self.investigator.automatic and refined.location is None:  # several ranks: no live probe either
            refined = in_training_step(refined, self._training_step(),
                                       "no replay and no live probe (several ranks: each would watch its own step)")
        return refined, renamed

    def investigate_divergence(self, diagnosis: Diagnosis, alarm_step: int,
                               trajectory: "TrajectoryControl | None") -> Diagnosis:
        """A finite divergence is named by its losses alone; where a snapshot from before it is held, the FP32
        trajectory and the lower-LR counterfactual from it are added as evidence (each rank on its own: the ranks
        see their own losses, so no collective is made)."""
        if trajectory is None:
            return diagnosis
        if self.world_size > 1:  # a rank restoring a snapshot alone could wait on the others (sharded snapshots)
            return replace(diagnosis, evidence={**diagnosis.evidence, "trajectory_control": (
                "not run: under DDP each rank finds a finite divergence in its own losses, and a replay is made by "
                "every rank together or by none")})
        try:
            reference = self.machine.reference_for(diagnosis.step)
            return trajectory.judgement.judge(diagnosis, alarm_step, None if reference is None else reference.level,
                                              agree=False, rename=False)[0]
        except Exception as err:  # noqa: BLE001 - the alarm stands without the replays
            trajectory.ring.turn_off(f"the trajectory control failed earlier ({type(err).__name__})")
            self.on_failure("the FP32 trajectory control", err)
            return diagnosis

    def _collect(self, step: Any, weights_stepped: bool, agree: bool) -> ReplayRecord | None:
        """Replay the step; a failure switches replays off for the rest of the run, on every rank alike."""
        investigator = self.investigator
        if investigator is None:
            return None
        level, origin = self.machine.loss_level, LevelOrigin.HEALTHY
        if level is None and self.machine.start_loss is not None:
            level, origin = self.machine.start_loss, LevelOrigin.FIRST_LOSS
        # the healthy level before the first sign of what is replayed (the onset is not known yet: this step, or
        # the skips just before it); carried in the record so that every rank publishes the investigating rank's
        reference = self.machine.reference_evidence(self.machine.first_sign(step.opened.step))
        try:
            return investigator.collect(step.opened.batches, scale=step.opened.scale, fault_ranks=step.fault_ranks,
                                        weights_stepped=weights_stepped, loss_level=level, agree=agree,
                                        loss_level_origin=origin, reference=reference)
        except Exception as err:  # noqa: BLE001 - degrade to watching, never to a crash
            self.investigator = None
            self.on_failure("the replay of the faulty batch", err)
            return None

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer of the armed step is about to step: the live probe notes that optimizer's gradients."""
        if self._live_probe is not None:
            self._live_probe.optimizer_step(optimizer)

    def finish_probe(self) -> list[Diagnosis]:
        """The armed step's ``training_step`` is over (or the fit ended): the diagnoses that waited for its probe."""
        probe, self._live_probe = self._live_probe, None
        if probe is None and not self._awaiting_probe:
            return []
        seen = probe.finish() if probe is not None else (None, None, [])
        waiting, self._awaiting_probe = self._awaiting_probe, []
        return [located_live(diagnosis, *seen, outside=self._training_step()) for diagnosis in waiting]

    def _training_step(self) -> str | None:
        """Where the model's own step code runs (``<Model>.training_step``; the adapter's name for it, if any)."""
        investigator = self.investigator
        if investigator is None:
            return None
        if investigator.outside_modules is not None:
            return investigator.outside_modules()
        return f"{sharding.class_name(investigator.module)}.training_step"

    @property
    def probing(self) -> bool:
        return self._live_probe is not None

    def close(self) -> None:
        """Remove any armed hook without reading it (teardown)."""
        if self._live_probe is not None:
            self._live_probe.close()
            self._live_probe = None


#: Findings a param group added at a far higher LR just before the onset is looked at before.
_RISE_FIRST = {Finding.GRADIENT_OVERFLOW, Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.GROWTH_OVERFLOW}
