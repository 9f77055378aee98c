"""The FP32 island: one module run in float32 with autocast off, inside an autocast region."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from lightning_ampwatch import compat, deepspeed_state
from lightning_ampwatch.records import facts_of
from lightning_ampwatch.remedies.base import AppliedRemedy, Remedy, RemedyContext, RemedyError, RemedyName, register
from lightning_ampwatch.remedies.precision import UNKNOWN, built_with, run_precision
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch.interventions import Intervention

ISLAND_ATTR = "_ampwatch_fp32_island"


class IslandForward:
    """Stands in for the module's ``forward`` and runs it inside ``torch.autocast(..., enabled=False)``: a ``with``
    block, so autocast comes back on every way out, an exception the caller catches included (a pre/post hook
    pair leaves it off, and autocast's cast cache alive, when the forward raises).

    A callable object holding the module, not a closure or a bound method, so that the model still deep-copies and
    pickles with it in place. The inputs are cast to float32 by a forward pre-hook, PyTorch's place for that.
    """

    def __init__(self, module: nn.Module, device_type: str) -> None:
        self.module = module
        self.device_type = device_type
        self.replaced = module.__dict__.get("forward")  # a forward set on the instance before us, else None
        self.cast_hook = module.register_forward_pre_hook(_cast_inputs, with_kwargs=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, enabled=False):
            if self.replaced is not None:
                return self.replaced(*args, **kwargs)
            return type(self.module).forward(self.module, *args, **kwargs)


def _cast_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    return _to_float32(args), _to_float32(kwargs)


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


def attach_island(module: nn.Module, name: str, device_type: str) -> None:
    """Make ``name`` (a qualified submodule name, ``""`` for ``module`` itself) an FP32 island; idempotent."""
    target = module.get_submodule(name)
    if getattr(target, ISLAND_ATTR, None) is not None:
        return
    island = IslandForward(target, device_type)
    target.forward = island
    setattr(target, ISLAND_ATTR, island)


def detach_island(module: nn.Module, name: str) -> None:
    """Run ``name`` as before the island again; a forward someone set on top of the island since is left alone."""
    target = module.get_submodule(name)
    island = getattr(target, ISLAND_ATTR, None)
    if island is None:
        return
    island.cast_hook.remove()
    if target.__dict__.get("forward") is island:
        if island.replaced is not None:
            target.forward = island.replaced
        else:
            del target.forward
    delattr(target, ISLAND_ATTR)


def _island_module_name(module: nn.Module, location: str | None) -> str:
    """The module to isolate: the location itself, or the module owning a located parameter."""
    if location is None:
        raise RemedyError("the overflow was not located in a module")
    if compat.has_submodule(module, location):
        return location
    owner = location.rsplit(".", 1)[0] if "." in location else ""
    if owner and compat.has_submodule(module, owner):
        return owner
    raise RemedyError(f"{location!r} is not a submodule of the model")


@register
class Fp32Island(Remedy):
    """Run the located module in float32 from now on; the rest of the model stays in float16."""

    name = RemedyName.FP32_ISLAND

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        deepspeed_state.refuse(ctx.trainer, "fp32_island")
        report = facts_of(diagnosis).interventions
        measured = report.island_modules if report is not None else ()
        if measured and report is not None and report.cured(Intervention.ISLAND):
            names = [n for n in measured if compat.has_submodule(ctx.module, n)]  # the modules whose island cured
        else:
            names = [_island_module_name(ctx.module, diagnosis.location)]
        for name in names:
            attach_island(ctx.module, name, ctx.device.type)
        return {"module": names[0], "modules": names} if len(names) > 1 else {"module": names[0]}

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> str | None:
        """A checkpoint holds weights, not the island: attach it again, where the run autocasts (mixed precision).
        A run resumed without autocast (32-true, 16-true, bf16-true) is the user's choice: an island there would
        cast the module's inputs to float32 against weights in another dtype. Kept, and why is returned."""
        precision = run_precision(ctx)
        if precision != UNKNOWN and not precision.endswith("-mixed"):
            return built_with(precision)
        for name in record.details.get("modules") or [record.details.get("module")]:
            if name is not None:
                attach_island(ctx.module, name, ctx.device.type)
        return None

    def describe(self, details: Mapping[str, Any]) -> str:
        modules = details.get("modules")
        if isinstance(modules, list) and len(modules) > 1:
            return f"{', '.join(modules)} run in float32 with autocast off"
        return f"{details['module'] or 'the whole model'} runs in float32 with autocast off"
