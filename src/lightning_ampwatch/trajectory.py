"""The FP32 control as a run, not one batch: a budgeted ring of host snapshots and a trajectory replay.

One batch replayed in FP32 with the current weights cannot tell float16 from a diverging optimisation: once a
too-high LR has inflated the weights, FP32 computes that batch fine while FP32 *training* diverges as well. So the
control restores a snapshot from before the onset and re-runs those optimizer steps in FP32; a second replay at
the run's own precision tells whether the fault reproduces at all. Both run in place on the live module and then
put the live state back exactly, so the run continues bit-identically.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import operator
import os
from collections import OrderedDict, deque
from itertools import chain, islice, repeat, takewhile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat, deepspeed_state, distributed, sharding, snapshot_copy
from lightning_ampwatch.probes import MicroBatch, loss_of, no_trace, silenced_log, tensors_in
from lightning_ampwatch.remedies.hold_lr import LrCeiling, clamp_lrs, param_groups
from lightning_ampwatch.remedies.island import ISLAND_ATTR, attach_island, detach_island
from lightning_ampwatch.verdicts import TrajectoryResult

PRECISIONS = ("fp32", "amp", "bf16")
BUDGET_FRACTION = 0.1  # the default budget: a tenth of the host's RAM ...
BUDGET_CAP = 8 * 2**30  # ... but never more than 8 GiB
BUDGET_UNKNOWN_RAM = 2**30  # where the host's RAM cannot be read


def default_budget_bytes() -> int:
    """A tenth of the host's total RAM, capped at 8 GiB (1 GiB where the RAM cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return BUDGET_UNKNOWN_RAM
    return int(min(total * BUDGET_FRACTION, BUDGET_CAP))


# --------------------------------------------------------------------------------------------
# What drives an optimizer step outside Lightning's loop
# --------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """The pieces of a fit that a replay drives step by step, exactly as Lightning's automatic optimization does."""

    module: Any  # the LightningModule: its training_step(batch, batch_idx) and lr_scheduler_step
    optimizers: list[torch.optim.Optimizer]
    scaler: Any = None  # the run's GradScaler, or None (bf16, fp32)
    schedulers: list[tuple[Any, int]] = field(default_factory=list)  # step-interval (scheduler, frequency)
    clip_val: float | None = None
    clip_algorithm: str = "norm"
    accumulate: int = 1  # Lightning divides each micro-batch's loss by accumulate_grad_batches
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forward_context: Callable[[], Any] = contextlib.nullcontext  # the precision plugin's: the amp replay's autocast
    unavailable: str | None = None  # why the trajectory control cannot run in this fit; None when it can
    #: why the FP32 replay cannot run though snapshots can (FSDP gathers half-precision parameters for compute): the
    #: snapshots still serve rollback; None when it can
    fp32_unavailable: str | None = None
    step_loss: Callable[[Any, int], Any] | None = None  # one micro-batch's loss; None: module.training_step

    root: Any = None  # the module as the strategy wraps it (DDP, FSDP1, FSDP2): state is read from it; else module
    #: DDP with a scaler: every rank holds the same state, so each keeps 1/N of a snapshot and the ranks put it
    #: back together on restore (a collective; restores then happen on every rank at once: the ranks meet
    #: anomalies together under a scaler). Off without a scaler, where a rank may replay alone.
    split: bool = False
    #: Why the steps cannot be replayed (re-run) in this fit although snapshots can be taken and put back (a rollback
    #: needs only those); None when they can.
    replay_unavailable: str | None = None
    #: the LRs each step of the run ran with, as the step ledger read them (``lr_history.LrLog``): a replayed step
    #: runs at them where the restored schedulers give others (an LR a callback set); None: the schedulers' alone
    lr_log: Any = None

    def __post_init__(self) -> None:
        if self.root is None:
            self.root = self.module

    @classmethod
    def from_trainer(cls, trainer: Any, pl_module: Any) -> "TrainState":
        """Read from a fitting Trainer (call it once optimizers exist: ``on_train_start`` or later)."""
        plugin = trainer.precision_plugin
        root = getattr(trainer.strategy, "model", None)
        root = root if isinstance(root, torch.nn.Module) else pl_module
        unavailable = replay_unavailable = fp32_unavailable = None
        if not pl_module.automatic_optimization:
            unavailable = ("the trajectory control is not available under manual optimization: training_step "
                           "steps the optimizers itself, so its steps cannot be re-run one by one")
        elif deepspeed_state.is_engine(root):  # its module is half precision by design (float32 masters elsewhere)
            unavailable = sharding.unsupported_reason(root, list(trainer.optimizers))
            # snapshots (and rollbacks) where they are available; the replays never
            replay_unavailable = deepspeed_state.REPLAY_UNAVAILABLE if unavailable is None else None
        elif any(p.dtype in sharding.HALF for p in pl_module.parameters() if p.requires_grad):
            # frozen half-precision weights (a bf16 base under a LoRA or a head) are fine: they are not trained,
            # and the FP32 replay computes them in float32 (sharding.fp32_frozen)
            unavailable = ("the trajectory control is not available: the trained weights themselves are half "
                           "precision (a '16-true' or 'bf16-true' run), so there is no FP32 run to replay")
        else:
            unavailable = sharding.unsupported_reason(root, list(trainer.optimizers))
        if unavailable is None:  # the snapshots are taken in any case below: a rollback needs no FP32 replay
            fp32_unavailable = sharding.fp32_replay_unavailable(root)
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not _enabled(scaler):
            scaler = None  # a disabled GradScaler scales nothing: the run has no scaler to replay with
        algorithm = trainer.gradient_clip_algorithm
        split = scaler is not None and sharding.replicated(root)
        return cls(
            module=pl_module,
            optimizers=list(trainer.optimizers),
            scaler=scaler,
            schedulers=[(c.scheduler, c.frequency) for c in trainer.lr_scheduler_configs
                        if c.interval == "step" and not c.reduce_on_plateau],
            clip_val=trainer.gradient_clip_val,
            clip_algorithm=str(getattr(algorithm, "value", algorithm) or "norm"),
            accumulate=trainer.accumulate_grad_batches,
            device=pl_module.device,
            forward_context=plugin.forward_context,
            unavailable=unavailable,
            fp32_unavailable=fp32_unavailable,
            # through a root FSDP1 wrapper's forward, which gathers the parameters (a plain call everywhere else)
            step_loss=functools.partial(sharding.training_step, root, pl_module) if sharding.redirects(root) else None,
            root=root,
            split=split,
            replay_unavailable=replay_unavailable,
        )


# --------------------------------------------------------------------------------------------
# Snapshots: host copies of everything an optimizer step changes
# --------------------------------------------------------------------------------------------


class _At(NamedTuple):
    """Where a tensor went in a snapshot's flat list of host copies, and the device it is restored to. In a
    snapshot split across DDP ranks, ``owner`` is the rank that holds the copy (``index`` is -1 on the others, which
    receive it from the owner on restore, into a tensor of ``shape`` and ``dtype`` where no live one fits)."""

    index: int
    device: torch.device
    owner: int = -1  # -1: this rank holds it (not split)
    shape: Any = None
    dtype: Any = None


@dataclass
class _ScalerState:
    scale: _At | float  # a host copy of the live scale tensor, or the initial scale of a scaler not yet used
    tracker: _At | int
    growth_factor: float
    backoff_factor: float
    growth_interval: int


class SnapshotError(RuntimeError):
    """A snapshot cannot be put back as it stands (the live state no longer matches what it left out)."""


@dataclass
class Snapshot:
    """The trained state (module parameters that require gradients and buffers, every optimizer's state), the
    scaler's and the step schedulers' state and the RNG, taken after optimizer step ``step``. The module and
    optimizer state come from torch's distributed state-dict machinery (:mod:`~lightning_ampwatch.sharding`; under
    FSDP1 from its flat parameters' shards directly), so under DDP, FSDP1 and FSDP2 each rank copies what it holds; frozen parameters are left out and only their version
    counters kept. Tensors are host copies; the loops' counters are not included (``global_step`` stays
    monotonic)."""

    step: int
    host: list[Tensor]  # every tensor, flat; a ring slot reused by the next snapshot of the same layout
    model: list[tuple[str, _At | Any]]  # the model state dict's entries (trainable parameters and buffers)
    optim_state: list[tuple[str, dict[str, Any]]]  # per parameter name: its optimizer state
    groups: list[list[dict[str, Any]]]  # per optimizer: its param groups, without the params
    grads: list[_At | Tensor | None] | None  # only in the live state a replay puts back (a sparse one as is)
    schedulers: list[dict[str, Any]]
    scaler: _ScalerState | None
    rng: Tensor
    cuda_rng: Tensor | None
    pinned: bool
    frozen: tuple[tuple[str, int], ...] = ()  # (name, version counter) of each frozen parameter when taken
    #: the ``(shape, dtype)`` of every host tensor, as the ring's copy plan made it (None: not through a plan)
    layout: Any = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.host)

    @classmethod
    def take(cls, state: TrainState, step: int, *, slot: list[Tensor] | None = None,
             grads: bool = False, split: bool = False) -> "Snapshot":
        """Copy the live state to the host. On an accelerator the copies go into pinned buffers without a sync
        (``slot``, when its layout matches, is reused rather than allocated). ``step`` is the optimizer step it
        is taken after (-1 for the live state a replay puts back, which is no step's). ``split``: this rank's
        share only, as the ring takes it under DDP (``state.split``); restoring it takes every rank."""
        return cls._copied(state, step, *_gather(state, grads, split=split), slot)

    @classmethod
    def _copied(cls, state: TrainState, step: int, live: list[Tensor], parts: dict[str, Any],
                slot: list[Tensor] | None, layout: list[Any] | None = None,
                slot_layout: list[Any] | None = None, side_stream: bool = False) -> "Snapshot":
        """``layout``: the live tensors' ``(shape, dtype)`` as a copy plan keeps them; a ``slot`` made to the very
        same layout (``slot_layout``) is reused without comparing it again. ``side_stream``: on CUDA, the copy runs
        off the compute stream (the ring's snapshots; :mod:`~lightning_ampwatch.snapshot_copy`)."""
        pinned = state.device.type == "cuda"
        if slot is None or ((layout is None or slot_layout is not layout)
                            and [(t.shape, t.dtype) for t in slot] != [(t.shape, t.dtype) for t in live]):
            slot = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in live]
        if live and pinned and side_stream:  # off the compute stream: the next optimizer step waits for it there
            snapshot_copy.copy_to_host(slot, live, state)
        elif live:
            compat.copy_all(slot, live, non_blocking=pinned)  # one call: a copy_ per tensor, in C++
        return cls(step=step, host=slot, **parts, rng=torch.get_rng_state(),
                   cuda_rng=torch.cuda.get_rng_state(state.device) if pinned else None, pinned=pinned,
                   layout=layout)

    def stale(self, state: TrainState) -> str | None:
        """Why this snapshot can no longer be put back (a frozen parameter changed in place since, or the optimizers
        were replaced), or None."""
        swapped = getattr(state.lr_log, "swapped_at", None)
        if swapped is not None:
            return (f"the optimizers were replaced during the run (seen at step {swapped}): the snapshots hold the "
                    "old optimizers' state, so none can be put back")
        name = sharding.changed_frozen(self.frozen, state.root)
        if name is None:
            return None
        return (f"the frozen parameter {name!r} was changed in place after the snapshot of step {self.step} was "
                "taken (its version counter moved); snapshots leave frozen parameters out, so this one cannot be "
                "put back")

    def restore(self, state: TrainState, ready: Callable[[], None] | None = None) -> None:
        """Put this state into the live objects, in place (no second model, no new tensors where the layout
        allows). Raises :class:`SnapshotError`, before changing anything, when it cannot. ``ready``: called once
        every check has passed, right before the first entry is put back (for a split snapshot, before the first
        broadcast): the ranks' meeting (:class:`~lightning_ampwatch.protocol.Meeting`), which may raise."""
        if self.step >= 0:
            why = self.stale(state)
            if why is not None:
                raise SnapshotError(why)
        if self.pinned:
            snapshot_copy.settle()  # the side stream's host copies land before the compute stream reads them back
        model_sd, optim_sd = sharding.live_state(state.root, state.optimizers,
                                                 create=[k for k, _ in self.optim_state])
        self._rank = distributed.rank()
        missing = [k for k, _ in self.model if k not in model_sd] + \
                  [k for k, _ in self.optim_state if k not in optim_sd]
        if missing:
            raise SnapshotError(f"the live state has no entry {missing[0]!r} that the snapshot holds")
        if ready is not None:
            ready()
        with torch.no_grad():
            for key, saved in self.model:
                if isinstance(saved, _At):
                    self._put(saved, sharding.local(model_sd[key]))
            held = {k for k, _ in self.optim_state}
            for key, current in optim_sd.items():
                if key not in held:
                    current.clear()  # state created after the snapshot: torch's optimizers start it afresh
            for key, saved_state in self.optim_state:
                current = optim_sd[key]
                restored = {k: self._value(v, current.get(k)) for k, v in saved_state.items()}
                current.clear()
                current.update(restored)
            if self.grads is not None:
                for p, saved in zip(_trainable(state), self.grads):
                    if saved is not None and p.grad is None:  # (a replay that stopped before its backward)
                        p.grad = torch.zeros_like(p)  # laid out as the parameter is (a DTensor's local shard filled)
                    p.grad = None if saved is None else self._value(saved, p.grad)
            for opt, groups in zip(state.optimizers, self.groups):
                for group, saved_group in zip(opt.param_groups, groups):
                    for key in [k for k in group if k != "params" and k not in saved_group]:
                        del group[key]
                    for key, value in saved_group.items():
                        group[key] = self._value(value, group.get(key))
            if self.scaler is not None and state.scaler is not None:
                self._restore_scaler(state.scaler)
        sharding.after_restore(state.root)
        for (scheduler, _), saved_sched in zip(state.schedulers, self.schedulers):
            scheduler.load_state_dict(copy.deepcopy(saved_sched))
        torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, state.device)

    def _value(self, saved: Any, current: Any) -> Any:
        """A saved value made live again: copied into ``current`` (its local shard) when it is a tensor of the same
        layout."""
        if not isinstance(saved, _At):
            return copy.deepcopy(saved)
        shape, dtype = (saved.shape, saved.dtype) if saved.owner >= 0 else \
            (self.host[saved.index].shape, self.host[saved.index].dtype)
        if isinstance(current, Tensor):
            target = sharding.local(current)
            if target.shape == shape and target.dtype == dtype and target.device == saved.device:
                self._put(saved, target)
                return current
        fresh = torch.empty(shape, dtype=dtype, device=saved.device)
        self._put(saved, fresh)
        return fresh

    def _put(self, saved: _At, target: Tensor) -> None:
        """The saved tensor into ``target``: copied from this rank's host copy, or, in a split snapshot, sent by the
        rank that holds it (every rank calls this for every entry, in the same order)."""
        if saved.owner < 0:
            target.copy_(self.host[saved.index], non_blocking=self.pinned)
            return
        if saved.owner == getattr(self, "_rank", 0):
            target.copy_(self.host[saved.index])
        sharding.broadcast(target, saved.owner)

    def _restore_scaler(self, scaler: Any) -> None:
        saved = self.scaler
        assert saved is not None
        scale_t, tracker_t = compat.scale_tensor(scaler), compat.growth_tracker_tensor(scaler)
        if isinstance(saved.scale, _At) and scale_t is not None:
            scale_t.copy_(self.host[saved.scale.index], non_blocking=self.pinned)
            tracker_t.copy_(self.host[saved.tracker.index], non_blocking=self.pinned)  # type: ignore[union-attr]
        else:
            scaler.load_state_dict(self.scaler_state_dict())

    def scaler_state_dict(self) -> dict[str, Any]:
        """The scaler's state as ``GradScaler.load_state_dict`` takes it (reads host copies only)."""
        saved = self.scaler
        assert saved is not None
        if self.pinned:
            snapshot_copy.finish()  # read on the host: the side stream's copies complete
        scale, tracker = saved.scale, saved.tracker
        return {
            "scale": float(self.host[scale.index].item()) if isinstance(scale, _At) else scale,
            "_growth_tracker": int(self.host[tracker.index].item()) if isinstance(tracker, _At) else tracker,
            "growth_factor": saved.growth_factor, "backoff_factor": saved.backoff_factor,
            "growth_interval": saved.growth_interval,
        }


def _trainable(state: TrainState) -> list[Tensor]:
    return [p for p in state.module.parameters() if p.requires_grad]


def _gather(state: TrainState, grads: bool, split: bool = False) -> tuple[list[Tensor], dict[str, Any]]:
    """Every live tensor a snapshot copies, flat (a DTensor's local shard), and where each goes back (the other
    values copied as they are). ``split``: this rank's share only of the state every DDP rank holds alike (the
    scaler, the gradients and the RNG stay whole: they are small, or differ by rank)."""
    live, parts, _, _ = _resolve(state, grads, split)
    return live, parts


def _resolve(state: TrainState, grads: bool, split: bool = False
             ) -> tuple[list[Tensor], dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
    """:func:`_gather`'s answer, and the state dicts it was read from (model, optimizer state by name)."""
    live: list[Tensor] = []
    split = split and distributed.world_size() > 1
    me = distributed.rank()
    loads = [0] * distributed.world_size()  # bytes each rank holds so far: the next tensor goes to the least loaded

    def at(t: Tensor) -> _At:
        t = sharding.local(t.detach())
        live.append(t)
        return _At(len(live) - 1, t.device)

    def shared(t: Tensor) -> _At:
        """A tensor every DDP rank holds alike: in a split snapshot only its owner copies it."""
        if not split:
            return at(t)
        t = sharding.local(t.detach())
        owner = loads.index(min(loads))
        loads[owner] += t.nbytes
        if owner != me:
            return _At(-1, t.device, owner, t.shape, t.dtype)
        live.append(t)
        return _At(len(live) - 1, t.device, owner, t.shape, t.dtype)

    def keep(value: Any) -> Any:
        return shared(value) if isinstance(value, Tensor) else copy.deepcopy(value)

    model_sd, optim_sd = sharding.live_state(state.root, state.optimizers)
    parts: dict[str, Any] = {
        "model": [(k, keep(v)) for k, v in model_sd.items()],
        "optim_state": [(k, {name: keep(v) for name, v in per.items()}) for k, per in optim_sd.items()],
        "groups": [[{k: keep(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
                   for opt in state.optimizers],
        # (not under FSDP1: its gradients live in its flat parameters, and the next step's zero_grad clears them)
        # a sparse gradient (``nn.Embedding(sparse=True)``) is kept as a copy of itself, sparse as it was: the
        # host slots are dense, and its rows are few
        "grads": [None if p.grad is None else p.grad.detach().clone() if p.grad.is_sparse else at(p.grad)
                  for p in _trainable(state)]
        if grads and not sharding.uses_fsdp1(state.root) else None,
        "schedulers": [copy.deepcopy(s.state_dict()) for s, _ in state.schedulers],
        "scaler": None,
        "frozen": sharding.frozen_versions(state.root),
    }
    sc = state.scaler
    if sc is not None and _enabled(sc):
        if compat.scale_tensor(sc) is None:  # not used yet: its state is plain numbers, read without a sync
            scale, tracker = compat.initial_scale(sc)
        else:  # device tensors, copied without a sync (GradScaler.state_dict() would .item() them)
            scale, tracker = at(compat.scale_tensor(sc)), at(compat.growth_tracker_tensor(sc))  # type: ignore[arg-type]
        parts["scaler"] = _ScalerState(scale, tracker, sc.get_growth_factor(), sc.get_backoff_factor(),
                                       sc.get_growth_interval())
    return live, parts, model_sd, optim_sd


def _enabled(scaler: Any) -> bool:
    """A GradScaler made with ``enabled=False`` (as Lightning's FSDP precision makes one without CUDA) scales
    nothing and keeps no state."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


_NBYTES = operator.attrgetter("nbytes")
_TENSOR_ONLY = {Tensor}


def _nbytes(micro_batches: Sequence[Any]) -> int:
    """The bytes of the micro-batches' tensors (``tensors_in`` each batch), without its walk for the usual batch:
    a tensor, or a tuple or list of plain tensors."""
    total = 0
    for mb in micro_batches:
        batch = mb[0]
        kind = type(batch)
        if kind is Tensor:
            total += batch.nbytes
        elif (kind is tuple or kind is list) and set(map(type, batch)) == _TENSOR_ONLY:
            total += sum(map(_NBYTES, batch))
        else:
            total += sum(t.nbytes for t in tensors_in(batch))
    return total


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_SEQUENCES = frozenset({tuple, list})
_DICT_ONLY = {dict}
_MAP_NBYTES = functools.partial(map, _NBYTES)  # one batch's tensors' ``nbytes``, lazily, for ``sum``


def _column_nbytes(column: Sequence[Sequence[Any]]) -> list[int]:
    """``[_nbytes(b) for b in column]`` (the bytes of each step's micro-batches), with the same values, walking the
    column in C for the usual batches instead of a Python call per step: every step with as many micro-batches,
    each batch a tensor, a tuple or list of plain tensors, or a dict of plain tensors, the same kind in every
    step (the shapes and dtypes may differ: each tensor's ``nbytes`` is read). Any other column goes step by step
    through :func:`_nbytes`. A tensor held twice counts twice, as :func:`_nbytes` counts it."""
    lengths = set(map(len, column))
    if len(lengths) == 1:
        per_step = lengths.pop()
        if per_step == 0:
            return [0] * len(column)
        # ``mb[0]`` of every micro-batch, the steps' in a row
        batches = list(map(_FIRST, chain.from_iterable(column) if per_step > 1 else map(_FIRST, column)))
        kinds = set(map(type, batches))
        sizes: list[int] | None = None
        if kinds == _TENSOR_ONLY:
            sizes = list(map(_NBYTES, batches))
        elif kinds <= _SEQUENCES:
            if set(map(type, chain.from_iterable(batches))) == _TENSOR_ONLY:
                sizes = list(map(sum, map(_MAP_NBYTES, batches)))
        elif kinds == _DICT_ONLY:
            values = list(map(dict.values, batches))
            if set(map(type, chain.from_iterable(values))) == _TENSOR_ONLY:
                sizes = list(map(sum, map(_MAP_NBYTES, values)))
        if sizes is not None:
            return sizes if per_step == 1 else list(map(sum, zip(*[iter(sizes)] * per_step)))
    return list(map(_nbytes, column))


def _as_micro_batches(micro_batches: Sequence[Any]) -> list[MicroBatch]:
    """``MicroBatch`` records, from them or from the plain tuples the callback keeps."""
    return [mb if isinstance(mb, MicroBatch) else MicroBatch(*mb) for mb in micro_batches]


def _params_of(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


# --------------------------------------------------------------------------------------------
# The ring's fast path: what a snapshot copies, resolved once and reused while the live objects stay the same
# --------------------------------------------------------------------------------------------

#: Values a snapshot keeps as they are: immutable, so the live value is its own copy (as ``copy.deepcopy`` has it).
_IMMUTABLE = frozenset({int, float, bool, str, bytes, complex, type(None)})


class _Replan(Exception):
    """The live state holds a tensor where the plan has a plain value: resolve it again."""


def _kept(value: Any) -> Any:
    """A param group's value as :func:`_resolve` keeps it (``copy.deepcopy``), without the call for a tuple of
    immutable values (Adam's ``betas``), which ``deepcopy`` returns as it is."""
    if isinstance(value, Tensor):
        raise _Replan
    if type(value) is tuple and _IMMUTABLE.issuperset(map(type, value)):
        return value
    return copy.deepcopy(value)


class _CopyPlan:
    """What a ring's snapshot of a plain module (or DDP) copies, resolved once through torch's state-dict machinery
    (:func:`_resolve`) and reused while :func:`sharding.state_fingerprint` of the live objects stays the same: the
    live tensors in order and where each goes back (DDP's split ownership included), and the frozen parameters.
    A snapshot through it is the fingerprint, the param groups' and schedulers' values, and one
    ``torch._foreach_copy_``; anything the fingerprint sees change (optimizer state created, a tensor replaced or
    its storage swapped, a parameter frozen, the scaler's first step) resolves it afresh. Sharded models (DTensor
    shards) are resolved at every snapshot, as before."""

    def __init__(self, state: TrainState, modules: list[torch.nn.Module], live: list[Tensor],
                 parts: dict[str, Any], optim_sd: dict[str, dict[str, Any]]) -> None:
        self.state = state
        self.modules = modules
        self.live = live
        self.layout = [(t.shape, t.dtype) for t in live]
        self.nbytes = sum(t.nbytes for t in live)
        self.model = parts["model"]  # every entry an _At: shared by the snapshots taken through this plan
        self.optim_state = parts["optim_state"]
        #: only tensors in the optimizer state: its entries are shared too; else the plain values are copied afresh
        self.static = all(isinstance(v, _At) for _, per in self.optim_state for v in per.values())
        self.optim_live = [optim_sd[key] for key, _ in self.optim_state]  # the optimizer's own per-parameter dicts
        self.scaler = parts["scaler"]
        self.frozen = [(name, p) for name, p in state.root.named_parameters() if not p.requires_grad]
        self.fingerprint = self._fingerprint()

    @classmethod
    def resolve(cls, state: TrainState, split: bool
                ) -> tuple["_CopyPlan | None", list[Tensor], dict[str, Any]]:
        """A snapshot's tensors and parts through the state-dict machinery, and the plan that reuses them (None
        where the live state cannot be followed by a fingerprint: a sharded model, a state dict with values other
        than the modules' own tensors, a tensor in a param group)."""
        live, parts, model_sd, optim_sd = _resolve(state, grads=False, split=split)
        modules = sharding.plain_modules(state.root)
        if modules is None or not all(isinstance(v, _At) for _, v in parts["model"]):
            return None, live, parts
        if any(isinstance(v, Tensor) for opt in state.optimizers for g in opt.param_groups for v in g.values()
               if v is not g["params"]):
            return None, live, parts
        if not sharding.owned_by(modules, list(model_sd.values())):
            return None, live, parts
        return cls(state, modules, live, parts, optim_sd), live, parts

    def _fingerprint(self) -> list[Any]:
        sc = self.state.scaler
        extra = (compat.scale_tensor(sc), compat.growth_tracker_tensor(sc)) if sc is not None else ()
        return sharding.state_fingerprint(self.modules, self.state.optimizers, extra)

    def gather(self) -> tuple[list[Tensor], dict[str, Any]] | None:
        """What :func:`_gather` would answer now, or None when the plan no longer holds (resolve it again)."""
        if self._fingerprint() != self.fingerprint:
            return None
        state = self.state
        try:
            groups = [[{k: v if type(v) in _IMMUTABLE else _kept(v) for k, v in g.items() if k != "params"}
                       for g in opt.param_groups] for opt in state.optimizers]
        except _Replan:
            return None
        optim_state = self.optim_state if self.static else [
            (key, {name: v if type(v) is _At else copy.deepcopy(per[name]) for name, v in saved.items()})
            for (key, saved), per in zip(self.optim_state, self.optim_live)]
        scaler = self.scaler
        if scaler is not None:
            sc = state.scaler
            scale, tracker = (scaler.scale, scaler.tracker) if isinstance(scaler.scale, _At) else \
                compat.initial_scale(sc)
            scaler = _ScalerState(scale, tracker, sc.get_growth_factor(), sc.get_backoff_factor(),
                                  sc.get_growth_interval())
        return self.live, {
            "model": self.model,
            "optim_state": optim_state,
            "groups": groups,
            "grads": None,
            "schedulers": [copy.deepcopy(s.state_dict()) for s, _ in state.schedulers],
            "scaler": scaler,
            "frozen": tuple((name, compat.tensor_version(p)) for name, p in self.frozen),
        }


# --------------------------------------------------------------------------------------------
# The ring: snapshots every few optimizer steps, and the batches since the oldest
# --------------------------------------------------------------------------------------------


class SnapshotRing:
    """Host snapshots every ``every`` optimizer steps (the newest ``keep``) and the micro-batches run since the
    oldest, all within one byte budget (by default the host's, shared by its ``processes_per_node``). When one snapshot plus ``every`` steps of batches does not fit, the ring
    is off for the run and ``reason`` says why and what it would need."""

    def __init__(self, budget_bytes: int | None = None, every: int = 10, keep: int = 2,
                 processes_per_node: int = 1) -> None:
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes <= 0):
            raise ValueError(f"budget_bytes={budget_bytes!r}: expected a positive number of bytes, or None for "
                             f"the default ({default_budget_bytes()} bytes on this host)")
        for name, value in (("every", every), ("keep", keep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a whole number of at least 1")
        # the default budget is the node's: each of the processes training on this host gets its share of it
        self.budget_bytes = default_budget_bytes() // max(1, int(processes_per_node)) if budget_bytes is None \
            else budget_bytes
        self.every = every
        self.keep = keep
        self.enabled = True
        self.reason: str | None = None
        self.bytes_per_snapshot = 0
        self._snapshots: deque[Snapshot] = deque()
        #: step -> (batches, bytes). Their bytes are taken when they are added (a run's as one column; -1 where
        #: that failed: they are counted at the snapshot, whose failure it then is), and enter the totals when the next
        #: snapshot is due, as before: in order, the newest ``len(_fresh)`` steps' bytes are not in the totals yet
        #: (``_fresh`` holds them); out of order, a step's bytes not in the totals yet are kept as ``~bytes``.
        self._batches: OrderedDict[int, tuple[list[Any], int]] = OrderedDict()
        self._fresh: list[int | None] = []  # in order: the bytes of the steps added since the last count (None: failed)
        self._batch_bytes = 0  # what the held batches take, kept as they come and go (read every step)
        self._step_batch_bytes = 0  # the most one step's batches have held
        self._unheld: Sequence[Any] | None = None  # the latest batches seen before the first snapshot
        #: the held steps were added in increasing order (as a run adds them): counting and pruning then walk only
        #: the new and the dropped ends of ``_batches``, not every held step
        self._in_order = True
        self._newest_held = -1
        #: the most steps of batches held: the newest ``keep`` snapshots' span and as much again
        self.max_held_steps = every * (keep + 2)
        self.dropped: str | None = None  # why the snapshots were let go mid-run, until the next one is taken
        self._plan: _CopyPlan | None = None  # what the latest snapshot copied, reused while it holds

    @property
    def snapshots(self) -> tuple[Snapshot, ...]:
        """The snapshots held, oldest first (the oldest gives the longest window)."""
        return tuple(self._snapshots)

    @property
    def held_bytes(self) -> int:
        return sum(s.nbytes for s in self._snapshots) + self._batch_bytes

    def add_batches(self, step: int, micro_batches: Sequence[Any]) -> None:
        """Keep references to the micro-batches optimizer step ``step`` ran on (``MicroBatch`` or its tuple).
        Call it before ``after_step`` for the same step. Their bytes are taken now (the step's own, just run on),
        and enter the totals when the next snapshot is due, as if counted then: between two snapshots the batches
        held can grow by ``every`` steps' worth, which :meth:`_fits` allows."""
        if not self.enabled:
            return
        if self._snapshots and len(self._batches) >= self.max_held_steps:
            # A long stretch of trouble (no snapshot is taken while it lasts) would hold every batch of it: a run
            # stuck at NaN for thousands of steps grew without bound. Past this many steps the snapshots from
            # before it are too old to go back to: let them go, with the batches, and say so where they are asked
            # for. Snapshots resume once the run is quiet again.
            first = next(iter(self._batches), step)
            self.reset()
            self.dropped = (f"the snapshots from before step {first} were let go after {self.max_held_steps} "
                            "steps without a new one (a long stretch of trouble)")
        if self._snapshots:
            if step <= self._newest_held and self._batches and self._in_order:
                self._out_of_order()
            self._newest_held = step
            try:
                nbytes = _nbytes(micro_batches)
            except Exception:  # noqa: BLE001 - counted again at the snapshot, which fails as it did before
                nbytes = None
            if self._in_order:
                self._batches[step] = (micro_batches, -1 if nbytes is None else nbytes)
                self._fresh.append(nbytes)
            else:
                self._batches[step] = (micro_batches, -1 if nbytes is None else ~nbytes)
        else:  # nothing to replay them from yet, but their size tells what the first snapshot's batches need
            self._unheld = micro_batches

    def add_run(self, steps: Sequence[int], batches: Sequence[Any]) -> None:
        """:meth:`add_batches` for a run of steps taken in later, at once, as columns (in step order): one ``update``
        of the held steps when the run comes after them and stays within ``max_held_steps`` (the usual case), their
        bytes taken as one column (:func:`_column_nbytes`), else one call per step."""
        if not self.enabled or not steps:
            return
        if not self._snapshots:
            self._unheld = batches[-1]  # as add_batches: only the latest is kept
            return
        held = self._batches
        if len(held) + len(steps) <= self.max_held_steps and (steps[0] > self._newest_held or not held):
            try:
                sizes: list[int] | None = _column_nbytes(batches)  # the run's bytes, in one walk of the column
            except Exception:  # noqa: BLE001 - as add_batches: counted again at the snapshot
                sizes = None
            if sizes is None:
                held.update(zip(steps, zip(batches, repeat(-1))))
                if self._in_order:
                    self._fresh += repeat(None, len(steps))
            elif self._in_order:
                held.update(zip(steps, zip(batches, sizes)))
                self._fresh += sizes
            else:
                held.update(zip(steps, zip(batches, map(operator.invert, sizes))))
            self._newest_held = steps[-1]
            return
        for step, micro_batches in zip(steps, batches):
            self.add_batches(step, micro_batches)

    def after_step(self, step: int, state: TrainState, *, due: bool = False) -> None:
        """Optimizer step ``step`` (0-based: ``trainer.global_step - 1`` once it is over) is over: take a snapshot
        when ``step`` is a multiple of ``every``, or when ``due`` (the fit's start: ``step`` is then the step before
        the first one it runs, -1 for a fresh fit, so that an episode at step 0 has a state from before it)."""
        if not self.enabled or (step % self.every and not due):
            return
        if state.unavailable is not None:
            self.turn_off(state.unavailable)
            return
        self._count_batches()
        live, parts, layout = self._gather(state)
        self.bytes_per_snapshot = self._plan.nbytes if layout is not None else sum(t.nbytes for t in live)
        if not self._fits():
            self.turn_off()
            return
        spare: Snapshot | None = None
        while self._snapshots and (len(self._snapshots) >= self.keep
                                   or self.held_bytes + self.bytes_per_snapshot > self.budget_bytes):
            spare = self._drop_oldest()
        self._snapshots.append(Snapshot._copied(state, step, live, parts, spare.host if spare else None, layout,
                                                spare.layout if spare else None, side_stream=True))
        self.dropped = None
        self._prune()

    def _gather(self, state: TrainState) -> tuple[list[Tensor], dict[str, Any], list[Any] | None]:
        """What a snapshot copies now: through the copy plan while it holds (its layout is the third value),
        else resolved afresh through the state-dict machinery (and a new plan kept where one can be)."""
        plan = self._plan
        if plan is not None and plan.state is state:
            gathered = plan.gather()
            if gathered is not None:
                return (*gathered, plan.layout)
        self._plan = plan = None  # a failure below leaves no stale plan behind
        plan, live, parts = _CopyPlan.resolve(state, state.split)
        self._plan = plan
        return live, parts, plan.layout if plan is not None else None

    def _count_batches(self) -> None:
        """The batches added since the last count enter the totals (their tensors' ``nbytes``, as :func:`_nbytes`
        counts them). In order, their bytes were taken as they were added: a sum and a max of ``_fresh``, without
        a walk over the held steps; else every held step not in the totals yet, one by one."""
        if self._unheld is not None:
            self._step_batch_bytes = max(self._step_batch_bytes, _nbytes(self._unheld))
            self._unheld = None
        held = self._batches
        if self._in_order:
            fresh, self._fresh = self._fresh, []
            if not fresh:
                return
            if None in fresh:  # some could not be counted when added: counted now (and fail now, as they did)
                newest, fresh = list(islice(reversed(held.items()), len(fresh))), []
                for step, (batches, nbytes) in newest:
                    if nbytes < 0:
                        nbytes = _nbytes(batches)
                        held[step] = (batches, nbytes)
                    fresh.append(nbytes)
            self._batch_bytes += sum(fresh)  # type: ignore[arg-type]
            self._step_batch_bytes = max(self._step_batch_bytes, max(fresh))  # type: ignore[type-var]
            return
        if self._fresh:  # the order was given up since (from outside): those steps' bytes are not in the totals
            self._out_of_order()
        for step in list(held):
            batches, nbytes = held[step]
            if nbytes >= 0:
                continue
            nbytes = _nbytes(batches) if nbytes == -1 else ~nbytes
            held[step] = (batches, nbytes)
            self._batch_bytes += nbytes
            self._step_batch_bytes = max(self._step_batch_bytes, nbytes)

    def _out_of_order(self) -> None:
        """A step comes back out of order: the steps added in order since the last count keep their bytes as
        ``~bytes`` (not in the totals yet), for the walk over every held step that counts from now on."""
        held, fresh = self._batches, self._fresh
        for step in list(islice(reversed(held), len(fresh))):
            batches, nbytes = held[step]
            held[step] = (batches, ~nbytes if nbytes >= 0 else -1)
        self._fresh = []
        self._in_order = False

    def reset(self) -> None:
        """Drop every snapshot and batch (after a rollback they belong to abandoned steps). The snapshots' host
        buffers are not reused, so a snapshot the caller still holds stays intact."""
        self._snapshots.clear()
        self._batches.clear()
        self._batch_bytes = 0
        self._in_order, self._newest_held, self._fresh = True, -1, []

    def newest_before(self, step: int) -> Snapshot | None:
        """The newest snapshot taken after an optimizer step earlier than ``step``."""
        return next((s for s in reversed(self._snapshots) if s.step < step), None)

    def batches(self, from_step: int, to_step: int) -> list[tuple[int, list[MicroBatch]]]:
        """``(step, micro-batches)`` for the held steps from ``from_step`` to ``to_step``, both included."""
        return [(s, _as_micro_batches(b)) for s, (b, _) in self._batches.items() if from_step <= s <= to_step]

    @property
    def step_batch_bytes(self) -> int:
        """The most one step's batches have held: with ``every``, the ring's memory bound for its batches."""
        return self._step_batch_bytes

    def _fits(self) -> bool:
        return self.bytes_per_snapshot + self.every * self._step_batch_bytes <= self.budget_bytes

    def _drop_oldest(self) -> Snapshot:
        oldest = self._snapshots.popleft()
        self._prune()
        return oldest

    def _prune(self) -> None:
        """Drop the batches no held snapshot can replay: those up to the oldest snapshot's step (all, if none)."""
        keep_after = self._snapshots[0].step if self._snapshots else math.inf
        held = self._batches
        if self._in_order:  # the steps rise: those up to ``keep_after`` are at the front, popped in one go
            gone = list(map(held.pop, list(takewhile(functools.partial(operator.ge, keep_after), held))))
            self._batch_bytes -= sum(filter(functools.partial(operator.lt, 0), map(_SECOND, gone)))
            return
        for step in [s for s in held if s <= keep_after]:
            self._batch_bytes -= max(held.pop(step)[1], 0)

    def turn_off(self, reason: str | None = None) -> None:
        """Off for the rest of the run, everything held dropped; ``reason`` (else the budget's) says why."""
        if reason is None:
            need = self.bytes_per_snapshot + self.every * self._step_batch_bytes
            reason = (f"the snapshot ring is off for this run: one snapshot ({self.bytes_per_snapshot} bytes) "
                      f"plus the batches of {self.every} steps ({self.every * self._step_batch_bytes} bytes) "
                      f"need {need} bytes, over the budget of {self.budget_bytes} bytes; a budget of at least "
                      f"{need} bytes would hold them")
        self.enabled = False
        self.reason = reason
        self.reset()
        self._plan = None


# --------------------------------------------------------------------------------------------
# The replay: the window's steps again from a snapshot, then the live state back exactly
# --------------------------------------------------------------------------------------------


def replay_trajectory(state: TrainState, snapshot: Snapshot, steps: Sequence[tuple[int, Sequence[Any]]], *,
                      precision: str, lr_factor: float = 1.0, scale: float | None = None,
                      island: Sequence[str] = (), watch: Sequence[str] = (),
                      stop_on_fault: bool = False, skips_allowed: int = 0,
                      lr_cap: float | None = None, ready: Callable[[], None] | None = None,
                      before_micro_batch: Callable[[], None] | None = None) -> TrajectoryResult:
    """Restore ``snapshot`` in place, run ``steps`` (``(step, micro-batches)`` following the snapshot's step, as
    ``SnapshotRing.batches`` gives them) as Lightning's automatic optimization would, then put the live state back
    exactly (``lr_cap``: no learning rate above it on any replayed step). ``precision="fp32"``: autocast off and no
    scaler (the control); ``"amp"``: the run's forward context
    and a scaler restored from the snapshot (does the fault reproduce?); ``"bf16"``: bfloat16 autocast and no scaler.
    ``lr_factor``: every learning rate (and the step schedulers' base rates) times this for the replay: the lower-LR
    counterfactual. ``scale``: the amp replay's scaler starts at this scale instead of the snapshot's (the growth
    tracker at zero). ``island``: these submodules run in float32 with autocast off for the replay (the FP32 island,
    taken off again after). ``watch``: submodules whose largest finite output magnitude is kept per step
    (``TrajectoryResult.absmax``: how close they come to float16's limit). ``stop_on_fault``: the replay ends at the
    first non-finite step or at the skip after ``skips_allowed`` of them (one host read per step: replays run on
    alarms only). One host read at the end
    otherwise (and one per step for a Fabric loop's ``ReduceLROnPlateau``, stepped on each replayed step's loss).
    ``ready``: the ranks' meeting, passed to the snapshot's restore (after every check of this replay and of the
    restore, before its first collective). ``before_micro_batch``: called before each replayed micro-batch (a
    sharded model's :class:`~lightning_ampwatch.distributed.Lockstep`: its ``next``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    if state.unavailable is not None:
        raise ValueError(state.unavailable)
    if state.replay_unavailable is not None:
        raise ValueError(state.replay_unavailable)
    if precision == "fp32" and state.fp32_unavailable is not None:
        raise ValueError(state.fp32_unavailable)
    indices = [s for s, _ in steps]
    expected = list(range(snapshot.step + 1, snapshot.step + 1 + len(steps)))
    if not steps or indices != expected:
        raise ValueError(f"steps {indices} do not follow the snapshot taken after step {snapshot.step}: expected "
                         f"consecutive steps from {snapshot.step + 1}")
    amp = precision != "fp32"
    if state.device.type == "cuda":
        snapshot_copy.finish()  # the snapshot's host copies are complete (they run on a side stream)
        torch.cuda.current_stream(state.device).synchronize()
    scaler = None
    if precision == "amp" and snapshot.scaler is not None:
        scaler = sharding.replay_scaler(state.scaler, state.device.type)
        saved = snapshot.scaler_state_dict()
        if scale is not None:
            saved = {**saved, "scale": float(scale), "_growth_tracker": 0}
        scaler.load_state_dict(saved)
    context = state.forward_context if precision == "amp" else (
        functools.partial(torch.autocast, state.device.type, dtype=torch.bfloat16))
    live = Snapshot.take(state, -1, grads=True)
    losses: list[Tensor | None] = []
    skipped: list[Tensor] = []
    peaks: list[Tensor] = []
    seen_skips = 0
    module = state.module
    with_island = [name for name in island if getattr(module.get_submodule(name), ISLAND_ATTR, None) is None]
    watcher = _OutputPeaks(module, watch, state.device, every_float=not amp)
    try:
        with no_trace(state.module), _without_step_hooks(state.optimizers), \
                (contextlib.nullcontext(0) if amp else sharding.fp32_frozen(state.module)), watcher:
            for name in with_island:
                attach_island(module, name, state.device.type)
            snapshot.restore(state, ready)
            if lr_factor != 1.0:
                scale_learning_rates(state.optimizers, [s for s, _ in state.schedulers], lr_factor)
            ran = state.lr_log.at if state.lr_log is not None else None
            for step, micro_batches in steps:
                if ran is not None:
                    _run_at(state, ran(step), lr_factor)
                if lr_cap is not None:  # the counterfactual "without the rise": no group above the LR before it
                    groups = param_groups(state.optimizers)
                    clamp_lrs(groups, [lr_cap] * len(groups))
                loss, skip = _replay_step(state, _as_micro_batches(micro_batches), scaler, amp, context,
                                          before_micro_batch)
                losses.append(loss)
                skipped.append(skip)
                peaks.append(watcher.step_peak())
                if stop_on_fault:
                    seen_skips += int(bool(skip))
                    if seen_skips > skips_allowed or (loss is not None and not bool(torch.isfinite(loss).all())):
                        break
            # the root's parameters: under FSDP1 without use_orig_params the module itself holds none
            finite = torch.stack([torch.isfinite(sharding.local(p)).all() for p in state.root.parameters()]).all()
            present = [t.float().reshape(()) for t in losses if t is not None]
            read = torch.stack([*present, finite.float(), *(s.float() for s in skipped),
                                *(p.float() for p in peaks)]).tolist()  # the one read
    finally:
        for name in with_island:
            detach_island(module, name)
        live.restore(state)
    values = iter(read[:len(present)])
    n = len(skipped)
    flags = read[len(present) + 1:len(present) + 1 + n]
    return TrajectoryResult(
        precision=precision, from_step=snapshot.step, steps=indices[:n],
        losses=[None if t is None else next(values) for t in losses],
        params_finite=bool(read[len(present)]), skipped=[bool(v) for v in flags],
        absmax=[float(v) for v in read[len(present) + 1 + n:]] if watch else [],
    )


class _OutputPeaks:
    """Keeps, per replayed step, the largest finite magnitude of every half-precision tensor computed inside the
    ``names`` submodules (their functional ops included: an ``exp()`` of raw scores is no module of its own), on the
    device, read with the replay's one read. Their ``forward`` is wrapped on the instance for the replay only (as the
    FP32 island wraps it) and put back on exit."""

    def __init__(self, module: Any, names: Sequence[str], device: torch.device, every_float: bool = False) -> None:
        self.modules = [module.get_submodule(n) for n in names]
        self.seen: list[Tensor] = []
        self.device = device
        self.replaced: list[tuple[Any, Any]] = []
        # FP32: every float tensor (what float16 would have had to hold); else the half-precision ones only
        self.dtypes = (torch.float16, torch.bfloat16, torch.float32) if every_float else (torch.float16, torch.bfloat16)

    def __enter__(self) -> "_OutputPeaks":
        for m in self.modules:
            before = m.__dict__.get("forward")
            self.replaced.append((m, before))
            m.forward = functools.partial(self._forward, m, before)
        return self

    def __exit__(self, *exc: Any) -> None:
        for m, before in self.replaced:
            if before is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = before
        self.replaced.clear()

    def _forward(self, module: Any, before: Any, *args: Any, **kwargs: Any) -> Any:
        with _HalfPeaks(self.seen, self.dtypes):
            return before(*args, **kwargs) if before is not None else type(module).forward(module, *args, **kwargs)

    def step_peak(self) -> Tensor:
        seen, self.seen = self.seen, []
        if not seen:
            return torch.zeros((), device=self.device)
        return torch.stack([s.to(self.device) for s in seen]).max()


class _HalfPeaks(torch.overrides.TorchFunctionMode):
    """Each torch function's outputs of ``dtypes``: their largest finite magnitude, appended to ``seen``."""

    def __init__(self, seen: list[Tensor], dtypes: tuple[torch.dtype, ...]) -> None:
        super().__init__()
        self.seen = seen
        self.dtypes = dtypes

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        with torch.no_grad():  # (inside its own handler the mode is off: these calls are not seen)
            for t in tensors_in(out):
                if isinstance(t, Tensor) and t.dtype in self.dtypes and t.numel():
                    d = t.detach()
                    self.seen.append(torch.where(torch.isfinite(d), d, torch.zeros((), dtype=d.dtype,
                                                                                   device=d.device)).abs().amax().float())
        return out


def _run_at(state: TrainState, lrs: tuple[float, ...] | None, factor: float) -> None:
    """A replayed step runs at the LRs the run recorded for it (times ``factor``, the lower-LR counterfactual's), where
    the restored schedulers give others: an LR set outside a scheduler (a callback, a hand-written warmup) is replayed
    as the run had it. Nothing when none was recorded that far back, or the groups are not those the LRs were read
    from (a group added, a tensor LR)."""
    if lrs is None:
        return
    groups = [g for opt in state.optimizers for g in opt.param_groups]
    if len(groups) != len(lrs):
        return
    for group, lr in zip(groups, lrs):
        now = group.get("lr")
        if isinstance(now, (int, float)) and not isinstance(now, bool):
            target = lr * factor
            if now != target and not math.isclose(now, target, rel_tol=1e-12, abs_tol=0.0):
                group["lr"] = target


def scale_learning_rates(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any],
                         factor: float) -> None:
    """Every learning rate times ``factor``: the param groups' (and the bounds a scheduler keeps in them) and the
    schedulers' base rates, so that a scheduler's next step keeps the lower level instead of undoing it."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * factor
            for key in ("initial_lr", "max_lr", "min_lr"):
                if isinstance(group.get(key), (int, float)):
                    group[key] = group[key] * factor
    for sched in schedulers:
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]
        compat.scale_last_lr(sched, factor)


def retrain(state: TrainState, steps: Sequence[tuple[int, Sequence[Any]]]) -> list[float | None]:
    """Train on ``steps`` again, for real (after a rollback, the episode's batches with the remedy in effect): the
    run's own precision and scaler, as Lightning's automatic optimization steps. ``self.log`` is silenced and the
    optimizer step hooks are hidden, since these are not the loop's steps; what they change stays. Returns the
    losses, read once at the end."""
    losses: list[Tensor | None] = []
    with silenced_log(state.module), _without_step_hooks(state.optimizers):
        for _, micro_batches in steps:
            losses.append(_replay_step(state, _as_micro_batches(micro_batches), state.scaler, True)[0])
    present = [t.float().reshape(()) for t in losses if t is not None]
    values = iter(torch.stack(present).tolist() if present else [])
    return [None if t is None else next(values) for t in losses]


def _replay_step(state: TrainState, micro_batches: list[MicroBatch], scaler: Any,
                 amp: bool, context: Callable[[], Any] | None = None,
                 before_micro_batch: Callable[[], None] | None = None) -> tuple[Tensor | None, Tensor]:
    """One optimizer step as Lightning's automatic optimization runs it: (the step's loss, whether the scaler
    skipped it), both left on the device."""
    for opt in state.optimizers:
        opt.zero_grad()
    total: Tensor | None = None
    for mb in micro_batches:
        if before_micro_batch is not None:
            before_micro_batch()
        if mb.rng is not None:
            torch.set_rng_state(mb.rng)
        if mb.cuda_rng is not None:
            torch.cuda.set_rng_state(mb.cuda_rng, state.device)
        with (context or state.forward_context)() if amp else torch.autocast(state.device.type, enabled=False):
            loss = loss_of((state.step_loss or state.module.training_step)(mb.batch, mb.batch_idx))
        if loss is None:
            continue
        loss = loss / state.accumulate
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    skipped = torch.zeros((), dtype=torch.bool, device=state.device)
    if total is not None:  # a step whose training_step returned None has no gradients to step with
        scale_before = compat.scale_tensor(scaler).clone() if scaler is not None else None  # type: ignore[union-attr]
        for opt in state.optimizers:
            if scaler is not None:
                scaler.unscale_(opt)
            _clip(state, opt)
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
        if scaler is not None:
            scaler.update()
            skipped = compat.scale_tensor(scaler) < scale_before  # the scale backs off exactly when the step was skipped
    last_batch_idx = micro_batches[-1].batch_idx if micro_batches else 0
    for scheduler, frequency in state.schedulers:
        if (last_batch_idx + 1) % frequency == 0:  # Lightning's rule for step-interval schedulers
            # the class's hook (the user's override, if any), not an instance-level stand-in such as
            # hold_lr_on_skip's, which answers for the live run's last step
            step = getattr(type(state.module), "lr_scheduler_step", None)
            if step is None:  # a plain module (a Fabric loop): the loop steps its schedulers itself
                if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    # stepped on a metric, which a loop that steps it every optimizer step takes from the step's
                    # loss: the replayed step's (read here: a replay's cost, never the live run's)
                    if total is not None:
                        type(scheduler).step(scheduler, total)
                else:
                    type(scheduler).step(scheduler)  # the class's, not an instance-level stand-in
            else:
                step(state.module, scheduler, None)
    if state.schedulers:
        _hold_ceiling(state)
    return total, skipped


def _hold_ceiling(state: TrainState) -> None:
    """``reduce_lr``'s ceiling, where the live run holds one: a replayed step's learning rates are those the live
    run's would be (the ceiling answers for every step, unlike ``hold_lr_on_skip``)."""
    ceiling = LrCeiling.installed(state.module)
    if ceiling is not None:
        clamp_lrs(param_groups(state.optimizers), ceiling.caps)
        for scheduler, _ in state.schedulers:
            compat.held_last_lr(scheduler)


def _clip(state: TrainState, optimizer: torch.optim.Optimizer) -> None:
    """Clip as the Trainer's ``gradient_clip_val`` / ``gradient_clip_algorithm`` do, with torch's own functions
    (unwrapped from AmpWatch's clipping guard, which watches the live run's clipping only)."""
    if not state.clip_val or state.clip_val <= 0:
        return
    name = "clip_grad_value_" if state.clip_algorithm == "value" else "clip_grad_norm_"
    clip = getattr(torch.nn.utils, name)
    getattr(clip, "__ampwatch_original__", clip)(list(_params_of(optimizer)), state.clip_val)


_without_step_hooks = compat.without_step_hooks  # replayed steps stay unseen by the live run's step hooks
