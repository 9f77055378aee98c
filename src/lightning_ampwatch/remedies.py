"""Fixes AmpWatch can apply mid-run, and the policy that picks one for a finding.

Each remedy is a small unit that applies itself at an optimizer-step boundary, says what it changed (before and
after), and can put itself back after a resume. The policy is a table: finding -> ordered ladder of remedies;
when a finding comes back after a remedy, the next rung applies; when no allowed rung is left, the finding is
unrecoverable and ``on_unrecoverable`` decides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from lightning_ampwatch.taxonomy import Diagnosis, Finding


class RemedyError(RuntimeError):
    """A remedy could not be applied here (e.g. bf16 on a device without it); the finding stays unrecoverable."""


@dataclass
class RemedyContext:
    """What a remedy may act on. Built by the callback; plain attributes so remedies stay testable."""

    trainer: Any
    module: nn.Module
    scaler: Any  # torch.amp.GradScaler or None
    device: torch.device
    safe_scale: float | None = None  # the largest scale at which a step went through


@dataclass
class AppliedRemedy:
    """A remedy as it was applied (``step``: the first optimizer step run with it in effect; the finding's onset
    is the diagnosis's step): enough to show the user and to put it back after a resume."""

    name: str
    step: int
    finding: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "finding": self.finding, "details": dict(self.details)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AppliedRemedy":
        return cls(str(data["name"]), int(data["step"]), str(data["finding"]), dict(data.get("details", {})))


def _pow2_floor(value: float) -> float:
    return float(2.0 ** math.floor(math.log2(value))) if value > 0 else 1.0


def _require_scaler(ctx: RemedyContext) -> Any:
    if ctx.scaler is None:
        raise RemedyError("there is no GradScaler in this run")
    return ctx.scaler


def lower_init_scale(ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
    """Set the scale to the largest power of two that held, and make growth wait 4x longer so the scaler does not
    climb straight back into the overflow."""
    scaler = _require_scaler(ctx)
    before = float(scaler.get_scale())
    safe = diagnosis.evidence.get("safe_scale") or ctx.safe_scale
    target = _pow2_floor(float(safe)) if isinstance(safe, (int, float)) and safe > 0 else _pow2_floor(before / 2)
    target = min(target, _pow2_floor(before)) if before > 0 else target
    interval_before = int(scaler.get_growth_interval())
    scaler.update(new_scale=float(target))
    scaler.set_growth_interval(interval_before * 4)
    scaler._growth_tracker.zero_()
    return {"scale_before": before, "scale_after": target,
            "growth_interval_before": interval_before, "growth_interval_after": interval_before * 4}


def slow_growth(ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
    """Grow less often and by less. The tracker is reset on purpose: it counts clean steps towards the interval."""
    scaler = _require_scaler(ctx)
    interval, factor = int(scaler.get_growth_interval()), float(scaler.get_growth_factor())
    new_interval = max(interval * 10, 100)
    new_factor = max(1.0 + (factor - 1.0) / 2, 1.0001)
    scaler.set_growth_interval(new_interval)
    scaler.set_growth_factor(new_factor)
    scaler._growth_tracker.zero_()
    return {"growth_interval_before": interval, "growth_interval_after": new_interval,
            "growth_factor_before": factor, "growth_factor_after": new_factor}


class Fp32Island:
    """Forward pre/post hooks that run one module in float32 with autocast off, inside an autocast region.

    A callable object rather than a closure so that the model still deep-copies and pickles with it attached.
    """

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._contexts: list[Any] = []

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        ctx = torch.autocast(self.device_type, enabled=False)
        ctx.__enter__()
        self._contexts.append(ctx)
        return _to_float32(args), _to_float32(kwargs)

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._contexts:
            self._contexts.pop().__exit__(None, None, None)
        return output

    def __getstate__(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "_contexts": []}


def _to_float32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() and obj.dtype != torch.float32 else obj
    if isinstance(obj, tuple):
        return tuple(_to_float32(o) for o in obj)
    if isinstance(obj, list):
        return [_to_float32(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_float32(v) for k, v in obj.items()}
    return obj


ISLAND_ATTR = "_ampwatch_fp32_island"


def attach_island(module: nn.Module, name: str, device_type: str) -> None:
    """Make ``name`` (a qualified submodule name) an FP32 island; idempotent."""
    target = module.get_submodule(name) if name else module
    if getattr(target, ISLAND_ATTR, None) is not None:
        return
    island = Fp32Island(device_type)
    handles = (target.register_forward_pre_hook(island.pre, with_kwargs=True),
               target.register_forward_hook(island.post))
    setattr(target, ISLAND_ATTR, (island, handles))


def detach_island(module: nn.Module, name: str) -> None:
    target = module.get_submodule(name) if name else module
    entry = getattr(target, ISLAND_ATTR, None)
    if entry is not None:
        for handle in entry[1]:
            handle.remove()
        delattr(target, ISLAND_ATTR)


def _island_module_name(module: nn.Module, location: str | None) -> str:
    """The module to isolate: the location itself, or the module owning a located parameter."""
    if location is None:
        raise RemedyError("the overflow was not located in a module")
    names = dict(module.named_modules())
    if location in names:
        return location
    owner = location.rsplit(".", 1)[0] if "." in location else ""
    if owner in names and owner:
        return owner
    raise RemedyError(f"{location!r} is not a submodule of the model")


def fp32_island(ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
    name = _island_module_name(ctx.module, diagnosis.location)
    attach_island(ctx.module, name, ctx.device.type)
    return {"module": name}


def bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return device.type == "cpu"


def bf16_fallback(ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
    """Swap the trainer's precision plugin for bf16-mixed: bfloat16 has float32's range and needs no scaler."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    if not bf16_supported(ctx.device):
        raise RemedyError(f"bfloat16 autocast is not supported on {ctx.device}")
    strategy = ctx.trainer.strategy
    before = getattr(strategy.precision_plugin, "precision", "?")
    if before == "bf16-mixed":
        raise RemedyError("the run is already in bf16-mixed")
    strategy.precision_plugin = MixedPrecision("bf16-mixed", ctx.device.type)
    return {"precision_before": before, "precision_after": "bf16-mixed"}


LR_FACTOR = 0.5


def _lr_factor(diagnosis: Diagnosis) -> float:
    """Back to the level before the rise that set the fault off, when the evidence says what it was; else half."""
    before, after = diagnosis.evidence.get("lr_before"), diagnosis.evidence.get("lr_after")
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and after > 0 and 0 < before < after:
        return min(max(before / after, 0.01), LR_FACTOR)
    return LR_FACTOR


def reduce_lr(ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
    """Lower every learning rate, in the optimizers and in the schedulers' base values (so the schedule keeps the
    lower level instead of undoing it on its next step): back to the level before the rise, at least halved."""
    factor = _lr_factor(diagnosis)
    before, after = [], []
    for opt in ctx.trainer.optimizers:
        for group in opt.param_groups:
            before.append(float(group["lr"]))
            group["lr"] = group["lr"] * factor
            for key in ("initial_lr", "max_lr", "min_lr"):
                if isinstance(group.get(key), (int, float)):
                    group[key] = group[key] * factor
            after.append(float(group["lr"]))
    for config in getattr(ctx.trainer, "lr_scheduler_configs", []):
        sched = config.scheduler
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]
        if hasattr(sched, "_last_lr"):
            sched._last_lr = [lr * factor for lr in sched._last_lr]
    return {"lr_before": before, "lr_after": after, "factor": float(f"{factor:.6g}")}


def unscale_before_clip(ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
    """Clipping thresholds follow the scale from now on (see guards.ClipRescale), so clipping still-scaled
    gradients clips exactly what clipping unscaled gradients would have."""
    _require_scaler(ctx)
    return {"clip_threshold": "multiplied by the current loss scale"}


Apply = Callable[[RemedyContext, Diagnosis], dict[str, Any]]

REMEDIES: dict[str, Apply] = {
    "lower_init_scale": lower_init_scale,
    "slow_growth": slow_growth,
    "fp32_island": fp32_island,
    "bf16_fallback": bf16_fallback,
    "reduce_lr": reduce_lr,
    "unscale_before_clip": unscale_before_clip,
}
REMEDY_NAMES = tuple(REMEDIES)
DEFAULT_REMEDIES = tuple(r for r in REMEDY_NAMES if r != "reduce_lr")

#: finding -> the remedies to try, in order. Not-AMP findings have none: no AMP knob fixes data or divergence.
LADDERS: dict[Finding, tuple[str, ...]] = {
    Finding.GRADIENT_OVERFLOW: ("lower_init_scale", "bf16_fallback"),
    Finding.GROWTH_OVERFLOW: ("slow_growth", "lower_init_scale", "bf16_fallback"),
    Finding.FORWARD_OVERFLOW: ("fp32_island", "bf16_fallback"),
    Finding.INPUT_RANGE: ("bf16_fallback",),
    Finding.LR_SCHEDULE: ("reduce_lr",),
    Finding.CLIP_BEFORE_UNSCALE: ("unscale_before_clip",),
}


def ladder_for(diagnosis: Diagnosis) -> tuple[str, ...]:
    """The ladder for this diagnosis, trimmed of rungs that cannot help this particular case."""
    ladder = LADDERS.get(diagnosis.finding, ())
    if diagnosis.finding is Finding.GRADIENT_OVERFLOW and diagnosis.evidence.get("pattern") == "unscaled_overflow":
        ladder = tuple(r for r in ladder if r != "lower_init_scale")  # no scale can help: the gradients overflow
    if diagnosis.finding is Finding.FORWARD_OVERFLOW and not diagnosis.location:
        ladder = tuple(r for r in ladder if r != "fp32_island")
    return ladder


@dataclass
class RemedyPolicy:
    """Which remedy a diagnosis gets, given what is allowed and what was already tried for the same finding.

    A finding that comes back within ``escalation_window`` steps of its last remedy climbs to the next rung; one
    that comes back later starts again at the bottom (the earlier fix held for a long while).
    """

    allowed: frozenset[str]
    escalation_window: int = 500
    rungs: dict[str, tuple[int, int]] = field(default_factory=dict)  # finding -> (rung index, step applied)

    def choose(self, diagnosis: Diagnosis) -> tuple[int, str] | None:
        ladder = ladder_for(diagnosis)
        previous = self.rungs.get(diagnosis.finding.value)
        start = 0
        if previous is not None and diagnosis.step - previous[1] <= self.escalation_window:
            start = previous[0] + 1
        for index in range(start, len(ladder)):
            if ladder[index] in self.allowed:
                return index, ladder[index]
        return None

    def record(self, diagnosis: Diagnosis, index: int) -> None:
        self.rungs[diagnosis.finding.value] = (index, diagnosis.step)

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis, choice: tuple[int, str] | None,
              step: int) -> tuple[Diagnosis, AppliedRemedy | None]:
        """Apply ``choice``, or the next allowed rung above it when it cannot apply here; the diagnosis comes back
        with the remedy's name and details (and the rungs that failed), and the record of what was applied."""
        ladder = ladder_for(diagnosis)
        failures: list[str] = []
        while choice is not None:
            index, name = choice
            try:
                details = REMEDIES[name](ctx, diagnosis)
            except Exception as err:  # noqa: BLE001 - a remedy that cannot apply leaves the next rung
                failures.append(f"{name}: {err}")
                choice = next(((i, ladder[i]) for i in range(index + 1, len(ladder)) if ladder[i] in self.allowed),
                              None)
                continue
            self.record(diagnosis, index)
            evidence = {**diagnosis.evidence, "remedy_details": details}
            if failures:
                evidence["remedies_failed"] = failures
            applied = AppliedRemedy(name, step, diagnosis.finding.value, details)
            return replace(diagnosis, remedy=name, evidence=evidence), applied
        if failures:
            return replace(diagnosis, evidence={**diagnosis.evidence, "remedies_failed": failures}), None
        return diagnosis, None

    def state_dict(self) -> dict[str, Any]:
        return {"rungs": {k: list(v) for k, v in self.rungs.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rungs = {k: (int(v[0]), int(v[1])) for k, v in state.get("rungs", {}).items()}


def parse_remediate(remediate: Any) -> frozenset[str]:
    """``remediate=`` as a set of remedy names; ``ValueError`` naming the bad value and the valid ones."""
    if remediate is True:
        return frozenset(DEFAULT_REMEDIES)
    if remediate is False or remediate is None:
        return frozenset()
    if isinstance(remediate, str):
        remediate = [remediate]
    try:
        names: Sequence[Any] = list(remediate)
    except TypeError:
        raise ValueError(f"remediate={remediate!r} is not valid; use True, False or a list of {REMEDY_NAMES}") from None
    bad = [n for n in names if n not in REMEDIES]
    if bad:
        raise ValueError(f"remediate has unknown remedy {bad[0]!r}; valid names are {REMEDY_NAMES}")
    return frozenset(names)


class HoldLrOnSkip:
    """Stands in for ``LightningModule.lr_scheduler_step``: a step-interval scheduler does not advance when the
    scaler skipped the optimizer step it follows (as accelerate and DeepSpeed do).

    ``skipped`` answers whether the last optimizer step was skipped; it is the callback's host-side flag, so
    holding costs no device read (fused optimizers excepted: their flag is read here, once per step).
    A callable object, not a closure, so that the module still pickles while it is installed.
    """

    def __init__(self, original: Callable[[Any, Any], None], skipped: Callable[[], bool],
                 step_schedulers: Callable[[], Sequence[Any]]) -> None:
        self.original = original
        self.skipped = skipped
        self.step_schedulers = step_schedulers
        self.held = 0

    def __call__(self, scheduler: Any, metric: Any = None) -> None:
        if any(s is scheduler for s in self.step_schedulers()) and self.skipped():
            self.held += 1
            return
        self.original(scheduler, metric)

    @staticmethod
    def install(module: Any, skipped: Callable[[], bool], step_schedulers: Callable[[], Sequence[Any]]) -> "HoldLrOnSkip":
        holder = HoldLrOnSkip(module.lr_scheduler_step, skipped, step_schedulers)
        module.lr_scheduler_step = holder
        return holder

    @staticmethod
    def uninstall(module: Any) -> None:
        if isinstance(module.__dict__.get("lr_scheduler_step"), HoldLrOnSkip):
            del module.__dict__["lr_scheduler_step"]


def reapply_structural(ctx: RemedyContext, applied: Sequence[AppliedRemedy]) -> None:
    """On resume: what a checkpoint cannot carry, put back before the first step. FP32 islands are forward hooks
    (a checkpoint holds weights) and the bf16 switch is a precision plugin (the Trainer is built anew). The other
    remedies live in state Lightning restores itself: the scaler's, the optimizers' and the schedulers'."""
    for record in applied:
        if record.name == "fp32_island" and record.details.get("module") is not None:
            attach_island(ctx.module, record.details["module"], ctx.device.type)
        elif record.name == "bf16_fallback" and \
                getattr(ctx.trainer.precision_plugin, "precision", "") != "bf16-mixed":
            bf16_fallback(ctx, Diagnosis(finding=Finding.GRADIENT_OVERFLOW, step=record.step))

