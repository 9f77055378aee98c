"""The snapshot ring's fast path: what torch's state-dict machinery resolved is reused while the live objects stay
the same, and resolved afresh as soon as they change. A snapshot through it must hold exactly what the state-dict
machinery would have had it hold, and put back exactly the same."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from test_trajectory import BIG, Busy, Driver, fit
from torch import nn

from lightning_ampwatch.trajectory import ring
from lightning_ampwatch.scenarios import regression_data
from lightning_ampwatch.trajectory.ring import SnapshotRing
from lightning_ampwatch.trajectory.snapshot import Snapshot
from lightning_ampwatch.trajectory.state import TrainState


def _same(a: Snapshot, b: Snapshot) -> None:
    """Two snapshots of the same moment hold the same values, entry by entry."""
    assert len(a.host) == len(b.host)
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.host, b.host))
    assert a.model == b.model and a.optim_state == b.optim_state and a.groups == b.groups
    assert a.schedulers == b.schedulers and a.scaler == b.scaler and a.frozen == b.frozen
    assert torch.equal(a.rng, b.rng)


class _CountResolves:
    """How often the ring went through the state-dict machinery (the plan's slow path)."""

    def __init__(self, monkeypatch: Any) -> None:
        self.count = 0
        resolve = ring._CopyPlan.resolve.__func__

        def counted(cls: Any, state: TrainState, split: bool) -> Any:
            self.count += 1
            return resolve(cls, state, split)

        monkeypatch.setattr(ring._CopyPlan, "resolve", classmethod(counted))


def test_a_fit_snapshots_through_the_plan_what_the_state_dict_machinery_reads(tmp_path: Any, monkeypatch: Any
                                                                             ) -> None:
    """BatchNorm buffers, Adam state, a step scheduler, a real GradScaler: every snapshot of the fit is compared
    with one taken the slow way at the same moment."""
    resolves = _CountResolves(monkeypatch)
    compared: list[int] = []

    def compare(driver: Driver, step: int) -> None:
        if driver.ring.snapshots and driver.ring.snapshots[-1].step == step:
            _same(driver.ring.snapshots[-1], Snapshot.take(driver.state, step))
            compared.append(step)

    pl.seed_everything(0, verbose=False)
    driver = Driver(SnapshotRing(BIG, every=2), compare)
    fit(tmp_path, Busy(), regression_data(), [driver], "fp16", max_steps=12, gradient_clip_val=0.5)
    assert compared == [0, 2, 4, 6, 8, 10]
    # resolved at the first step (Adam's state and the scaler's tensors are created by it), then reused
    assert resolves.count <= 2 and driver.ring._plan is not None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2)
        self.register_buffer("seen", torch.zeros(2))


def _train(net: _Net, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    net.b(net.a(torch.randn(5, 4))).square().mean().backward()
    opt.step()
    net.seen += 1


def test_the_plan_is_resolved_again_whenever_the_live_state_changes(monkeypatch: Any) -> None:
    """Each change a fingerprint must see: after it, the snapshot through the ring is the one the state-dict
    machinery takes, and restoring it puts back the values it holds."""
    torch.manual_seed(0)
    resolves = _CountResolves(monkeypatch)
    net = _Net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    state = TrainState(module=net, optimizers=[opt])
    ring = SnapshotRing(BIG, every=1)
    step = 0

    def snapshot_matches() -> None:
        nonlocal step
        ring.after_step(step, state)
        _same(ring.snapshots[-1], Snapshot.take(state, step))
        step += 1

    snapshot_matches()  # no optimizer state yet
    _train(net, opt)
    snapshot_matches()  # Adam's state created: resolved again
    _train(net, opt)
    before = resolves.count
    snapshot_matches()  # nothing changed but values: the plan holds
    assert resolves.count == before

    changes = [
        lambda: setattr(net.a.weight, "data", net.a.weight.data.clone() + 1),  # storage swapped under the Parameter
        lambda: opt.state[net.a.bias].clear(),  # a parameter's optimizer state dropped
        lambda: net.b.weight.requires_grad_(False),  # frozen: out of the snapshot, its version kept instead
        lambda: opt.state[net.b.bias].__setitem__("exp_avg", torch.full((2,), 7.0)),  # a state tensor replaced
        lambda: setattr(net, "seen", torch.full((2,), 3.0)),  # a buffer replaced
        lambda: setattr(net, "c", nn.Linear(2, 2)),  # a module added
        lambda: opt.param_groups[0].__setitem__("lr", torch.tensor(0.5)),  # a tensor LR: no plan at all
    ]
    for change in changes:
        change()
        before = resolves.count
        snapshot_matches()
        assert resolves.count == before + 1
    # the tensor LR keeps the ring on the slow path, snapshot after snapshot
    snapshot_matches()
    assert resolves.count == before + 2 and ring._plan is None

    # and what went through the plan restores exactly: the values of a snapshot taken through it
    opt.param_groups[0]["lr"] = 1e-2
    snapshot_matches()
    snapshot_matches()  # through the plan
    kept = ring.snapshots[-1]
    saved = [p.detach().clone() for p in net.parameters()] + [net.seen.clone()]
    _train(net, opt)
    kept.restore(state)
    assert all(torch.equal(p, s) for p, s in zip([*net.parameters(), net.seen], saved))


def test_the_ring_counts_and_prunes_only_the_ends_of_its_held_steps_in_a_run() -> None:
    """Steps added in order (as a run adds them): counting walks only the new ones and pruning only the dropped
    ones; the held bytes, the steps kept and the largest step's bytes are those of the walk over every held step,
    which steps added out of order still get."""
    net = nn.Linear(4, 2)
    state = TrainState(module=net, optimizers=[torch.optim.SGD(net.parameters(), lr=0.1)])
    rings = {True: SnapshotRing(BIG, every=4), False: SnapshotRing(BIG, every=4)}
    seen: dict[bool, list[Any]] = {True: [], False: []}
    for in_order, ring in rings.items():
        ring.after_step(-1, state, due=True)
        for step in range(15):
            ring.add_batches(step, [(torch.zeros(8 + step), step)])  # bytes that differ by step
            if not in_order:
                ring._in_order = False  # as after a step came back out of order: the walk over every held step
            ring.after_step(step, state)
            seen[in_order].append((ring.held_bytes, [s for s, _ in ring.batches(-1, 99)], ring._step_batch_bytes))
        assert ring._in_order is in_order
    assert seen[True] == seen[False]
    assert seen[True][-1][1] == [9, 10, 11, 12, 13, 14]  # back to the older of the two snapshots held, step 8
    # a step added again comes back out of order: the ring falls back to the whole walk by itself
    ring = rings[True]
    ring.add_batches(9, [(torch.zeros(1), 9)])
    assert not ring._in_order
