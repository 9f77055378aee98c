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

The detection functions below are pure (a graph, a scaler state or a module in, a verdict out); ``RecipeGuards``
does the attaching, patching, de-duplication and restoring.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import linecache
import os
import sys
import textwrap
import warnings
from dataclasses import dataclass
from types import CodeType, FrameType, ModuleType
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat
from lightning_ampwatch.compat import read_per_optimizer_states
from lightning_ampwatch.machine import PrecisionMode

try:
    from torch.amp.grad_scaler import OptState as _OptState

    _UNSCALED: Any = _OptState.UNSCALED
except ImportError:  # pragma: no cover - another torch: the slow path (optimizer_stage) still works
    _UNSCALED = object()
from lightning_ampwatch.signals import PrecisionInfo, read_scale
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis, Finding, advise

# A constant factor of at least this much on the loss reads as a hand-made loss scale (people pick 2**7 and up);
# smaller factors read as loss weights. A second ``scaler.scale`` is flagged whatever the scale.
PRESCALE_MIN_FACTOR = 128.0

# Backward nodes of loss ops that autocast always runs in float32 (CPU and CUDA alike). One of them producing
# float16 means the op ran with autocast off; ops autocast leaves in float16 on some devices are not listed,
# so a loss computed inside autocast is never flagged.
AUTOCAST_FP32_LOSS_NODES = frozenset({
    "MseLossBackward0", "SmoothL1LossBackward0", "HuberLossBackward0", "NllLossBackward0", "NllLoss2DBackward0",
    "BinaryCrossEntropyWithLogitsBackward0", "SoftMarginLossBackward0", "MultiMarginLossBackward0",
    "MultilabelMarginLossBackward0",
})

GRAPH_NODE_BUDGET = 32  # nodes looked at below the loss: the loss ops sit right there, the model lies further down
CALL_SITE_BUDGET = 64  # distinct backward call sites analysed per fit; past this the backward guard stands down
CLIP_FUNCTION_NAMES = ("clip_grad_norm_", "clip_grad_value_")  # the deprecated ``clip_grad_norm`` calls the first

# --------------------------------------------------------------------------------------------
# Where the user's code is: the first frame up the stack that is not torch, Lightning or us.
# --------------------------------------------------------------------------------------------

_SKIPPED_PACKAGES = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_ampwatch")


def _package_dirs(names: Sequence[str]) -> tuple[str, ...]:
    dirs: list[str] = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            dirs.append(os.path.join(os.path.realpath(location), ""))
            dirs.append(os.path.join(os.path.abspath(location), ""))
    return tuple(dict.fromkeys(dirs))


_SKIPPED_DIRS = _package_dirs(_SKIPPED_PACKAGES)
# The demo scenarios live in this package but play the part of user code: their lines are what to name.
_USER_CODE_IN_PACKAGE = frozenset(os.path.join(d, "scenarios.py") for d in _package_dirs(["lightning_ampwatch"]))
_skip_cache: dict[CodeType, bool] = {}


def _is_framework(code: CodeType) -> bool:
    skip = _skip_cache.get(code)
    if skip is None:
        filename = code.co_filename
        skip = filename.startswith(_SKIPPED_DIRS) and filename not in _USER_CODE_IN_PACKAGE
        if len(_skip_cache) < 4096:
            _skip_cache[code] = skip
    return skip


def _display_path(filename: str) -> str:
    """Relative to the working directory when inside it (what a user clicks on), absolute otherwise."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if rel.startswith(os.pardir) else rel


@dataclass(frozen=True)
class CallSite:
    """A line in the user's code."""

    filename: str
    lineno: int
    function: str

    def __str__(self) -> str:
        return f"{_display_path(self.filename)}:{self.lineno}"

    @property
    def code(self) -> str:
        return linecache.getline(self.filename, self.lineno).strip()

    def evidence(self) -> dict[str, object]:
        return {"call_site": f"{self} in {self.function}", "code": self.code}


def user_call_site(frame: FrameType | None = None) -> tuple[CallSite | None, frozenset[str]]:
    """The first frame above ``frame`` outside torch/Lightning/AmpWatch, and the framework functions passed on
    the way (to tell ``LightningModule.clip_gradients`` from a direct ``torch.nn.utils`` call)."""
    f = frame if frame is not None else sys._getframe(1)
    passed: set[str] = set()
    while f is not None:
        code = f.f_code
        if not _is_framework(code):
            return CallSite(code.co_filename, f.f_lineno, code.co_name), frozenset(passed)
        passed.add(code.co_name)
        f = f.f_back
    return None, frozenset(passed)


def returned_at(func: Any) -> CallSite | None:
    """Where ``func`` hands its result back: its one ``return <value>`` statement, else its ``def`` line.

    In automatic optimization no user frame is on the stack at backward time; the loss left the user's code at
    ``training_step``'s return, so that is the line to name. ``None`` when ``func`` is not user code.
    """
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    if code is None or _is_framework(code):
        return None
    lineno = code.co_firstlineno
    try:
        lines, first = inspect.getsourcelines(func)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return CallSite(code.co_filename, lineno, code.co_name)
    returns = [node.lineno + first - 1 for node in _own_statements(tree.body[0]) if isinstance(node, ast.Return)
               and node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None)]
    if len(returns) == 1:
        lineno = returns[0]
    return CallSite(code.co_filename, lineno, code.co_name)


def _own_statements(function: ast.AST) -> Iterable[ast.AST]:
    """The nodes of a function body, not descending into functions, lambdas or classes defined inside it."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


# --------------------------------------------------------------------------------------------
# Pure detection: the scaler's per-optimizer state, the loss's autograd graph, the set-up.
# --------------------------------------------------------------------------------------------


def optimizer_stage(scaler: Any, optimizer: Any) -> str:
    """``READY`` (gradients still scaled), ``UNSCALED`` or ``STEPPED``, from GradScaler's own bookkeeping.

    Read with ``.get``: the scaler's table is a defaultdict, and indexing it would add an entry.
    """
    states = compat.per_optimizer_states(scaler)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    stage = state.get("stage") if isinstance(state, dict) else None
    return getattr(stage, "name", "READY")


def stepped_by_scaler(scaler: Any, optimizer: Any, step_kwargs: Mapping[str, Any]) -> bool:
    """True while ``scaler.step(optimizer)`` is the caller of ``optimizer.step``.

    The scaler unscales before stepping (stage ``UNSCALED``); optimizers that unscale in their own kernel
    (fused Adam) are handed ``found_inf``/``grad_scale`` attributes, or a ``grad_scaler`` keyword, instead.
    """
    if optimizer_stage(scaler, optimizer) == "UNSCALED":
        return True
    if compat.unscales_in_kernel(optimizer):
        return hasattr(optimizer, "found_inf") or "grad_scaler" in step_kwargs
    return False


@dataclass(frozen=True)
class LossGraph:
    """What the autograd graph just below the loss says about how the loss was made."""

    loss_dtype: torch.dtype | None = None
    float16_loss_op: str | None = None  # an autocast-float32 loss op that ran in float16 (autocast was off)
    factor: float = 1.0  # constant factors the loss was multiplied by, below the scaler's own
    second_scale: bool = False  # one of those factors is the scaler's scale tensor itself

    @property
    def prescaled(self) -> bool:
        return self.second_scale or self.factor >= PRESCALE_MIN_FACTOR


_output_dtype = compat.node_output_dtype


def _same_storage(a: Any, b: Any) -> bool:
    return isinstance(a, Tensor) and isinstance(b, Tensor) and a.device == b.device and a.data_ptr() == b.data_ptr()


def _constant_operand(node: Any) -> tuple[Any, Any] | None:
    """For ``x * c`` / ``c * x`` / ``x / c`` with ``c`` not requiring grad: ``(c, x's node)``."""
    nexts = node.next_functions
    if len(nexts) != 2:
        return None
    if nexts[1][0] is None and nexts[0][0] is not None:
        return compat.saved_operand(node, "other"), nexts[0][0]
    if nexts[0][0] is None and nexts[1][0] is not None and node.name().startswith("Mul"):
        return compat.saved_operand(node, "self"), nexts[1][0]
    return None


def _constant_value(const: Any) -> float | None:
    """A scalar constant's value: free for Python numbers and CPU tensors, one read otherwise (once per site)."""
    if isinstance(const, (int, float)):
        return float(const)
    if isinstance(const, Tensor) and const.numel() == 1 and not const.is_complex():
        return float(const.detach().reshape(()).float())
    return None


def analyze_loss(scaled_loss: Tensor, scaler: Any = None, scale: Callable[[], float] | None = None) -> LossGraph:
    """Walk a few nodes of the graph below the loss handed to backward.

    ``scaled_loss`` is what ``on_before_backward`` sees: under a scaler, the user's loss times the scale, so the
    top multiplication is the scaler's own and is stepped over. Below it, a chain of constant multiplications
    and divisions gives the factor the user applied (accumulation divides, hand scaling multiplies); a breadth-
    first look at up to :data:`GRAPH_NODE_BUDGET` nodes finds a float32-only loss op that ran in float16.
    """
    node = scaled_loss.grad_fn
    if node is None:
        return LossGraph(loss_dtype=scaled_loss.dtype)
    scale_tensor = compat.scale_tensor(scaler) if scaler is not None else None
    if scaler is not None and node.name().startswith("ToCopyBackward") and node.next_functions \
            and node.next_functions[0][0] is not None and node.next_functions[0][0].name().startswith("Mul"):
        # FSDP1's ShardedGradScaler casts the scaled loss back to the loss's dtype (a float16 loss times its float32
        # scale is float32): that cast is the scaler's too, not a cast the user made above a hand-made scale
        node = node.next_functions[0][0]
    if scaler is not None and node.name().startswith("Mul"):
        top = _constant_operand(node)
        if top is not None:
            node = top[1]
    loss_dtype = _output_dtype(node)

    factor, second_scale, walker = 1.0, False, node
    for _ in range(8):
        name = walker.name()
        if name.startswith("ToCopyBackward"):
            walker = walker.next_functions[0][0]
        elif name.startswith(("MulBackward", "DivBackward")):
            found = _constant_operand(walker)
            if found is None:
                break
            const, below = found
            if _same_storage(const, scale_tensor):
                second_scale = True
                value = scale() if scale is not None else _constant_value(const)
            else:
                value = _constant_value(const)
            if value is None or value == 0.0:
                break
            factor = factor * value if name.startswith("Mul") else factor / value
            walker = below
        else:
            break
        if walker is None:
            break

    float16_op = None
    queue, seen = [node], 0
    while queue and seen < GRAPH_NODE_BUDGET:
        current = queue.pop(0)
        seen += 1
        if current.name() in AUTOCAST_FP32_LOSS_NODES and _output_dtype(current) == torch.float16:
            float16_op = current.name()
            break
        queue.extend(n for n, _ in current.next_functions if n is not None)
    return LossGraph(loss_dtype=loss_dtype, float16_loss_op=float16_op, factor=factor, second_scale=second_scale)


def float16_trainable_parameters(module: torch.nn.Module) -> tuple[list[str], int]:
    """Names of trainable float16 parameters, and how many trainable parameters there are (fit start only)."""
    names, trainable = [], 0
    for name, param in module.named_parameters():
        if param.requires_grad:
            trainable += 1
            if param.dtype == torch.float16:
                names.append(compat.user_name(name))
    return names, trainable


FLOAT16_SMALLEST_NORMAL = float(torch.finfo(torch.float16).tiny)


@dataclass(frozen=True)
class EpsProblem:
    optimizer_index: int
    optimizer: str
    param_group: int
    eps: float
    eps_in_float16: float


def eps_too_small_for_float16(optimizers: Sequence[torch.optim.Optimizer]) -> list[EpsProblem]:
    """Param groups of float16 parameters whose ``eps`` is below float16's smallest normal number.

    Such an ``eps`` rounds to zero or to a subnormal with a few bits left, so it no longer keeps
    ``m / (sqrt(v) + eps)`` finite once ``v`` underflows; one problem per optimizer is enough to say.
    """
    problems = []
    for index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            eps = group.get("eps")
            params = group.get("params") or []
            if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not params:
                continue
            if params[0].dtype != torch.float16 or not 0 <= eps < FLOAT16_SMALLEST_NORMAL:
                continue
            held = float(torch.tensor(float(eps), dtype=torch.float16))
            problems.append(EpsProblem(index, type(optimizer).__name__, group_index, float(eps), held))
            break
    return problems


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
        self._trainer: Any = None
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

    def attach(self, trainer: Any, pl_module: Any, precision_info: PrecisionInfo,
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

    def _check_eps(self, pl_module: Any, trainer: Any) -> None:
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
        step = int(getattr(self._trainer, "global_step", 0) or 0)
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
