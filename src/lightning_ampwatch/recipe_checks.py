"""The recipe guards' detection, pure: a scaler's per-optimizer state, the loss's autograd graph, a module or the
optimizers in; a verdict out. :class:`~lightning_ampwatch.guards.RecipeGuards` installs the hooks that feed them,
reports what they find once per line of user code and puts everything back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat

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
