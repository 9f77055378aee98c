"""Snapshots: host copies of everything an optimizer step changes (:class:`Snapshot`), and the resolution of what
one copies (shared with the ring's fast path in :mod:`.ring`)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat, distributed, sharding, snapshot_copy
from lightning_ampwatch.probes import MicroBatch
from lightning_ampwatch.trajectory.state import TrainState, _enabled


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
        return cls.copied(state, step, *_gather(state, grads, split=split), slot)

    @classmethod
    def copied(cls, state: TrainState, step: int, live: list[Tensor], parts: dict[str, Any],
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


def _as_micro_batches(micro_batches: Sequence[Any]) -> list[MicroBatch]:
    """``MicroBatch`` records, from them or from the plain tuples the callback keeps."""
    return [mb if isinstance(mb, MicroBatch) else MicroBatch(*mb) for mb in micro_batches]
