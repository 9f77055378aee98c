"""The ring's byte count for its memory budget, taken as the batches are added (a run's as one column) instead of
by a walk over every held step at each snapshot: the same bytes, the same totals and the same budget decisions
as that walk, over varied batches (tensors of every shape and dtype, tuples, lists, dicts, nested, non-tensor
leaves, a tensor held twice, a last short batch, several micro-batches a step) and orders of adding them."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from itertools import repeat
from typing import Any, Sequence

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_ampwatch.probes import MicroBatch, tensors_in
from lightning_ampwatch.trajectory.ring import SnapshotRing, _column_nbytes, _nbytes
from lightning_ampwatch.trajectory.state import TrainState

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool)


def _walk_nbytes(micro_batches: Sequence[Any]) -> int:
    """What a step's batches take, the plain way: every tensor found in every micro-batch's batch, by ``nbytes``
    (a tensor found twice counts twice)."""
    return sum(t.nbytes for mb in micro_batches for t in tensors_in(mb[0]))


class _WalkRing(SnapshotRing):
    """The ring as it counted before: every step's batches kept uncounted (-1) and walked at each snapshot, the
    newest first (in order) or all of them (out of order), then pruned step by step."""

    def add_batches(self, step: int, micro_batches: Sequence[Any]) -> None:
        if not self.enabled:
            return
        if self._snapshots and len(self._batches) >= self.max_held_steps:
            first = next(iter(self._batches), step)
            self.reset()
            self.dropped = (f"the snapshots from before step {first} were let go after {self.max_held_steps} "
                            "steps without a new one (a long stretch of trouble)")
        if self._snapshots:
            if step <= self._newest_held and self._batches:
                self._in_order = False
            self._newest_held = step
            self._batches[step] = (micro_batches, -1)  # type: ignore[assignment]
        else:
            self._unheld = micro_batches

    def add_run(self, steps: Sequence[int], batches: Sequence[Any]) -> None:
        if not self.enabled or not steps:
            return
        if not self._snapshots:
            self._unheld = batches[-1]
            return
        held = self._batches
        if len(held) + len(steps) <= self.max_held_steps and (steps[0] > self._newest_held or not held):
            held.update(zip(steps, zip(batches, repeat(-1))))  # type: ignore[arg-type]
            self._newest_held = steps[-1]
            return
        for step, micro_batches in zip(steps, batches):
            self.add_batches(step, micro_batches)

    def _count_batches(self) -> None:
        if self._unheld is not None:
            self._step_batch_bytes = max(self._step_batch_bytes, _walk_nbytes(self._unheld))
            self._unheld = None
        held = self._batches
        for step in (reversed(held) if self._in_order else list(held)):
            batches, nbytes = held[step]
            if nbytes >= 0:
                if self._in_order:
                    break
                continue
            nbytes = _walk_nbytes(batches)
            held[step] = (batches, nbytes)
            self._batch_bytes += nbytes
            self._step_batch_bytes = max(self._step_batch_bytes, nbytes)

    def _prune(self) -> None:
        keep_after = self._snapshots[0].step if self._snapshots else math.inf
        held: OrderedDict[int, Any] = self._batches
        if self._in_order:
            while held:
                step, entry = held.popitem(last=False)
                if step > keep_after:
                    held[step] = entry
                    held.move_to_end(step, last=False)
                    break
                if entry[1] > 0:
                    self._batch_bytes -= entry[1]
            return
        for step in [s for s in held if s <= keep_after]:
            self._batch_bytes -= max(held.pop(step)[1], 0)


# ---------------------------------------------------------------------------------------------- varied batches


def _tensor(rng: random.Random, rows: int) -> torch.Tensor:
    dtype = rng.choice(_DTYPES)
    shape = [rows, *(rng.randint(1, 5) for _ in range(rng.randint(0, 2)))]
    return torch.zeros(shape, dtype=dtype)


def _batch(rng: random.Random, kind: str, rows: int) -> Any:
    """One batch of the given kind, ``rows`` its batch dimension (a last short batch has fewer)."""
    t = _tensor
    if kind == "tensor":
        return t(rng, rows)
    if kind == "scalar":
        return torch.tensor(float(rows))
    if kind == "tuple":
        return (t(rng, rows), t(rng, rows))
    if kind == "list":
        return [t(rng, rows), t(rng, rows), t(rng, rows)]
    if kind == "dict":
        return {"x": t(rng, rows), "y": t(rng, rows)}
    if kind == "leaves":  # non-tensor leaves beside the tensors
        return {"x": t(rng, rows), "names": [f"n{i}" for i in range(rows)], "epoch": 3, "w": 0.5}
    if kind == "nested":
        return (t(rng, rows), [t(rng, rows), {"m": t(rng, rows), "s": "text"}], None)
    if kind == "twice":  # the same tensor held twice: counted twice, as every tensor found is
        x = t(rng, rows)
        return (x, x)
    if kind == "view":  # a view of another's storage: its own nbytes, as counted before
        x = t(rng, rows + 2)
        return (x, x[:rows])
    if kind == "parameter":  # a tensor subclass
        return (nn.Parameter(torch.zeros(rows, 2)), t(rng, rows))
    if kind == "empty":
        return ()
    if kind == "mixed":  # a tuple and a list of tensors in one column
        return rng.choice([(t(rng, rows),), [t(rng, rows)]])
    raise AssertionError(kind)


_KINDS = ("tensor", "scalar", "tuple", "list", "dict", "leaves", "nested", "twice", "view", "parameter", "empty",
          "mixed")


def _column(rng: random.Random, n: int, start: int) -> list[Any]:
    """``n`` steps' micro-batches: mostly one kind and one number of micro-batches a step (a dataloader's), now and
    then another kind, another count, or a last short batch."""
    kind, per_step = rng.choice(_KINDS), rng.choice((1, 1, 1, 2, 3))
    column = []
    for i in range(n):
        step_kind = kind if rng.random() < 0.85 else rng.choice(_KINDS)
        count = per_step if rng.random() < 0.9 else rng.randint(0, 3)
        rows = 4 if i < n - 1 or rng.random() < 0.5 else rng.randint(1, 3)  # a last short batch
        mbs = [_batch(rng, step_kind, rows) for _ in range(count)]
        record = MicroBatch if rng.random() < 0.5 else (lambda b, i: (b, i))
        column.append([record(b, start + i) for b in mbs])  # type: ignore[operator]
    return column


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(0, 30))
def test_a_column_takes_the_bytes_each_step_takes(seed: int, n: int) -> None:
    column = _column(random.Random(seed), n, 0)
    expected = [_walk_nbytes(mbs) for mbs in column]
    assert _column_nbytes(column) == expected
    assert [_nbytes(mbs) for mbs in column] == expected


def test_the_usual_batches_are_counted_as_the_walk_counts_them() -> None:
    """The fast kinds, one by one: a tensor, a tuple and a list of tensors, a dict of tensors (several micro-batches
    a step too), with a tensor held twice and a last short batch; and what falls back to the walk."""
    x, y = torch.zeros(8, 3), torch.zeros(8, dtype=torch.int64)
    short = torch.zeros(2, 3, dtype=torch.float16)
    columns = {
        "tensor": [[(x, 0)], [(short, 1)]],
        "tuple": [[((x, y), 0)], [((short, y[:2]), 1)]],
        "list": [[MicroBatch([x, y], 0)], [MicroBatch([x, x], 1)]],
        "dict": [[({"x": x, "y": y}, 0), ({"x": short}, 1)], [({"y": y}, 2), ({}, 3)]],
        "leaves": [[((x, 3), 0)], [({"x": x, "ids": ["a"]}, 1)]],
        "no micro-batches": [[], []],
    }
    for name, column in columns.items():
        assert _column_nbytes(column) == [_walk_nbytes(mbs) for mbs in column], name
    assert _column_nbytes(columns["list"]) == [x.nbytes + y.nbytes, 2 * x.nbytes]  # held twice: counted twice
    assert _column_nbytes(columns["dict"]) == [x.nbytes + y.nbytes + short.nbytes, y.nbytes]


# ---------------------------------------------------------------------------------------------- whole rings


def _state() -> TrainState:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    return TrainState(module=net, optimizers=[torch.optim.SGD(net.parameters(), lr=0.1)])


def _seen(ring: SnapshotRing) -> tuple[Any, ...]:
    """What the budget decides from and what it decided: the totals, the snapshots and batches held, whether the
    ring is on and why not."""
    return (ring.held_bytes, ring._step_batch_bytes, ring.bytes_per_snapshot, ring.enabled, ring.reason,
            ring.dropped, [s.step for s in ring.snapshots], [s for s, _ in ring.batches(-10 ** 9, 10 ** 9)],
            ring._batch_bytes)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10 ** 6), steps=st.integers(1, 60), every=st.integers(1, 5), keep=st.integers(1, 3),
       room=st.integers(0, 40))
def test_the_ring_decides_as_the_walk_over_its_held_steps_decides(seed: int, steps: int, every: int, keep: int,
                                                                 room: int) -> None:
    """Two rings, one counting as it does and one walking every held step at each snapshot as it did, fed the
    same steps (one by one, in runs, now and then a step again out of order, a reset): after every step they hold
    the same bytes, snapshots and batches, and turn off (or drop snapshots for the budget) at the same steps."""
    state = _state()
    snapshot = sum(p.nbytes for p in state.module.parameters())
    budget = snapshot + 16 * room * 8 if room else None  # from too small for one step's batches to roomy
    rings = [SnapshotRing(budget, every, keep), _WalkRing(budget, every, keep)]
    rng = random.Random(seed)
    column = _column(rng, steps, 0)
    for ring in rings:
        ring.after_step(-1, state, due=True)
    step = 0
    while step < steps:
        choice = rng.random()
        if choice < 0.4:  # a run of clean steps taken in later: up to the next snapshot due, not including it
            n = max(1, min(steps - step, rng.randint(1, 12), (-(step + 1) // every * -every) - step))
            if (step + n - 1) % every == 0:
                n -= 1
            if n > 0:
                run = list(range(step, step + n))
                for ring in rings:
                    ring.add_run(run, column[step:step + n])
                step += n
                assert _seen(rings[0]) == _seen(rings[1])
                continue
        if choice > 0.95 and step > 3:  # a step again (out of order), its batches anew
            again = step - rng.randint(1, 3)
            for ring in rings:
                ring.add_batches(again, column[again])
                ring.after_step(again, state)
            assert _seen(rings[0]) == _seen(rings[1])
        if choice > 0.99:
            for ring in rings:
                ring.reset()
        for ring in rings:
            ring.add_batches(step, column[step])
            ring.after_step(step, state)
        assert _seen(rings[0]) == _seen(rings[1]), step
        step += 1
    for ring in rings:  # one more snapshot, due: everything added since is counted
        ring.after_step(steps, state, due=True)
    assert _seen(rings[0]) == _seen(rings[1])


def test_a_batch_that_cannot_be_counted_fails_the_snapshot_as_before() -> None:
    """Counting happens when batches are added, but one that cannot be counted fails only where it failed before:
    at the snapshot, whose caller turns the ring off (the run goes on)."""
    state = _state()
    for add in ("one", "run"):
        ring = SnapshotRing(None, every=2)
        ring.after_step(-1, state, due=True)
        good = [(torch.zeros(3), 0)]
        if add == "one":
            ring.add_batches(0, good)
            ring.add_batches(1, [object()])  # no ``[0]``: not a micro-batch
        else:
            ring.add_run([0, 1], [good, [object()]])
        assert ring.enabled and list(ring._batches) == [0, 1]
        try:
            ring.after_step(2, state)
        except TypeError:
            pass
        else:
            raise AssertionError(f"{add}: the snapshot counted a batch it cannot count")
