"""What AmpWatch knows about sharded and wrapped training state, in one place.

Snapshots read the live state through torch's own distributed state-dict machinery
(:func:`torch.distributed.checkpoint.state_dict.get_state_dict`), which sees through DDP, FSDP2 (``fully_shard``)
and tensor parallelism, keys optimizer state by parameter name and leaves frozen parameters out. For a plain
module, DDP and FSDP2 the tensors it returns *are* the live tensors (a DTensor's local shard shares its storage),
so a snapshot copies them to the host and a restore copies them back in place: no second model, no new tensors,
the optimizer's param-group dicts untouched (the step ledger holds on to them).

FSDP1 (``FullyShardedDataParallel``) returns state-dict tensors that are built for the call, not views of its flat
parameters: an in-place restore would change nothing. AmpWatch says so and keeps the trajectory control off there
rather than pretend (see :func:`unsupported_reason`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from lightning_ampwatch import compat, deepspeed_state
from lightning_ampwatch.distributed import world_size

try:  # torch >= 2.4 has both; kept optional so that a build without torch.distributed still imports
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    get_state_dict = None  # type: ignore[assignment]
    StateDictOptions = None  # type: ignore[assignment,misc]
    DTensor = ()  # type: ignore[assignment,misc]

HALF = (torch.float16, torch.bfloat16)


def local(t: Tensor) -> Tensor:
    """The part of ``t`` this rank holds: a DTensor's local shard (a view of its storage), else ``t``."""
    return t.to_local() if DTensor and isinstance(t, DTensor) else t


def unsupported_reason(root: nn.Module, optimizers: Sequence[Any] = ()) -> str | None:
    """Why snapshots cannot be restored in place for ``root``, or None when they can."""
    if deepspeed_state.is_engine(root):  # ZeRO-1/2's partitioned state has a snapshot of its own
        return deepspeed_state.unsupported_reason(root)
    if any(not isinstance(opt, torch.optim.Optimizer) for opt in optimizers):
        return ("the trajectory control is not available: an optimizer is not a torch optimizer, so its state "
                "cannot be read through torch's state-dict machinery")
    if uses_fsdp1(root):
        return ("the trajectory control is not available under FSDP1 (FullyShardedDataParallel): its state-dict "
                "tensors are built for each call rather than views of its flat parameters, so a snapshot could not "
                "be put back in place; FSDP2 (ModelParallelStrategy / fully_shard) is supported")
    if get_state_dict is None:  # pragma: no cover
        return "the trajectory control needs torch.distributed.checkpoint, which this torch build lacks"
    return None


def uses_fsdp1(root: nn.Module) -> bool:
    """Whether ``root`` is or holds an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in root.modules())


def live_state(root: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
               ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(model state, optimizer state keyed by parameter name) of the live run, frozen parameters left out. For the
    modules :func:`unsupported_reason` accepts, every tensor in them is (or, for a DTensor, wraps) the live tensor,
    and every per-parameter dict is the optimizer's own ``state[param]``.

    ``get_state_dict`` steps an optimizer that has no state and no gradients once, at LR 0, to create its state.
    That step is not harmless (Adam's step count and bias correction move, so the run is no longer the one it would
    have been): an optimizer with no state yet (before the first step, or a stateless SGD) is left out, its state
    is empty. The optimizers' step hooks are hidden all the same so that AmpWatch's own hook never counts a step."""
    if deepspeed_state.is_engine(root):  # this rank's float32 partitions and its optimizer state over them
        return deepspeed_state.live_state(root)
    options = StateDictOptions(ignore_frozen_params=True)
    optimizers = [opt for opt in optimizers if opt.state]
    with without_step_hooks(optimizers):
        if optimizers:
            model_sd, optim_sd = get_state_dict(root, optimizers, options=options)
        else:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            model_sd, optim_sd = get_model_state_dict(root, options=options), {"state": {}}
    return model_sd, optim_sd.get("state", {})


def after_restore(root: nn.Module) -> None:
    """A snapshot was put back into ``root``'s live state: whatever is derived from it made again (a DeepSpeed
    engine's half-precision weights, from its float32 partitions: an all-gather, on every rank at once)."""
    if deepspeed_state.is_engine(root):
        deepspeed_state.after_restore(root)


def frozen_versions(root: nn.Module) -> tuple[tuple[str, int], ...]:
    """The version counter of every frozen parameter: any in-place change bumps it, so a snapshot that left them
    out can tell when they are no longer what it assumed. A Python loop over the frozen parameters, run when a
    snapshot is taken (every ``snapshot_every`` steps), never on other steps."""
    return tuple((name, compat.tensor_version(p)) for name, p in root.named_parameters() if not p.requires_grad)


def changed_frozen(saved: tuple[tuple[str, int], ...], root: nn.Module) -> str | None:
    """The first frozen parameter changed in place since ``saved`` was read, or None."""
    now = dict(frozen_versions(root))
    for name, version in saved:
        if now.get(name, version) != version:
            return name
    return None


@contextlib.contextmanager
def fp32_frozen(module: nn.Module) -> Iterator[int]:
    """Frozen half-precision parameters (a bf16 base under a LoRA or a head) computed in float32 for the block, so
    that the FP32 control is FP32 throughout; put back (the very same tensors) on exit. Yields the bytes of the
    temporary float32 copies. Trainable half-precision parameters are not touched (a '16-true' run has no FP32
    run to compare with; the control says so elsewhere)."""
    swapped: list[tuple[nn.Parameter, Tensor]] = []
    extra = 0
    try:
        with torch.no_grad():
            for p in module.parameters():
                if not p.requires_grad and p.dtype in HALF and not (DTensor and isinstance(p, DTensor)):
                    swapped.append((p, p.data))
                    p.data = p.data.float()
                    extra += p.data.nbytes
        yield extra
    finally:
        for p, original in swapped:
            p.data = original


#: Optimizer steps taken inside stay unseen by the live run's step hooks (compat.py's; DeepSpeed's are left alone).
without_step_hooks = compat.without_step_hooks


def replay_needs_all_ranks(module: nn.Module) -> bool:
    """Whether running ``module``'s forward talks to the other ranks: FSDP2 / tensor-parallel parameters
    (DTensors), FSDP1's flattened parameters, DeepSpeed ZeRO-3's partitioned ones. A replay of such a model is
    only safe when every rank replays at the same time."""
    for p in module.parameters():
        if (DTensor and isinstance(p, DTensor)) or compat.fsdp1_flattened(p) or hasattr(p, "ds_id"):
            return True
    return False


def half_param_dtype(module: nn.Module) -> torch.dtype | None:
    """The half-precision dtype FSDP gathers parameters in for compute (an FSDP2 ``MixedPrecisionPolicy`` or an
    FSDP1 ``MixedPrecision`` with a half ``param_dtype``), or None. Under it a replay "without autocast" still
    computes in half precision: it would be no FP32 control."""
    for m in module.modules():
        dtype = compat.fsdp2_param_dtype(m)  # FSDP2: fully_shard's mixed-precision policy
        if dtype in HALF:
            return dtype
        mixed = getattr(m, "mixed_precision", None)  # FSDP1
        dtype = getattr(mixed, "param_dtype", None)
        if dtype in HALF:
            return dtype
    return None


def class_name(module: nn.Module) -> str:
    """The user's class name: ``fully_shard`` swaps a module's class for a generated ``FSDP<Name>`` subclass."""
    cls = type(module)
    if any(base.__name__ == "FSDPModule" for base in cls.__mro__[1:]):
        user = next((b for b in cls.__bases__ if b.__name__ != "FSDPModule"), None)
        if user is not None:
            return user.__name__
    return cls.__name__


def training_step(root: nn.Module | None, module: nn.Module, batch: Any, batch_idx: int) -> Any:
    """``module.training_step(batch, batch_idx)`` as the strategy runs it. Under FSDP1 the module is wrapped in a
    root ``FullyShardedDataParallel`` whose forward gathers the parameters (past it they are flat 1-D shards):
    the call goes through that forward, with the module's ``forward`` standing for ``training_step`` for the one
    call (the way Lightning's own forward redirection does it). Everywhere else it is a plain call: a DDP
    wrapper's forward would prepare a gradient reduction that the replay never runs."""
    if root is None or root is module or not redirects(root):
        return module.training_step(batch, batch_idx)
    original = module.forward

    def redirected(*args: Any, **kwargs: Any) -> Any:
        module.forward = original  # type: ignore[method-assign]
        return module.training_step(*args, **kwargs)

    module.forward = redirected  # type: ignore[method-assign]
    try:
        return root(batch, batch_idx)
    finally:
        module.__dict__.pop("forward", None)  # the class's forward again, whatever happened inside


def redirects(root: nn.Module) -> bool:
    """Whether a replay calls ``training_step`` through ``root``'s forward (a root FSDP1 wrapper)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(root, FullyShardedDataParallel)


def broadcast(t: Tensor, src: int) -> None:
    import torch.distributed as dist

    dist.broadcast(t, src=src)


def replicated(root: nn.Module) -> bool:
    """Whether every rank holds the whole state alike (DDP over more than one rank)."""
    return isinstance(root, nn.parallel.DistributedDataParallel) and world_size() > 1
