"""The snapshot copy off the compute stream, in the parts the CPU build can run: which tensors may be copied aside
(only those the next optimizer step alone changes), the one-shot wait before that step, and the CPU path left as
it was (no copier, no hook). The copy on a real side stream is tested in tests/test_cuda.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_ampwatch import snapshot_copy
from lightning_ampwatch.snapshot_copy import DeviceCopier, split_for_side_stream, stepped_pointers
from lightning_ampwatch.trajectory.ring import SnapshotRing
from lightning_ampwatch.trajectory.state import TrainState


def _stepped_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    return model, opt


def test_only_the_optimizers_parameters_and_state_are_stepped() -> None:
    model, opt = _stepped_model()
    stepped = stepped_pointers([opt])
    assert stepped is not None
    for p in model.parameters():
        assert p.data_ptr() in stepped
        assert opt.state[p]["exp_avg"].data_ptr() in stepped and opt.state[p]["exp_avg_sq"].data_ptr() in stepped
    bn = model[1]
    # the next forward writes BatchNorm's running statistics: they are never left to a side stream
    for buf in (bn.running_mean, bn.running_var, bn.num_batches_tracked):
        assert buf.data_ptr() not in stepped


def test_the_scalers_tensors_stay_on_the_compute_stream() -> None:
    """A skipped step never calls the optimizer's step (so never its pre-hook), yet the scaler's update writes its
    scale: the scale and growth tracker are not the optimizer's to hold back."""
    model, opt = _stepped_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    scaler.scale(model(torch.randn(16, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    stepped = stepped_pointers([opt])
    assert stepped is not None
    assert scaler._scale.data_ptr() not in stepped  # noqa: SLF001 - the test reads it
    assert scaler._growth_tracker.data_ptr() not in stepped  # noqa: SLF001


class NoHooks:
    """An optimizer that takes no step pre-hook (as DeepSpeed's ZeRO optimizers): its steps cannot be held back."""

    def __init__(self, params: Any) -> None:
        self.param_groups = [{"params": list(params)}]
        self.state: dict[Any, Any] = {}


def test_an_optimizer_without_step_hooks_keeps_every_copy_on_the_compute_stream() -> None:
    model, opt = _stepped_model()
    assert stepped_pointers([opt, NoHooks(model.parameters())]) is None


def test_cpu_tensors_are_never_copied_aside() -> None:
    model, opt = _stepped_model()
    live = [p.detach() for p in model.parameters()]
    stepped = stepped_pointers([opt])
    assert stepped is not None and all(t.data_ptr() in stepped for t in live)
    assert split_for_side_stream(live, stepped) == ([], list(range(len(live))))


class Recorded(DeviceCopier):
    """The copier's waits, recorded instead of queued on a CUDA stream (the CPU build has none)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.waited: list[Any] = []

    def _wait(self, event: Any) -> None:
        self.waited.append(event)


def test_the_next_optimizer_step_waits_once_for_the_copy_and_the_hook_is_gone_after_it() -> None:
    model, opt = _stepped_model()
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    copier = Recorded()
    copier.pending = "copy-1"
    copier._arm([opt, other])
    assert copier.waited == []
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(16, 4)).pow(2).mean().backward()
    opt.step()
    assert copier.waited == ["copy-1"]  # the wait was queued before the weights changed ...
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    other.step()
    opt.step()
    assert copier.waited == ["copy-1"]  # ... once: the hooks on both optimizers are gone after the first step
    assert not opt._optimizer_step_pre_hooks and not other._optimizer_step_pre_hooks  # noqa: SLF001


def test_a_restore_settles_a_copy_still_pending_before_writing_the_live_state() -> None:
    copier = Recorded()
    copier.pending = "copy-2"
    snapshot_copy._COPIERS[torch.device("cpu", 0)] = copier
    try:
        snapshot_copy.settle()
        assert copier.waited == ["copy-2"] and copier.pending is None
        snapshot_copy.settle()
        assert copier.waited == ["copy-2"]  # nothing pending: no second wait
    finally:
        del snapshot_copy._COPIERS[torch.device("cpu", 0)]


def test_the_cpu_ring_makes_no_copier_and_arms_no_hook() -> None:
    model, opt = _stepped_model()
    state = TrainState(module=model, optimizers=[opt])
    ring = SnapshotRing(budget_bytes=2**30, every=1, keep=2)
    for step in range(4):
        ring.after_step(step, state)
    assert len(ring.snapshots) == 2 and not ring.snapshots[-1].pinned
    assert snapshot_copy._COPIERS == {}
    assert not opt._optimizer_step_pre_hooks  # noqa: SLF001
    # the host copies are the live values, exactly (the model's state dict comes first)
    live = list(model.state_dict().values())
    assert all(torch.equal(h, t) for h, t in zip(ring.snapshots[-1].host, live))
