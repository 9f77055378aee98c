"""What happens on the first alarm of an episode: localise (which module, which parameter) and run the FP32
control, on the rank(s) where the fault arose, then agree on one answer across ranks; for an alarm that blames
reduced precision, the FP32 trajectory control (:class:`TrajectoryControl`, owned by the core) has the last word.

Bounded by construction: it runs once per new alarm, and the machine raises an alarm once per episode. What it
concludes comes back as records (the refined diagnosis with its :class:`~lightning_ampwatch.records.Facts`, the
finding to rename); the core tells the machine.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from lightning_ampwatch import compat, deepspeed_state, distributed, protocol, sharding
from lightning_ampwatch.steps.cadence import SnapshotCadence
from lightning_ampwatch.machine import BatchStats, PrecisionMode, Thresholds
from lightning_ampwatch.signals import float_tensors, inspect_batch
from lightning_ampwatch.remedies.precision import bf16_supported
from lightning_ampwatch.probes import (
    FP16_MAX,
    LiveProbe,
    MicroBatch,
    Replayer,
    ReplayResult,
    capture_rng,
    tensors_in,
)
from lightning_ampwatch.trajectory import SnapshotRing, TrainState, replay_trajectory
from lightning_ampwatch.interventions import Intervention, InterventionReport, Interventions, decide
from lightning_ampwatch.records import ControlVerdict, facts_of
from lightning_ampwatch.taxonomy import (
    Diagnosis,
    DivergencePattern,
    Finding,
    GradientPattern,
    LrEvent,
    advise,
    format_pow2,
)
from lightning_ampwatch.verdicts import (
    AMP_BLAMING,
    LOWER_LR_FACTOR,
    LevelOrigin,
    LowerLrKind,
    LowerLrVerdict,
    TrajectoryKind,
    TrajectoryResult,
    TrajectoryVerdict,
    control_result,
    fp32_reference,
    judge_lower_lr,
    judge_trajectory,
    trains_down,
)

#: Findings located by the first non-finite forward output, and by the first non-finite gradient.
_FORWARD = {Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.DATA_NONFINITE, Finding.FP32_UNSTABLE}
_BACKWARD = {Finding.GRADIENT_OVERFLOW, Finding.GROWTH_OVERFLOW}
_INVESTIGATED = _FORWARD | _BACKWARD | {Finding.LR_SCHEDULE}
#: Why a rank may not replay with the others (said in the evidence where it would have had to).
_APART = ("the ranks do not meet this anomaly together (no scaler, or another rank's AmpWatch switched itself "
          "off)")
#: Alarms a live probe of the next step can locate when the faulty step cannot be replayed.
LIVE_PROBED = _BACKWARD | {Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.LR_SCHEDULE}


@dataclass
class ReplayRecord:
    """What the replay of a faulty step found, agreed across ranks: evidence for the diagnosis, where the fault
    sits, and the FP32 control's numbers for the verdict."""

    evidence: dict[str, Any] = field(default_factory=dict)
    module: str | None = None  # the first module whose output went non-finite from finite inputs
    param: str | None = None  # the first parameter whose gradient went non-finite, in backward order
    control_loss: float | None = None
    control_grads_finite: bool | None = None
    loss_level: float | None = None  # the investigating rank's healthy loss level (else its first loss)
    loss_level_origin: LevelOrigin = LevelOrigin.HEALTHY  # which of the two ``loss_level`` is
    error: str | None = None  # the replay failed on this rank


class _CapTooSmall(Exception):
    """The replay-step cap cannot hold the window twice (nothing changed and FP32): the replays are not run."""


class InvestigationError(RuntimeError):
    """A replay failed on some rank; raised on every rank alike so that all of them stop replaying together."""


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
                f"not run: the model is sharded, so a replay's forward talks to every rank, and {_APART}: a replay on "
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
            level_origin=record.loss_level_origin, amp_nonfinite=_replay_went_nonfinite(record),
        )
        finding = control.finding
        ev["control_verdict"] = control.reason
        where = str(ev.get("input_where")).rsplit(": ", 1)[-1]  # ("rank 1: batch[0]" under DDP)
        if finding is Finding.INPUT_RANGE and isinstance(ev.get("reduced_precision_inputs"), list) \
                and where not in ev["reduced_precision_inputs"]:
            # the large values never enter a float16 op (a target used in a float32 loss): not an input-range fault
            finding = Finding.FORWARD_OVERFLOW if _replay_went_nonfinite(record) and record.module is not None \
                else Finding.GRADIENT_OVERFLOW
            ev["input_not_in_reduced_precision"] = (
                f"{ev.pop('input_where', None)} holds values up to {ev.pop('input_absmax', 0):.3g}, but the replay "
                "shows it enters no float16 op (it is used in float32 only)")
        if loss_level is not None:
            ev["loss_level"] = loss_level
            if record.loss_level_origin is not LevelOrigin.HEALTHY:
                ev["loss_level_from"] = record.loss_level_origin.words
        finding = _gradient_scale_evidence(finding, ev)
        if batch is not None and batch.nonfinite:
            ev.setdefault("nonfinite_where", batch.nonfinite_where)
        if finding is Finding.DATA_NONFINITE:
            location = diagnosis.location  # the data, not a module: where is in evidence["nonfinite_where"]
        else:
            location = record.param if finding in _BACKWARD else record.module
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
            if amp.error is not None:  # a sharded replay failed on some rank: every rank says so, and goes no further
                ev["replay"] = f"failed: {amp.error}"
                if self.control:
                    ev["fp32_control"] = f"not run: {amp.error}"
                return out
            ev.update(_replay_evidence(amp, "replay"))
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


class ReducedInputs(torch.overrides.TorchFunctionMode):
    """Which of the batches' float tensors enter a reduced-precision op in a replay: a torch function that takes one
    (or a float32 tensor computed from one) and returns a float16/bfloat16 tensor. A target used only in a float32
    loss never does. Alarm-time only (the probe's replay)."""

    def __init__(self, batches: Sequence[MicroBatch]) -> None:
        super().__init__()
        self.paths: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []  # the traced tensors stay alive, so that their ids stay theirs
        for i, mb in enumerate(batches):
            prefix = "batch" if len(batches) == 1 else f"micro_batch[{i}]"
            for path, t in float_tensors(mb.batch, prefix):
                self.paths[id(t)] = path
                self.keep.append(t)
        self.reduced: list[str] = []
        self.seen: set[str] = set()  # the batch paths some op took: none means the batch reached the model copied

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paths:
            return out
        found = {self.paths[id(t)] for t in tensors_in((args, kwargs or {})) if id(t) in self.paths}
        if found:
            self.seen.update(found)
            outs = [t for t in tensors_in(out) if isinstance(t, torch.Tensor)]
            if any(t.dtype in (torch.float16, torch.bfloat16) for t in outs):
                self.reduced.extend(p for p in sorted(found) if p not in self.reduced)
            else:  # a float32 derivation (a normalisation, a slice): followed on
                path = sorted(found)[0]
                for t in outs:
                    if t.is_floating_point():
                        self.paths[id(t)] = path
                        self.keep.append(t)
        return out

    def entered(self) -> list[str] | None:
        """The paths that entered a reduced-precision op; None when no op took any of the batch's own tensors (a
        wrapper copied them on the way, as DDP may): then nothing is known, and nothing is concluded."""
        return list(self.reduced) if self.seen else None


#: The measured safe scale keeps the largest parameter gradient this many times under float16's maximum: the
#: activations' gradients, which the replay does not see, can be larger.
SAFE_SCALE_MARGIN = 2.0


def _gradient_scale_evidence(finding: Finding, ev: dict[str, Any]) -> Finding:
    """What the replay's gradients say about the loss scale. Gradients that overflow at scale 1 are an
    ``unscaled_overflow``: no loss scale helps, whatever the scaler's history suggested. Otherwise the largest
    power of two that keeps the largest gradient under float16's maximum (with a margin) is the measured safe
    scale, in place of the scaler's history, which only knows the scales that once held: the gradients may have
    grown since (after an LR rise, say). A start-up streak judged when it ended keeps the scale the scaler settled
    at, measured on these very weights; one decided early (to be remedied at once) has none yet and takes the
    measured one."""
    if finding in _BACKWARD and (ev.get("replay_unscaled_grads_finite") is False or (
            ev.get("replay_grads_finite") is False and ev.get("scale") == 1.0)):
        if ev.get("pattern") not in (None, GradientPattern.UNSCALED_OVERFLOW.value):
            ev["pattern_before_replay"] = ev["pattern"]  # for the interventions, should a lower scale hold
        ev["pattern"] = GradientPattern.UNSCALED_OVERFLOW.value
        ev.pop("safe_scale", None)
        return Finding.GRADIENT_OVERFLOW
    absmax = ev.get("replay_grad_absmax")
    settled = ev.get("pattern") == GradientPattern.STARTUP and "safe_scale" in ev
    wanted = "safe_scale" in ev or finding is Finding.GRADIENT_OVERFLOW
    if wanted and not settled and isinstance(absmax, (int, float)) and 0 < absmax < math.inf:
        ev["safe_scale"] = 2.0 ** math.floor(math.log2(FP16_MAX / absmax)) / SAFE_SCALE_MARGIN
        ev["safe_scale_from"] = f"the replay's largest unscaled gradient ({absmax:.4g}), with a {SAFE_SCALE_MARGIN:g}x margin"
        replayed_at = ev.get("scale")
        if ev.get("replay_grads_finite") is False and isinstance(replayed_at, (int, float)) \
                and 0 < replayed_at <= ev["safe_scale"]:
            # the replay overflowed at this very scale: an intermediate gradient (in a model computing wholly in
            # float16, DeepSpeed's) was larger than any parameter's, so the parameters' say nothing safe above it
            ev["safe_scale"] = 2.0 ** math.floor(math.log2(replayed_at)) / 2
            ev["safe_scale_from"] = (f"half the scale the replay's gradients overflowed at ({format_pow2(replayed_at)}"
                                     f"; its largest parameter gradient, {absmax:.4g}, would have allowed more)")
    return finding


def _data_steps(steps: Sequence[tuple[int, Sequence[Any]]]) -> list[int]:
    """The steps of a replay window whose batches hold NaN/inf (one device read per tensor: on an alarm only)."""
    return [step for step, micro_batches in steps
            if micro_batches and inspect_batch([mb[0] for mb in micro_batches]).nonfinite]


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


def _replay_went_nonfinite(record: ReplayRecord) -> bool:
    """Whether the replay at the run's own precision went non-finite: a module's output, or the loss."""
    loss = record.evidence.get("replay_loss")
    return record.module is not None or (isinstance(loss, float) and not math.isfinite(loss))


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
    if diagnosis.finding in _BACKWARD:
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
        if diagnosis.evidence.get("pattern") == DivergencePattern.FINITE_DIVERGENCE.value:
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
        added = _added_group(trajectory, diagnosis.step, self.machine) if refined.finding in _RISE_FIRST else None
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
        if trajectory is not None and (refined.finding in AMP_BLAMING or refined.finding is Finding.LR_SCHEDULE):
            # an LR rise is timing, not a measurement: the interventions decide whether the LR is the cause
            try:
                reference = self.machine.reference_for(diagnosis.step)
                refined, renamed_again = trajectory.judge(refined, step.opened.step,
                                                          None if reference is None else reference.level,
                                                          agree=agree, fault_ranks=step.fault_ranks)
                renamed = renamed_again or renamed
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
            return trajectory.judge(diagnosis, alarm_step, None if reference is None else reference.level,
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


#: Which verdict stands when the ranks disagree: a rank whose FP32 run fails clears AMP for all; one that
#: reproduces the fault confirms it over ranks that did not.
_VERDICT_ORDER = (TrajectoryKind.FP32_NONFINITE, TrajectoryKind.FP32_DIVERGES, TrajectoryKind.AMP_CONFIRMED,
                  TrajectoryKind.NOT_REPRODUCED)
_RENAMED_BY = {TrajectoryKind.FP32_NONFINITE: Finding.FP32_UNSTABLE, TrajectoryKind.FP32_DIVERGES: Finding.FP32_UNSTABLE,
               TrajectoryKind.NOT_REPRODUCED: Finding.NOT_REPRODUCED}


class TrajectoryControl:
    """The true FP32 control: snapshots every ``every`` steps within a memory budget, and, for an alarm that blames
    reduced precision, the steps since the newest snapshot before the onset run again in FP32 and at the run's own
    precision (then the live state is put back exactly). Its verdict is the one that stands."""

    def __init__(self, ring: SnapshotRing, state: TrainState, divergence_ratio: float,
                 say: Callable[[str], None], adaptive: bool = False,
                 on_failure: Callable[[str, Exception], None] | None = None,
                 fall_margin: float = Thresholds.fall_margin,
                 lr_cause_margin: float = Thresholds.lr_cause_margin,
                 thresholds: Thresholds | None = None) -> None:
        self.ring = ring
        thresholds = thresholds or Thresholds()
        self.replay_steps = thresholds.replay_steps  # the interventions' replay-step cap per alarm
        self.replay_past = thresholds.replay_past
        self.bf16 = bf16_supported(state.device) and state.scaler is not None  # bf16 is tried where fp16 failed
        self.state = state
        self.divergence_ratio = divergence_ratio
        self.fall_margin = fall_margin  # Thresholds.fall_margin: a decisive fall of an FP32 replay with no level
        self.lr_cause_margin = lr_cause_margin  # Thresholds.lr_cause_margin: what the lower-LR verdict needs
        self.say = say
        self.on_failure = on_failure  # the callback's: a failure is reported once, the watch goes on
        if state.unavailable is not None:
            ring.turn_off(state.unavailable)  # said in the evidence of each alarm it would have judged
        self.paused = False  # while a remedy is watched: a snapshot of a run not yet known to be healthy is no base
        # ``snapshot_every="auto"``: the interval is lengthened from what the first snapshots cost (one process
        # only: under DDP the ranks must snapshot at the same steps, and the interval asked for stays)
        self.cadence = SnapshotCadence(ring.every) if adaptive and distributed.world_size() == 1 else None
        self._last_snapshot: tuple[int, float] | None = None  # (step, clock) at the end of the latest one timed
        #: while the cadence measures: (step, clock) at the end of every step since the latest snapshot, so that a
        #: snapshot is timed as what its whole step costs over an ordinary one (cache effects and all)
        self._step_ends: list[tuple[int, float]] | None = [] if self.cadence is not None else None
        self.start_step = 0  # the first step of this fit (its starting state is snapshotted before it)
        self.keep = ring.keep

    def start(self, global_step: int) -> None:
        """The fit starts (or resumes) at ``global_step``: a snapshot of the state before its first step, so that an
        episode at that very step has a state to replay from and to roll back to."""
        ring = self.ring
        self.start_step = global_step
        if not ring.enabled:
            return
        try:
            ring.after_step(global_step - 1, self.state, due=True)
        except Exception as err:  # noqa: BLE001 - a failed snapshot costs the control, never the run
            self._failed(err)
            return
        if not ring.enabled:
            self.say(f"{ring.reason}. The FP32 control falls back to replaying the faulty batch alone, and the "
                     "loss trend still separates divergence from overflow.")

    def _failed(self, err: Exception) -> None:
        """A snapshot failed: the ring is off for the run with the real reason, and the failure reported once."""
        self.ring.turn_off(f"the snapshot ring is off for this run: a snapshot failed ({type(err).__name__}: {err})")
        if self.on_failure is not None:
            self.on_failure("a snapshot for the FP32 trajectory control", err)

    def note_step(self, step: int, batches: Sequence[Any], quiet: bool, known: bool = True) -> None:
        """Optimizer step ``step`` is over: keep its batches, and take a snapshot when one is due (only while nothing
        is in progress, ``quiet``: a snapshot of a faulty state is no control). Until a healthy loss level is
        ``known``, the fit's starting state is the only one known to be healthy: no snapshot may push it out of the
        ring (the losses since are not read yet, and may be climbing)."""
        ring = self.ring
        if not ring.enabled:
            return
        try:
            ring.add_batches(step, batches)
            if quiet and not self.paused and step % ring.every == 0:  # due (the ring's rule, checked here: per step)
                held = ring.snapshots
                keep_start = not known and bool(held) and held[0].step == self.start_step - 1
                ring.keep = self.keep + 1 if keep_start else self.keep  # the start state, and the newest as ever
                if not keep_start or len(held) < ring.keep:
                    if self.cadence is None or self.cadence.decided:
                        ring.after_step(step, self.state)
                    else:
                        self._timed_snapshot(step)
        except Exception as err:  # noqa: BLE001 - the step is still taken in by the ledger: never drop it
            self._failed(err)
            return
        if not ring.enabled:  # the budget turned it off just now (``say`` says a line once)
            self.say(f"{ring.reason}. The FP32 control falls back to replaying the faulty batch alone, and the "
                     "loss trend still separates divergence from overflow.")
            return
        ends = self._step_ends
        if ends is not None:  # the cadence is measuring (the first few snapshots' spans only)
            ends.append((step, time.perf_counter()))
            if len(ends) > 4 * ring.every:  # no snapshot for long (a stretch of trouble): the newest suffice
                del ends[:-ring.every]

    def note_run(self, steps: Sequence[int], batches: Sequence[Any]) -> None:
        """:meth:`note_step` for a run of clean steps taken in later (their steps and batches, in order): the batches
        kept. The core defers no step a snapshot is due at, and none while the cadence measures (its clock
        is read at each step's end), so keeping the batches is all :meth:`note_step` would do for them."""
        ring = self.ring
        if not ring.enabled:
            return
        try:
            ring.add_run(steps, batches)
        except Exception as err:  # noqa: BLE001 - as note_step
            self._failed(err)
            return
        if not ring.enabled:
            self.say(f"{ring.reason}. The FP32 control falls back to replaying the faulty batch alone, and the "
                     "loss trend still separates divergence from overflow.")

    @property
    def defer_limit(self) -> int | None:
        """For the core's deferral: the interval the next snapshot is due at a multiple of, 0 when clean steps may
        not be deferred at all (the cadence is measuring: each step's end is timed), None when no snapshot is
        taken."""
        ring = self.ring
        if not ring.enabled:
            return None
        if self._step_ends is not None:
            return 0
        return ring.every

    def _timed_snapshot(self, step: int) -> None:
        """A snapshot that is due, timed for the cadence, which sets the interval (once, said once).

        What a snapshot costs is what its step takes over an ordinary step of the same span: the step from the end
        of the one before it to the end of the snapshot, less the fastest of the span's steps (the copy's own time
        when that is more; load from elsewhere only adds time, so the fastest step is the ordinary one's best
        estimate, and the cadence keeps the lowest of these costs). Timing the copy alone, cache-warm, reads
        several times lower than a snapshot step costs in the run: the copy and its bookkeeping run once in many
        steps, from a cold cache. A snapshot without an ordinary step measured before it (the first of the run)
        only starts the span. The healthy step the copy is set against is the median of the span's ordinary steps
        (at most the span's mean): a few steps that load from elsewhere stretched to several times the rest would
        otherwise raise the mean, and shorten the interval, on a busy machine."""
        assert self.cadence is not None
        ring, last, ends = self.ring, self._last_snapshot, self._step_ends or []
        start = time.perf_counter()
        ring.after_step(step, self.state)
        end = time.perf_counter()
        if not ring.enabled:
            return
        ordinary = [t1 - t0 for (s0, t0), (s1, t1) in zip(ends, ends[1:]) if s1 == s0 + 1]
        before = ends[-1][1] if ends and ends[-1][0] == step - 1 else None
        self._step_ends = []  # the next span starts with this step (note_step adds its end)
        if before is None or not ordinary:
            self._last_snapshot = None
            return
        copy_s = max(end - start, (end - before) - min(ordinary))
        self._last_snapshot = (step, end)
        span = (end - last[1], step - last[0]) if last is not None else (None, 0)
        per_step = ring.step_batch_bytes  # the most one step's batches held: the memory bound
        room = (ring.budget_bytes - ring.bytes_per_snapshot) // per_step if per_step else None
        said = self.cadence.observe(copy_s, *span, room_steps=room, step_s=statistics.median(ordinary))
        if self.cadence.decided:
            ring.every = self.cadence.every
            # the bound on held steps follows the interval (as the ring sets it from the one it was made with): a
            # longer interval under the old bound let every snapshot go before the next was due
            ring.max_held_steps = max(ring.max_held_steps, ring.every * (self.keep + 2))
            self._step_ends = None  # measured: no clock on the steps from here on
        if said is not None:
            self.say(said)

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
              rename: bool = True, fault_ranks: Sequence[int] = ()) -> tuple[Diagnosis, Finding | None]:
        """The diagnosis with the trajectory's verdict (and the finding it renames, if it does). ``loss_level`` is
        the healthy level from before the onset, or None when there was none (the FP32 run is then judged by its
        own shape). Three replays from the newest snapshot from before the step whose update may have done the
        damage: FP32, the run's own precision, and the run's own precision with the learning rate lowered (the
        counterfactual: does a lower LR train clean?). ``rename=False``: evidence only (a finite divergence,
        already named by its loss). Where every rank replayed (``agree``), the gravest verdict stands; among
        equally grave ones, a rank at fault's (its batches are the ones that went wrong), and the evidence names
        the rank."""
        ev = dict(diagnosis.evidence)
        unavailable = self.state.replay_unavailable or self.state.fp32_unavailable
        if unavailable is not None:  # the same on every rank: none of them gathers below
            ev["trajectory_control"] = f"not run: {unavailable}"
            return replace(diagnosis, evidence=ev), None
        before = max(diagnosis.step - 1, 0)
        snapshot = self.ring.newest_before(before) if self.ring.enabled else None
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
                                            f"{_APART}: a replay on this rank alone would wait for the others")
                return replace(diagnosis, evidence=ev), None
            if self.state.split:
                ev["trajectory_control"] = (f"not run: each rank holds part of the snapshot, so a restore talks to "
                                            f"every rank, and {_APART}: a restore on this rank alone would wait for "
                                            "the others")
                return replace(diagnosis, evidence=ev), None
            # a replay on this rank alone has no gradient all-reduce: its trajectory is not the run's (the other
            # ranks' gradients, a NaN among them, are missing), so no verdict on the run can be drawn from it
            ev["trajectory_control"] = (f"not run: {_APART}, and a replay on this rank alone would train on its own "
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
        local: tuple[TrajectoryVerdict, LowerLrVerdict, bool] | str | None = None  # the verdicts, or an error
        if snapshot is None:
            reason = disagreed or self._no_snapshot(before, diagnosis.step)
            ev["trajectory_control"] = f"not run: {reason}"
        else:
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
                nothing_nonfinite = _replay_went_nonfinite(facts.replay) if facts.replay is not None else False
                # which replays run must be every rank's alike (their collectives meet): under several ranks only the
                # agreed replay record says whether the fault is in the forward pass, not this rank's own losses
                forward = nothing_nonfinite or (alone and ev.get("first_nonfinite_step") is not None)
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
                        onset_scale=_number(ev.get("onset_scale")) or _number(ev.get("scale")) or (
                            _number(snapshot.scaler_state_dict().get("scale")) if snapshot.scaler is not None else None),
                        scale_hint=_number(ev.get("safe_scale")),
                        scaled=state.scaler is not None, from_step=snapshot.step, onset=diagnosis.step,
                        repeated_from=repeated_from, lr_factor=_lower_lr_factor(ev), lr_cap=_lr_cap(ev),
                        lr_rose=_lr_rise(ev) is not None, unlocated=unlocated,
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
                local = (verdict, lower_verdict, trains_down(fp32), report)
            except _CapTooSmall as err:  # the same on every rank: a reason, not a failure
                local = err
            except InvestigationError as err:  # a replay's own error, as it was raised
                local = str(err)
            except Exception as err:  # noqa: BLE001 - every rank must still reach the gather below
                local = f"{type(err).__name__}: {err}"
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
        finding, location = self._by_interventions(report, verdict, diagnosis, ev, finding, location)
        facts = replace(facts, interventions=report)
        renamed = finding if finding is not diagnosis.finding else None
        if renamed is not None and finding not in AMP_BLAMING:
            supersede_amp_evidence(ev, diagnosis.finding)
        return replace(diagnosis, finding=finding, location=location, evidence=ev, advice=advise(finding, ev),
                       facts=facts), renamed

    def _by_interventions(self, report: InterventionReport, verdict: TrajectoryVerdict, diagnosis: Diagnosis,
                          ev: dict[str, Any], finding: Finding, location: str | None) -> tuple[Finding, str | None]:
        """What cured decides (:func:`~lightning_ampwatch.interventions.decide`): the finding, its location and
        reason, the co-factors; the safe scale is the one measured over the window. Evidence written in place."""
        ev["interventions"] = report.evidence()
        ev["tried"] = report.headline()  # the panel's one line per intervention
        a, b = report.window
        if report.safe_scale is not None:
            ev["safe_scale"] = report.safe_scale
            ev["safe_scale_from"] = (f"the largest loss scale that replayed steps {a}-{b} from the snapshot without a "
                                     "skip" + ("" if report.safe_scale_bounded else (
                                         f" among those tried ({format_pow2(2 * report.safe_scale)} was not: the "
                                         "replay-step cap)")))
            if ev.get("pattern") == GradientPattern.UNSCALED_OVERFLOW.value:
                # the single step's gradients overflowed at scale 1, but a lower scale ran the whole window clean
                ev["pattern"] = ev.pop("pattern_before_replay", GradientPattern.STARTUP.value)
        elif report.safe_scale_tried:
            ev.pop("safe_scale", None)  # measured: no scale tried held, whatever one step suggested
            low = [s for s, ok in report.safe_scale_tried if not ok and s <= 1.0]
            if ev.get("pattern") == GradientPattern.UNSCALED_OVERFLOW.value and not low:
                # "no scaler setting can help" only where replays at scales of 1 and below were measured to fail
                ev["pattern"] = ev.pop("pattern_before_replay", GradientPattern.STARTUP.value)
            ev["safe_scale_from"] = (f"none: no loss scale tried ({', '.join(format_pow2(s) for s, _ in report.safe_scale_tried)}) "
                                     f"replayed steps {a}-{b} without a skip")
        ev.pop("pattern_before_replay", None)
        fp32_failed = verdict.kind in (TrajectoryKind.FP32_NONFINITE, TrajectoryKind.FP32_DIVERGES)
        facts = facts_of(diagnosis)
        located = location if finding not in _BACKWARD else (facts.replay.module if facts.replay else None)
        nothing = report.get(Intervention.NOTHING)
        decision = decide(report, finding=finding, located=located, lr_rise=_lr_rise(ev),
                          batch_nonfinite=bool(ev.get("nonfinite_where")),
                          forward=bool(nothing is not None and nothing.nonfinite) or (
                              facts.replay is not None and _replay_went_nonfinite(facts.replay)),
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
        if decision.finding is not Finding.GRADIENT_OVERFLOW:
            ev.pop("safe_scale", None) if decision.finding not in AMP_BLAMING else None
        return decision.finding, decision.location or location


#: Findings a param group added at a far higher LR just before the onset is looked at before.
_RISE_FIRST = {Finding.GRADIENT_OVERFLOW, Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.GROWTH_OVERFLOW}
#: A new param group counts as an LR rise when its LR is at least this many times the others' largest.
ADDED_GROUP_RATIO = 10.0


def _added_group(trajectory: Any, onset: int, machine: Any) -> dict[str, Any] | None:
    """The LR evidence of a param group added within ``Thresholds.lr_lookback`` steps before ``onset`` (or at it)
    whose LR is at least :data:`ADDED_GROUP_RATIO` times the largest LR of the groups before it (Lightning's
    ``BackboneFinetuning`` unfreezing a backbone at a high LR), from the LRs each step ran with; None otherwise."""
    log = getattr(getattr(trajectory, "state", None), "lr_log", None)
    by_step: dict[int, tuple[float, ...]] = {}
    for point, lrs in getattr(log, "entries", ()) or ():
        by_step[point] = lrs  # the last read of a step wins (after a rollback, points are read again)
    entries = sorted(by_step.items())
    lookback = getattr(getattr(machine, "thresholds", None), "lr_lookback", Thresholds.lr_lookback)
    for (_, before), (point, after) in zip(entries, entries[1:]):
        if not (onset - lookback <= point <= onset) or len(after) <= len(before) or not before:
            continue
        old, new = max(before), max(after[len(before):])
        if old > 0 and new >= ADDED_GROUP_RATIO * old:
            return {"lr_event": LrEvent.PARAM_GROUP_ADDED.value, "lr_before": old, "lr_after": new,
                    "lr_change_step": point}
    return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _lower_lr_factor(ev: dict[str, Any]) -> float:
    """The lower-LR intervention's factor: a tenth, or after a known rise of more than 10x, the factor that undoes
    it (the counterfactual "without the rise")."""
    before, after = _number(ev.get("lr_before")), _number(ev.get("lr_after"))
    if before is not None and after is not None and after > 0 and 0 < before < after:
        return min(LOWER_LR_FACTOR, before / after)
    return LOWER_LR_FACTOR


def _lr_cap(ev: dict[str, Any]) -> float | None:
    """After a rise of more than 10x, the LR before it: the lower-LR intervention then replays the window with no LR
    above it (the counterfactual "without the rise", as ``reduce_lr``'s ceiling would run it). None otherwise."""
    before, after = _number(ev.get("lr_before")), _number(ev.get("lr_after"))
    if before is not None and after is not None and 0 < before and after > before / LOWER_LR_FACTOR:
        return before
    return None


def _lr_rise(ev: dict[str, Any]) -> str | None:
    """The LR rise before the onset the machine noted, in words ("0.0006 -> 0.0018 at step 8"), or None."""
    before, after = _number(ev.get("lr_before")), _number(ev.get("lr_after"))
    if before is None or after is None or not after > before:
        return None
    at = ev.get("lr_change_step")
    return f"{before:.3g} -> {after:.3g}" + (f" at step {at}" if isinstance(at, int) else "")


#: Evidence that only means something for a finding that blames reduced precision: once the finding is renamed to
#: one that does not, it moves under ``superseded_amp_evidence``, so that no one reads it as the diagnosis.
AMP_ONLY_EVIDENCE = ("pattern", "safe_scale", "safe_scale_from", "scale_history", "onset_scale", "skip_rate",
                     "window", "growth_steps", "span", "batch_control_verdict", "growth_interval", "growth_factor",
                     "backoff_factor")


def supersede_amp_evidence(ev: dict[str, Any], was: Finding) -> None:
    """Move the evidence of the AMP finding ``was`` (its overflow pattern, its safe scale, the single-batch verdict
    that blamed AMP) under ``superseded_amp_evidence``, in place."""
    moved = {k: ev.pop(k) for k in AMP_ONLY_EVIDENCE if k in ev}
    if moved:
        ev["superseded_amp_evidence"] = {"was": was.value, **moved}
