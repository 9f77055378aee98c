"""The ring (:class:`SnapshotRing`): snapshots every few optimizer steps within a memory budget, and the batches
since the oldest; its fast path (:class:`_CopyPlan`: what a snapshot copies, resolved once and reused while the live
objects stay the same) and its byte counts of the batches it holds."""

from __future__ import annotations

import copy
import functools
import math
import operator
import os
from collections import OrderedDict, deque
from itertools import chain, islice, repeat, takewhile
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat, sharding
from lightning_ampwatch.probes import MicroBatch, tensors_in
from lightning_ampwatch.trajectory.snapshot import Snapshot, _At, _ScalerState, _as_micro_batches, _resolve
from lightning_ampwatch.trajectory.state import TrainState

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

    def lengthen(self, every: int, keep: int) -> None:
        """Snapshots every ``every`` steps from now on (the ``"auto"`` cadence's longer interval): the bound on the
        steps of batches held follows it, as it follows the interval the ring was made with (``keep`` snapshots)."""
        self.every = every
        self.max_held_steps = max(self.max_held_steps, every * (keep + 2))

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
        self._snapshots.append(Snapshot.copied(state, step, live, parts, spare.host if spare else None, layout,
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
