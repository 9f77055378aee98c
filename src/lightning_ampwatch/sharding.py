"""What AmpWatch knows about sharded and wrapped training state, in one place.

Snapshots read the live state through torch's own distributed state-dict machinery
(:func:`torch.distributed.checkpoint.state_dict.get_state_dict`), which sees through DDP, FSDP2 (``fully_shard``)
and tensor parallelism, keys optimizer state by parameter name and leaves frozen parameters out. For a plain
module, DDP and FSDP2 the tensors it returns *are* the live tensors (a DTensor's local shard shares its storage),
so a snapshot copies them to the host and a restore copies them back in place: no second model, no new tensors,
the optimizer's param-group dicts untouched (the step ledger holds on to them).

FSDP1 (``FullyShardedDataParallel``) is the exception, on two counts: its state-dict tensors are built for each call,
not views of its flat parameters (an in-place restore into them would change nothing), and building them is a
collective (measured: ``get_model_state_dict`` and ``get_optimizer_state_dict`` on one rank alone wait for the
other), so a snapshot taken by one rank and not another, as an episode on one rank's data makes it, would hang the
run. Between optimizer steps each of its flat parameters holds this rank's shard, and the optimizer's parameters
(the flat parameters, or with ``use_orig_params`` the original parameters, views of that shard) and their state are
live tensors: :func:`fsdp1_live_state` reads those, so that FSDP1 snapshots and restores are this rank's alone, in
place, like every other strategy's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Collection, Iterator, Sequence

import torch
from torch import Tensor, nn

from lightning_ampwatch import compat, deepspeed_state
from lightning_ampwatch.protocol import broadcast, world_size

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


def live_state(root: nn.Module, optimizers: Sequence[torch.optim.Optimizer], create: Collection[str] = ()
               ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(model state, optimizer state keyed by parameter name) of the live run, frozen parameters left out. For the
    modules :func:`unsupported_reason` accepts, every tensor in them is (or, for a DTensor, wraps) the live tensor,
    and every per-parameter dict is the optimizer's own ``state[param]``.

    ``get_state_dict`` steps an optimizer that has no state and no gradients once, at LR 0, to create its state.
    That step is not harmless (Adam's step count and bias correction move, so the run is no longer the one it would
    have been): an optimizer with no state yet (before the first step, or a stateless SGD) is left out, its state
    is empty. The optimizers' step hooks are hidden all the same so that AmpWatch's own hook never counts a step.
    Under FSDP1 the live tensors are read directly (:func:`fsdp1_live_state`; ``create`` is for it); under DeepSpeed,
    this rank's float32 partitions and its optimizer state over them (:mod:`lightning_ampwatch.deepspeed_state`)."""
    if deepspeed_state.is_engine(root):
        return deepspeed_state.live_state(root)
    if uses_fsdp1(root):
        return fsdp1_live_state(root, optimizers, create)
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
    snapshot is taken (every ``snapshot_every`` steps), never on other steps. None are kept under FSDP1 (see
    :func:`fsdp1_live_state`)."""
    if uses_fsdp1(root):
        return ()
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


def fp32_replay_unavailable(root: nn.Module) -> str | None:
    """Why a replay without autocast would not be an FP32 run though snapshots can be taken, or None: FSDP gathers
    the parameters in half precision for compute, or (FSDP1) frozen half-precision parameters, which its forward
    gathers in their own dtype whatever :func:`fp32_frozen` makes of them."""
    dtype = half_param_dtype(root)
    if dtype is not None:
        return (f"the trajectory control is not available: FSDP gathers the parameters in "
                f"{str(dtype).replace('torch.', '')} for compute, so a replay without autocast would not be an FP32 "
                "run")
    if uses_fsdp1(root):
        frozen = next((n for n, p in root.named_parameters() if not p.requires_grad and p.dtype in HALF), None)
        if frozen is not None:
            return (f"the trajectory control is not available: FSDP1 gathers the frozen parameter {frozen!r} in "
                    "half precision for compute, so a replay without autocast would not be an FP32 run")
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


__all__ = ["broadcast"]  # (the protocol's: a split snapshot's entries, sent by the rank that holds each)


def replicated(root: nn.Module) -> bool:
    """Whether every rank holds the whole state alike (DDP over more than one rank)."""
    return isinstance(root, nn.parallel.DistributedDataParallel) and world_size() > 1


# --------------------------------------------------------------------------------------------
# FSDP1 (FullyShardedDataParallel): this rank's shards, read and put back in place, no collective
# --------------------------------------------------------------------------------------------


def fsdp1_live_state(root: nn.Module, optimizers: Sequence[torch.optim.Optimizer], create: Collection[str] = ()
                     ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """FSDP1's live state on this rank, as :func:`live_state` gives it: (the trained parameters this rank holds and
    the buffers, the optimizer state of each trained parameter), keyed by the wrapped module's parameter names.

    Between optimizer steps each flat parameter holds this rank's shard. Its trained parameters are what the
    optimizers step: the flat parameters themselves (``use_orig_params=False``), or the original parameters, views of
    the shard (``use_orig_params=True``, Lightning's default; a parameter this rank holds no part of is an empty
    view). Each tensor returned is the live one and each per-parameter dict is the optimizer's own ``state[param]``,
    so a snapshot copies exactly this rank's shard and a restore writes it back in place, no rank waiting for
    another. Frozen parameters are left out: under ``use_orig_params`` they can share a flat parameter (and its
    version counter) with trained ones, so :func:`frozen_versions` keeps no guard for them. Buffers are whole on
    every rank. A parameter named in ``create`` that has no optimizer state yet gets an empty dict there (torch's
    optimizers start such state afresh), so that a restore has a place to put the state a snapshot holds for it."""
    if compat.fsdp1_unsharded(root):  # never at an optimizer-step boundary, where snapshots and restores happen
        raise RuntimeError("an FSDP1 flat parameter is not resharded (its live data is the gathered whole, not this "
                           "rank's shard), so this rank's state cannot be read in place now")
    create = set(create)
    names: dict[int, str] = {}
    model: dict[str, Any] = {}
    for name, p in root.named_parameters():
        if p.requires_grad:
            names[id(p)] = name
            model[name] = p
    model.update(root.named_buffers())
    optim: dict[str, dict[str, Any]] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                name = names.get(id(p))
                if name is not None and (p in opt.state or name in create):
                    optim[name] = opt.state[p]  # the live dict (``opt.state`` is a defaultdict)
    return model, optim


def replay_scaler(scaler: Any, device_type: str) -> Any:
    """A fresh GradScaler of the kind the run uses, for a replay at the run's precision: FSDP1's ShardedGradScaler
    agrees ``found_inf`` across the ranks' gradient shards, as the run's own does; else ``torch.amp.GradScaler``."""
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    except ImportError:  # pragma: no cover
        ShardedGradScaler = None  # type: ignore[assignment,misc]  # noqa: N806
    if ShardedGradScaler is not None and isinstance(scaler, ShardedGradScaler):
        return ShardedGradScaler(device=device_type)
    return torch.amp.GradScaler(device_type)


# --------------------------------------------------------------------------------------------
# The snapshot's fast path: what live_state resolved, reused while the live objects stay the same
# --------------------------------------------------------------------------------------------


def plain_modules(root: nn.Module) -> list[nn.Module] | None:
    """``root``'s modules, when the tensors :func:`live_state` returns for it are plain tensors that its
    parameters and buffers own (a plain module, DDP): then what it resolved can be reused while
    :func:`state_fingerprint` stays the same. None where they are not (DTensor shards under FSDP2 or tensor
    parallelism, FSDP1's flat parameters): there every snapshot asks :func:`live_state` again."""
    modules = list(root.modules())
    for m in modules:
        for p in compat.module_parameters(m).values():
            if p is not None and ((DTensor and isinstance(p, DTensor)) or compat.fsdp1_flattened(p)):
                return None
        for b in compat.module_buffers(m).values():
            if b is not None and DTensor and isinstance(b, DTensor):
                return None
    return modules


def owned_by(modules: Sequence[nn.Module], tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor in ``tensors`` views the storage of a parameter or buffer of ``modules`` (what a
    state dict of them returns, unless a state-dict hook made new tensors)."""
    owners = {t.data_ptr() for m in modules
              for t in (*compat.module_parameters(m).values(), *compat.module_buffers(m).values())
              if t is not None}
    return all(t.data_ptr() in owners for t in tensors)


def state_fingerprint(modules: Sequence[nn.Module], optimizers: Sequence[Any],
                      extra: Sequence[Tensor | None] = ()) -> list[Any]:
    """What :func:`live_state`'s answer for plain ``modules`` rests on, read without it: the module tree, every
    parameter's and buffer's identity, storage and ``requires_grad``, every optimizer's per-parameter state
    (which parameters have one, its dict, its keys, its tensors and their storage), and the ``extra`` tensors'
    (the scaler's). Two equal fingerprints: the same entries, backed by the same tensors. One pass of
    comprehensions, made when a snapshot is taken (every ``snapshot_every`` steps), never on other steps."""
    params, buffers, children = compat.module_parameters, compat.module_buffers, compat.module_children
    fp: list[Any] = [id(child) for m in modules for child in children(m).values()]
    fp += [None if p is None else (id(p), p.requires_grad, p.data_ptr())
           for m in modules for p in params(m).values()]
    fp += [None if b is None else (id(b), b.data_ptr()) for m in modules for b in buffers(m).values()]
    for opt in optimizers:
        fp.append(id(opt))
        fp += [(id(p), id(s), *[(k, id(v), v.data_ptr()) if isinstance(v, Tensor) else k for k, v in s.items()])
               for p, s in opt.state.items()]
    fp += [None if t is None else (id(t), t.data_ptr()) for t in extra]
    return fp
