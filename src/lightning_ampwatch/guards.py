"""Recipe guards: catch the AMP recipe mistakes at the line of user code that makes them.

Four ordering mistakes (loss outside autocast, clipping still-scaled gradients, stepping past the scaler, scaling
the loss by hand) and two set-up mistakes (float16 parameters under 16-mixed, an Adam-style ``eps`` that float16
cannot hold under 16-true). Each is found on an event that happens anyway, with no device read on a healthy step:

- the optimizer's own step pre-hook, which asks the GradScaler's per-optimizer state whether ``scaler.step`` is
  the caller (two dict look-ups);
- ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``, wrapped only while ``fit`` runs; a healthy call
  costs one dict look-up before the real function runs;
- ``on_before_backward``, where the scaled loss is in hand: its autograd graph is walked a few nodes deep, once
  per call site (automatic optimization has a single call site: ``training_step``);
- fit start, for the parameter dtypes and the optimizers' ``eps``.

The detection is pure and lives apart: :mod:`lightning_ampwatch.recipe_checks` (a graph, a scaler state or a module
in, a verdict out) and :mod:`lightning_ampwatch.call_sites` (the line of user code to name). ``RecipeGuards`` here
does the attaching, patching, de-duplication and restoring.
"""

from __future__ import annotations

import functools
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat
from lightning_ampwatch.call_sites import CallSite, returned_at, user_call_site
from lightning_ampwatch.compat import read_per_optimizer_states
from lightning_ampwatch.machine import PrecisionMode

try:
    from torch.amp.grad_scaler import OptState as _OptState

    _UNSCALED: Any = _OptState.UNSCALED
except ImportError:  # pragma: no cover - another torch: the slow path (optimizer_stage) still works
    _UNSCALED = object()
from lightning_ampwatch.recipe_checks import (  # noqa: F401 - PRESCALE_MIN_FACTOR: re-exported, with the checks
    FLOAT16_SMALLEST_NORMAL,
    PRESCALE_MIN_FACTOR,
    analyze_loss,
    eps_too_small_for_float16,
    float16_trainable_parameters,
    optimizer_stage,
    stepped_by_scaler,
)
from lightning_ampwatch.signals import PrecisionInfo, read_scale
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis, Finding, advise

CALL_SITE_BUDGET = 64  # distinct backward call sites analysed per fit; past this the backward guard stands down
CLIP_FUNCTION_NAMES = ("clip_grad_norm_", "clip_grad_value_")  # the deprecated ``clip_grad_norm`` calls the first


class GuardedRun(Protocol):
    """What the guards read of the run they watch: the adapter's host (:class:`~lightning_ampwatch.host.Host`)."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far: the step a finding is dated at."""

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """The raw torch optimizers, whose step the guards hook and whose ``eps`` they check."""


# --------------------------------------------------------------------------------------------
# The guards: attach to a fit, report each mistake once per call site, leave everything as found.
# --------------------------------------------------------------------------------------------


class RecipeGuards:
    """Watches one ``fit`` for AMP recipe mistakes and reports each once per line of user code.

    ``attach`` checks the set-up at once and installs the cheap guards; ``detach`` removes them and restores
    ``torch.nn.utils`` exactly, and is safe to call twice or after an exception. ``on_before_backward`` is fed
    by the callback's hook of the same name.
    """

    def __init__(self) -> None:
        self._report: Callable[[Diagnosis], None] | None = None
        self._trainer: GuardedRun | None = None
        self._scaler: Any = None
        self._scale_reader: Callable[[], float] | None = None
        self._check_loss = False
        self._automatic = True
        self._automatic_checked = False
        self._checked_sites: set[tuple[str, int]] = set()
        self._reported: set[tuple[Finding, str, int]] = set()
        self._param_owner: dict[int, torch.optim.Optimizer] = {}
        self._hook_handles: list[Any] = []
        self._patched: list[tuple[ModuleType, str, Callable[..., Any], Callable[..., Any]]] = []
        self._module: Any = None
        self._active = False
        self.wants_loss = False
        self._warned: set[str] = set()
        self.rescale_clipping = False  # the unscale_before_clip remedy: clip limits follow the loss scale

    def _update_wants_loss(self) -> None:
        """``wants_loss``: whether ``on_before_backward`` has anything left to check (automatic optimization: the
        first loss only). A plain attribute, since the callback asks on every backward."""
        self.wants_loss = self._check_loss and self._active and not (self._automatic and self._automatic_checked)

    # ------------------------------------------------------------------ lifecycle

    def attach(self, trainer: GuardedRun, pl_module: Any, precision_info: PrecisionInfo,
               report_callback: Callable[[Diagnosis], None],
               scale_reader: Callable[[], float] | None = None) -> None:
        """Check the set-up and install the guards. ``scale_reader`` gives the current scale without a device
        read (the callback's host mirror); without it the scaler is read, only when a mistake is found."""
        self.detach()
        self._report = report_callback
        self._trainer = trainer
        self._module = pl_module
        # a loss returned from training_step (Lightning's automatic optimization) has one call site, its return;
        # a hand-written loop (manual optimization, a Fabric loop) calls backward where the user wrote it
        self._automatic = bool(getattr(pl_module, "automatic_optimization", True)) and hasattr(pl_module,
                                                                                                "training_step")
        self._automatic_checked = False
        self._checked_sites.clear()
        self._active = True
        mode = precision_info.mode
        if precision_info.loss_scale is not None:
            # DeepSpeed fp16 is a recipe of its own: no autocast (the engine casts the whole module to float16 and
            # keeps float32 master weights in its optimizer) and no GradScaler (its engine scales and steps): the
            # mistakes checked here are those of autocast with a GradScaler and cannot be made under it
            mode = PrecisionMode.FP32
        self._scaler = precision_info.scaler if mode is PrecisionMode.FP16 else None
        self._scale_reader = scale_reader
        self._check_loss = mode is PrecisionMode.FP16
        self._update_wants_loss()

        if mode is PrecisionMode.FP16:
            self._check_parameters(pl_module)
        if mode is PrecisionMode.HALF:
            self._check_eps(pl_module, trainer)
        if self._scaler is None:
            return
        if not isinstance(compat.per_optimizer_states(self._scaler), dict):
            self._warn_once("scaler-state", "AmpWatch cannot read this GradScaler's per-optimizer state; the "
                            "clipping and stepping guards are off for this run.")
            return
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    self._param_owner.setdefault(id(param), optimizer)
            self._hook_handles.append(optimizer.register_step_pre_hook(self._before_optimizer_step))
        self._patch_clipping()

    def detach(self) -> None:
        """Remove the step hooks and put the clipping functions back exactly as found. Idempotent."""
        self._active = False
        self.wants_loss = False
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        for module, name, original, wrapper in reversed(self._patched):
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
            # else someone wrapped on top of us since: leave theirs; ours passes straight through when inactive
        self._patched.clear()
        self._param_owner.clear()
        self._trainer = self._module = self._scaler = None
        self._report = self._scale_reader = None  # no closures over the trainer outlive the fit

    # ------------------------------------------------------------------ set-up checks (fit start)

    def _check_parameters(self, pl_module: Any) -> None:
        names, trainable = float16_trainable_parameters(pl_module)
        if not names:
            return
        self._emit(Finding.FP16_PARAMETERS, names[0], {
            "float16_parameters": len(names),
            "trainable_parameters": trainable,
            "first_float16": names[:5],
            "scaler": self._scaler is not None,
        })

    def _check_eps(self, pl_module: Any, trainer: GuardedRun) -> None:
        site = returned_at(getattr(pl_module, "configure_optimizers", None))
        for problem in eps_too_small_for_float16(trainer.optimizers):
            evidence: dict[str, object] = {
                "optimizer": problem.optimizer,
                "param_group": problem.param_group,
                "eps": problem.eps,
                "eps_in_float16": problem.eps_in_float16,
                "float16_smallest_normal": FLOAT16_SMALLEST_NORMAL,
            }
            if site is not None:
                evidence.update(site.evidence())
            self._emit(Finding.EPS_UNDERFLOW, str(site) if site else f"optimizers[{problem.optimizer_index}]",
                       evidence)

    # ------------------------------------------------------------------ backward (fed by the callback)

    def on_before_backward(self, loss: Tensor) -> None:
        """Look at the graph below the loss, once per call site of backward."""
        if not self._check_loss or not self._active:
            return
        if self._automatic:
            if self._automatic_checked:
                return
            self._automatic_checked = True
            self._update_wants_loss()
            site = returned_at(getattr(self._module, "training_step", None))
        else:
            site, _ = user_call_site()
            if site is None:
                return
            key = (site.filename, site.lineno)
            if key in self._checked_sites or len(self._checked_sites) >= CALL_SITE_BUDGET:
                return
            self._checked_sites.add(key)
        try:
            graph = analyze_loss(loss, self._scaler, self._current_scale if self._scaler is not None else None)
        except Exception as err:  # noqa: BLE001 - a graph we cannot read is not the user's problem
            self._warn_once("graph", f"AmpWatch could not read the loss's autograd graph ({type(err).__name__}: "
                            f"{err}); the autocast and pre-scaling checks are off for that call site.")
            return
        common: dict[str, object] = dict(site.evidence()) if site is not None else {}
        common["optimization"] = "automatic" if self._automatic else "manual"
        if graph.float16_loss_op is not None:
            self._emit_at(Finding.LOSS_OUTSIDE_AUTOCAST, site, {
                **common,
                "loss_op": graph.float16_loss_op.removesuffix("Backward0"),
                "loss_op_dtype": "float16",
                "loss_dtype": str(graph.loss_dtype).removeprefix("torch.") if graph.loss_dtype else None,
            })
        if self._scaler is not None and graph.prescaled:
            self._emit_at(Finding.MANUAL_PRESCALE, site, {
                **common,
                "factor": graph.factor,
                "second_scaler_scale": graph.second_scale,
                "scale": self._current_scale(),
                "effective_scale": graph.factor * self._current_scale(),
            })

    # ------------------------------------------------------------------ optimizer step (pre-hook)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Mapping[str, Any]) -> None:
        if not self._active:
            return
        # The common case first, in as few operations as possible: scaler.step unscaled this optimizer. (The
        # scaler replaces its per-optimizer table at every update, so it is looked up afresh each time.)
        state = read_per_optimizer_states(self._scaler).get(id(optimizer))  # attach() checked it is there
        if state is not None and state.get("stage") is _UNSCALED:
            return
        self._guard(self._check_step, optimizer, kwargs)

    def _check_step(self, optimizer: Any, kwargs: Mapping[str, Any]) -> None:
        if stepped_by_scaler(self._scaler, optimizer, kwargs):
            return
        site, _ = user_call_site()
        self._emit_at(Finding.STEP_OUTSIDE_SCALER, site, {
            **(site.evidence() if site is not None else {}),
            "optimizer": type(optimizer).__name__,
            "optimizer_state": optimizer_stage(self._scaler, optimizer),
            "optimization": "automatic" if self._automatic else "manual",
        })

    # ------------------------------------------------------------------ clipping (wrapped during fit)

    def _patch_clipping(self) -> None:
        utils = torch.nn.utils
        clip_module = sys.modules.get("torch.nn.utils.clip_grad")
        for module in (utils, clip_module):
            if module is None:
                continue
            for name in CLIP_FUNCTION_NAMES:
                original = getattr(module, name, None)
                if original is None:
                    continue
                wrapper = self._clip_wrapper(name, original)
                setattr(module, name, wrapper)
                self._patched.append((module, name, original, wrapper))

    def _clip_wrapper(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def clip_guard(*args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return original(*args, **kwargs)
            args, kwargs = _materialise_parameters(args, kwargs)
            params = args[0] if args else kwargs.get("parameters", ())
            limit = args[1] if len(args) > 1 else kwargs.get("max_norm", kwargs.get("clip_value"))
            self._guard(self._check_clip, name, params, limit)
            factor = self._clip_factor(params) if self.rescale_clipping else 1.0
            if factor == 1.0:
                return original(*args, **kwargs)
            # Still-scaled gradients: clip at limit x scale, which clips exactly what the unscaled
            # gradients would be clipped to, and report the norm in real units.
            if len(args) > 1:
                args = (args[0], float(args[1]) * factor) + tuple(args[2:])
            else:
                key = "max_norm" if "max_norm" in kwargs else "clip_value"
                kwargs = {**kwargs, key: float(kwargs[key]) * factor}
            result = original(*args, **kwargs)
            return result / factor if isinstance(result, Tensor) else result

        clip_guard.__ampwatch_original__ = original  # type: ignore[attr-defined]
        return clip_guard

    def _owner(self, params: Any) -> Any:
        for param in ([params] if isinstance(params, Tensor) else params):
            owner = self._param_owner.get(id(param))
            if owner is not None:
                return owner
        return None

    def _clip_factor(self, params: Any) -> float:
        """The loss scale when these gradients are still scaled (their optimizer not yet unscaled), else 1."""
        owner = self._owner(params)
        if owner is None or optimizer_stage(self._scaler, owner) != "READY":
            return 1.0
        return self._current_scale()

    def _check_clip(self, name: str, params: Any, limit: Any) -> None:
        owner = self._owner(params)
        if owner is None or optimizer_stage(self._scaler, owner) != "READY":
            return
        site, passed = user_call_site()
        if site is None or (Finding.CLIP_BEFORE_UNSCALE, site.filename, site.lineno) in self._reported:
            return
        scale = self._current_scale()
        if scale == 1.0:
            return  # at scale 1 the scaled and the real gradients are the same numbers
        evidence: dict[str, object] = {
            **site.evidence(),
            "clip_function": f"torch.nn.utils.{name}",
            "via": "LightningModule.clip_gradients" if "clip_gradients" in passed else "direct call",
            "optimizer": type(owner).__name__,
            "optimizer_state": "READY",
            "scale": scale,
            "optimization": "automatic" if self._automatic else "manual",
        }
        if isinstance(limit, (int, float)) and not isinstance(limit, bool):
            evidence["clip_limit"] = float(limit)
            evidence["limit_in_real_units"] = float(limit) / scale
        self._emit_at(Finding.CLIP_BEFORE_UNSCALE, site, evidence)

    # ------------------------------------------------------------------ reporting

    def _current_scale(self) -> float:
        if self._scale_reader is not None:
            return float(self._scale_reader())
        return read_scale(self._scaler)[0] if self._scaler is not None else 1.0

    def _emit_at(self, finding: Finding, site: CallSite | None, evidence: dict[str, object]) -> None:
        """Report once per (finding, line of user code)."""
        key = (finding, site.filename if site else "", site.lineno if site else 0)
        if key in self._reported:
            return
        self._reported.add(key)
        self._emit(finding, str(site) if site is not None else None, evidence)

    def _emit(self, finding: Finding, location: str | None, evidence: dict[str, object]) -> None:
        step = self._trainer.global_step if self._trainer is not None else 0
        diagnosis = Diagnosis(finding, step, location=location, evidence=evidence, advice=advise(finding, evidence))
        if self._report is not None:
            self._report(diagnosis)

    def _guard(self, check: Callable[..., None], *args: Any) -> None:
        """Run a check inside the user's call; our own failure is said once and never reaches training."""
        try:
            check(*args)
        except AmpWatchError:
            raise
        except Exception as err:  # noqa: BLE001
            self._warn_once(check.__name__, f"AmpWatch's recipe guard {check.__name__} failed and is skipped: "
                            f"{type(err).__name__}: {err}")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


def _materialise_parameters(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A generator of parameters can be read once: turn it into a list and hand that list on."""
    if args:
        if not isinstance(args[0], (Tensor, list, tuple)) and isinstance(args[0], Iterable):
            args = (list(args[0]),) + tuple(args[1:])
    elif "parameters" in kwargs and not isinstance(kwargs["parameters"], (Tensor, list, tuple)):
        kwargs = {**kwargs, "parameters": list(kwargs["parameters"])}
    return args, kwargs
