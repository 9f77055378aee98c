"""The trajectory control on real fits: a snapshot ring driven from a small Callback, replays from it in FP32 and
at the run's precision (real float16 autocast and a real GradScaler on the CPU), and the verdict on them."""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch.probes import MicroBatch, capture_rng, uses_rng
from lightning_ampwatch.scenarios import Regressor, regression_data
from lightning_ampwatch.trajectory.replay import replay_trajectory
from lightning_ampwatch.trajectory.ring import SnapshotRing
from lightning_ampwatch.trajectory.snapshot import Snapshot
from lightning_ampwatch.trajectory.state import TrainState
from lightning_ampwatch.verdicts import TrajectoryKind, TrajectoryResult, judge_trajectory

BIG = 2**30


class Driver(pl.Callback):
    """Feeds a SnapshotRing as an adapter would: each optimizer step's micro-batches, then the step itself.
    Records every step's loss as Lightning reports it; ``at_step(driver, step)`` runs after the step is fed."""

    def __init__(self, ring: SnapshotRing, at_step: Callable[["Driver", int], None] | None = None) -> None:
        self.ring = ring
        self.at_step = at_step
        self.state: TrainState | None = None
        self.losses: dict[int, float] = {}
        self._pending: list[MicroBatch] = []
        self._loss: torch.Tensor | None = None
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._seen = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = TrainState.from_trainer(trainer, pl_module)
        self._seen = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._rng = capture_rng(pl_module.device) if uses_rng(pl_module) else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._pending.append(MicroBatch(batch, batch_idx, *(self._rng or ())))
        if isinstance(outputs, dict):
            loss = outputs["loss"].detach()
            self._loss = loss if self._loss is None else self._loss + loss
        if trainer.global_step == self._seen:
            return  # mid-accumulation
        self._seen = trainer.global_step
        step = trainer.global_step - 1
        if self._loss is not None:
            self.losses[step] = float(self._loss)
        self._loss = None
        assert self.state is not None
        self.ring.add_batches(step, self._pending)
        self.ring.after_step(step, self.state)
        self._pending = []
        if self.at_step is not None:
            self.at_step(self, step)

    def replay(self, snapshot: Snapshot, to_step: int, precision: str) -> TrajectoryResult:
        assert self.state is not None
        return replay_trajectory(self.state, snapshot, self.ring.batches(snapshot.step + 1, to_step),
                                 precision=precision)


# ------------------------------------------------------------------------------------------------ models


class Busy(pl.LightningModule):
    """Everything a replay could leave a trace in: dropout (RNG), BatchNorm (buffers), Adam (state), a
    step-interval LambdaLR (scheduler state), gradient clipping (set on the Trainer) and ``self.log``."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
                                 nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ExpSoftmax(pl.LightningModule):
    """A hand-written softmax, ``exp`` of the raw logits without max-subtraction. On separable data Adam grows the
    logits step by step; past ~11 their exp overflows float16 (65504) while float32 has room up to ~88."""

    def __init__(self, dim: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.net = nn.Linear(dim, classes)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        e = self.net(x).exp()
        p = e / e.sum(-1, keepdim=True)
        return -p.gather(1, y[:, None]).float().log().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.3)


def separable(n: int = 256, dim: int = 8, classes: int = 4) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    return TensorDataset(x, (x @ torch.randn(dim, classes, generator=g)).argmax(-1))


def fit(tmp_path: Any, model: pl.LightningModule, data: TensorDataset, callbacks: list[Any], precision: str,
        **overrides: Any) -> pl.Trainer:
    trainer = make_trainer(tmp_path, callbacks, precision, scaler={"init_scale": 2.0**8}, **overrides)
    trainer.fit(model, DataLoader(data, batch_size=32))
    return trainer


def level_before(driver: Driver, onset: int) -> float:
    """The run's loss before the onset: the median of the steps before it."""
    before = sorted(v for s, v in driver.losses.items() if s < onset)
    return before[len(before) // 2]


# ------------------------------------------------------------------------------------------------ tests


def _end_state(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, Any]:
    opt = trainer.optimizers[0]
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "weights": [t.clone() for t in model.state_dict().values()],
        "optimizer": [t.clone() for s in opt.state.values() for t in s.values()],
        "lr": [g["lr"] for g in opt.param_groups],
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "metrics": {k: v.clone() for k, v in trainer.callback_metrics.items()},
        "rng": torch.rand(4),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        left, right = a[key], b[key]
        if isinstance(left, list) and left and isinstance(left[0], torch.Tensor):
            assert len(left) == len(right) and all(torch.equal(x, y) for x, y in zip(left, right)), key
        elif isinstance(left, dict) and key == "metrics":
            assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left), key
        elif isinstance(left, torch.Tensor):
            assert torch.equal(left, right), key
        else:
            assert left == right, key


@pytest.mark.parametrize("precision", ["fp16", "32-true"])
def test_replay_leaves_the_run_bit_identical(tmp_path: Any, precision: str) -> None:
    results: list[TrajectoryResult] = []
    hook_calls: list[int] = []

    def replay_both(driver: Driver, step: int) -> None:
        if not hook_calls:  # a step post-hook, as AmpWatch's own: the replays' steps must not reach it
            driver.state.optimizers[0].register_step_post_hook(lambda *_: hook_calls.append(1))
        if step in (7, 11):
            params = list(driver.state.module.parameters())
            grads = [p.grad.clone() for p in params]
            snapshot = driver.ring.snapshots[0]
            # a window that ends before this step, so that the replay's last state is not the live one
            results.extend(driver.replay(snapshot, step - 1, p) for p in ("fp32", "amp"))
            assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))

    ends = []
    for at_step in (None, replay_both):
        pl.seed_everything(0, verbose=False)
        model = Busy()
        driver = Driver(SnapshotRing(BIG, every=3), at_step)
        trainer = fit(tmp_path, model, regression_data(), [driver], precision, max_steps=16, gradient_clip_val=0.5)
        ends.append((_end_state(trainer, model), driver.losses))
    (replayed, replayed_losses), (plain, plain_losses) = ends[1], ends[0]
    assert [r.steps for r in results] == [[4, 5, 6]] * 2 + [[7, 8, 9, 10]] * 2  # the replays did run
    assert len(hook_calls) == 16 - 1  # the live steps after the hook was added, and no replayed one
    _assert_same(replayed, plain)
    assert replayed_losses == plain_losses  # every step after the replays too
    # and a ring taking snapshots leaves no trace either: the same as a fit without any callback
    pl.seed_everything(0, verbose=False)
    model = Busy()
    trainer = fit(tmp_path, model, regression_data(), [], precision, max_steps=16, gradient_clip_val=0.5)
    _assert_same(_end_state(trainer, model), plain)


def test_fp16_forward_overflow_is_confirmed_by_a_clean_fp32_trajectory(tmp_path: Any) -> None:
    verdicts = []

    def at_onset(driver: Driver, step: int) -> None:
        if verdicts or math.isfinite(driver.losses[step]):
            return
        snapshot = driver.ring.newest_before(step)
        assert snapshot is not None and snapshot.step < step
        fp32 = driver.replay(snapshot, step, "fp32")
        amp = driver.replay(snapshot, step, "amp")
        verdicts.append((step, fp32, amp, judge_trajectory(fp32, amp, level_before(driver, step), 10.0)))

    pl.seed_everything(0, verbose=False)
    fit(tmp_path, ExpSoftmax(), separable(), [Driver(SnapshotRing(BIG, every=4), at_onset)], "fp16", max_steps=14)
    assert verdicts, "the float16 run never overflowed"
    onset, fp32, amp, verdict = verdicts[0]
    assert onset > 4  # healthy steps first: the snapshot holds weights from before the onset
    assert fp32.first_nonfinite is None and all(v < 2 for v in fp32.losses)  # near its level (~0.5), finite
    assert amp.first_nonfinite == onset and amp.skipped[-1]  # the real overflow again, and the scaler skips it
    assert verdict.kind is TrajectoryKind.AMP_CONFIRMED, verdict.reason
    assert verdict.evidence["window"] == [fp32.steps[0], onset]
    assert verdict.evidence["amp_losses"][-1] == "nan"


def test_too_high_lr_is_not_blamed_on_amp(tmp_path: Any) -> None:
    verdicts = []

    def at_onset(driver: Driver, step: int) -> None:
        if verdicts or math.isfinite(driver.losses[step]):
            return
        snapshot = driver.ring.snapshots[0]  # the oldest held: the longest window
        fp32 = driver.replay(snapshot, step, "fp32")
        amp = driver.replay(snapshot, step, "amp")
        verdicts.append((step, judge_trajectory(fp32, amp, level_before(driver, step), 10.0)))

    pl.seed_everything(0, verbose=False)
    fit(tmp_path, Regressor(lr=0.5), regression_data(), [Driver(SnapshotRing(BIG, every=4), at_onset)], "fp16",
        max_steps=20)
    assert verdicts, "the float16 run never went non-finite"
    onset, verdict = verdicts[0]
    assert verdict.kind in (TrajectoryKind.FP32_DIVERGES, TrajectoryKind.FP32_NONFINITE), verdict.reason
    assert verdict.evidence["window"][1] == onset


def test_a_window_without_the_fault_is_not_reproduced(tmp_path: Any) -> None:
    """The same overflowing run, replayed over healthy steps only: nothing faults, so AMP is not blamed."""
    verdicts = []

    def at_step(driver: Driver, step: int) -> None:
        if step == 7:
            snapshot = driver.ring.newest_before(step)
            fp32, amp = (driver.replay(snapshot, step, p) for p in ("fp32", "amp"))
            verdicts.append(judge_trajectory(fp32, amp, level_before(driver, step), 10.0))

    pl.seed_everything(0, verbose=False)
    fit(tmp_path, ExpSoftmax(), separable(), [Driver(SnapshotRing(BIG, every=4), at_step)], "fp16", max_steps=8)
    assert verdicts[0].kind is TrajectoryKind.NOT_REPRODUCED, verdicts[0].reason


@pytest.mark.parametrize("precision", ["fp16", "32-true"])
def test_accumulation_replays_the_live_losses(tmp_path: Any, precision: str) -> None:
    """Three micro-batches a step over an epoch of 16 batches: the epoch's last step has one, and Lightning
    still divides its loss by 3; the window crosses into the next epoch."""
    replayed: list[TrajectoryResult] = []

    def at_end(driver: Driver, step: int) -> None:
        if step == 9:
            replayed.extend(driver.replay(driver.ring.snapshots[0], step, p) for p in ("amp", "fp32"))

    pl.seed_everything(0, verbose=False)
    driver = Driver(SnapshotRing(BIG, every=3, keep=3), at_end)
    fit(tmp_path, Busy(), regression_data(), [driver], precision, max_steps=10, accumulate_grad_batches=3,
        gradient_clip_val=0.5)
    amp, fp32 = replayed
    assert amp.steps == list(range(4, 10))
    assert [len(b) for _, b in driver.ring.batches(4, 9)] == [3, 1, 3, 3, 3, 3]
    assert amp.losses == [driver.losses[s] for s in amp.steps]  # exactly, dropout masks and all
    if precision == "32-true":
        assert fp32.losses == amp.losses  # a float32 run's own precision is FP32
    else:
        assert fp32.losses != amp.losses and all(math.isfinite(v) for v in fp32.losses)


def test_the_budget_counts_snapshots_and_batches(tmp_path: Any) -> None:
    def ring_after_fit(budget: int) -> SnapshotRing:
        pl.seed_everything(0, verbose=False)
        ring = SnapshotRing(budget, every=4)
        fit(tmp_path, Regressor(), regression_data(), [Driver(ring)], "fp16", max_steps=9)
        return ring

    roomy = ring_after_fit(BIG)
    snapshot = roomy.bytes_per_snapshot
    params = sum(p.numel() for p in Regressor().parameters())
    assert snapshot == params * 4 + 8  # float32 weights (plain SGD keeps no state) and the scaler's two numbers
    batch = 32 * 16 * 4 + 32 * 4  # one step's batch: x (32 x 16) and y (32), float32
    need = snapshot + 4 * batch

    tiny = ring_after_fit(1000)
    assert not tiny.enabled and tiny.newest_before(9) is None and tiny.batches(0, 9) == []
    assert f"need {need} bytes" in tiny.reason and "budget of 1000 bytes" in tiny.reason

    no_room_for_batches = ring_after_fit(need - 1)  # the snapshot alone would fit
    assert snapshot < need - 1 and not no_room_for_batches.enabled
    assert f"{4 * batch} bytes" in no_room_for_batches.reason and f"at least {need} bytes" in no_room_for_batches.reason

    just = ring_after_fit(need)  # one snapshot and its batches, not two snapshots
    assert just.enabled and just.reason is None and just.held_bytes <= need
    assert just.newest_before(9).step == 8 and just.newest_before(8) is None
    assert [s for s, _ in roomy.batches(0, 9)] == [5, 6, 7, 8]  # keep=2: back to the older snapshot, step 4
    assert roomy.newest_before(8).step == 4


def test_manual_optimization_says_the_control_is_not_available(tmp_path: Any) -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            opt = self.optimizers()
            loss = super().training_step(batch, batch_idx)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            return loss

    pl.seed_everything(0, verbose=False)
    driver = Driver(SnapshotRing(BIG, every=2))
    fit(tmp_path, Manual(), regression_data(), [driver], "32-true", max_steps=3)
    assert not driver.ring.enabled and "manual optimization" in driver.ring.reason
    assert driver.ring.reason == driver.state.unavailable
    with pytest.raises(ValueError, match="manual optimization"):
        replay_trajectory(driver.state, Snapshot.take(driver.state, 0), [(1, [])], precision="fp32")


def _result(precision: str, losses: list[float], skipped: list[bool] | None = None) -> TrajectoryResult:
    return TrajectoryResult(precision=precision, from_step=9, steps=list(range(10, 10 + len(losses))),
                            losses=losses, skipped=skipped or [False] * len(losses), params_finite=True)


@pytest.mark.parametrize("fp32, amp, level, kind", [
    ([0.5, 0.4], [0.5, math.nan], 0.6, TrajectoryKind.AMP_CONFIRMED),
    ([0.5, 0.4], None, 0.6, TrajectoryKind.AMP_CONFIRMED),  # no amp replay: FP32 alone decides
    ([0.5, 5.9], [0.5, 0.4], 0.6, TrajectoryKind.NOT_REPRODUCED),  # under 10x the level
    ([0.5, 6.1, 13.0], [0.5, math.inf, math.inf], 0.6, TrajectoryKind.FP32_DIVERGES),  # past 10x, and climbing
    ([0.5, 6.1, 6.5], [0.5, math.inf, math.inf], 0.6, TrajectoryKind.AMP_CONFIRMED),  # one jump (harder data)
    ([0.5, math.inf], [0.5, math.nan], 0.6, TrajectoryKind.FP32_NONFINITE),
    ([0.5, 1e9], [0.5, 0.4], None, TrajectoryKind.NOT_REPRODUCED),  # no level: finiteness only
])
def test_verdict_rules(fp32: list[float], amp: list[float] | None, level: float | None,
                       kind: TrajectoryKind) -> None:
    verdict = judge_trajectory(_result("fp32", fp32), amp and _result("amp", amp), level, 10.0)
    assert verdict.kind is kind, verdict.reason
    assert verdict.evidence["window"] == [10, 9 + len(fp32)] and verdict.evidence["loss_level"] == level
    assert ("amp_losses" in verdict.evidence) is (amp is not None)
    json.dumps(verdict.evidence, allow_nan=False)


def test_a_skip_alone_reproduces_the_fault() -> None:
    verdict = judge_trajectory(_result("fp32", [0.5, 0.4]), _result("amp", [0.5, 0.4], [False, True]), 0.6, 10.0)
    assert verdict.kind is TrajectoryKind.AMP_CONFIRMED and "step 11" in verdict.reason


def test_bad_settings_name_the_value_and_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"divergence_ratio=0\.5: expected a number above 1"):
        judge_trajectory(_result("fp32", [0.5]), None, 0.6, 0.5)
    with pytest.raises(ValueError, match=r"every=0: expected a whole number of at least 1"):
        SnapshotRing(BIG, every=0)
    with pytest.raises(ValueError, match=r"budget_bytes=-1: expected a positive number of bytes"):
        SnapshotRing(-1)


def test_a_replay_that_fails_midway_still_puts_the_live_state_back(tmp_path: Any) -> None:
    checked = []

    def at_step(driver: Driver, step: int) -> None:
        if step != 6:
            return
        state = driver.state
        before = [t.clone() for t in state.module.state_dict().values()]
        grads = [p.grad.clone() for p in state.module.parameters()]
        moments = [t.clone() for s in state.optimizers[0].state.values() for t in s.values()]
        snapshot = driver.ring.newest_before(step)
        (first, good), (second, bad) = driver.ring.batches(snapshot.step + 1, snapshot.step + 2)
        x, y = bad[0].batch
        with pytest.raises(RuntimeError):  # the second step's batch has the wrong width
            replay_trajectory(state, snapshot, [(first, good), (second, [MicroBatch((x[:, :3], y), 0)])],
                              precision="amp")
        assert all(torch.equal(a, b) for a, b in zip(state.module.state_dict().values(), before))
        assert all(torch.equal(p.grad, g) for p, g in zip(state.module.parameters(), grads))
        assert all(torch.equal(a, b) for a, b in zip(
            (t for s in state.optimizers[0].state.values() for t in s.values()), moments))
        checked.append(step)

    pl.seed_everything(0, verbose=False)
    fit(tmp_path, Busy(), regression_data(), [Driver(SnapshotRing(BIG, every=3), at_step)], "fp16", max_steps=7)
    assert checked == [6]
