"""Judging the run, not one batch: AmpWatch with its snapshots on real fits (real float16 autocast and a real
GradScaler on the CPU, or bf16), asserting the finding and the evidence a user reads."""

from __future__ import annotations

import logging
import statistics
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from test_trajectory import ExpSoftmax, separable
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics.aggregation import SumMetric

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, regression_data


def _fit(tmp_path: Any, model: Callable[[], pl.LightningModule], data: Any, watch: AmpWatch | None,
         precision: str = "fp16", max_steps: int = 40, scaler: dict[str, Any] | None = None,
         **kw: Any) -> tuple[pl.Trainer, pl.LightningModule]:
    pl.seed_everything(0, verbose=False)
    module = model()  # made after seeding: the same weights in every run
    trainer = make_trainer(tmp_path, [watch] if watch is not None else [], precision, scaler, max_steps=max_steps,
                           **kw)
    trainer.fit(module, DataLoader(data, batch_size=32))
    return trainer, module


def _alarms(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.is_alarm]


def test_a_real_forward_overflow_is_confirmed_by_the_fp32_trajectory(tmp_path: Any) -> None:
    watch = AmpWatch(verbose=False, snapshot_every=5)
    _fit(tmp_path, ExpSoftmax, separable(), watch, scaler={"init_scale": 2.0**8}, max_steps=24)
    d = _alarms(watch)[0]
    assert d.finding in (Finding.FORWARD_OVERFLOW, Finding.GRADIENT_OVERFLOW)  # blamed on float16 ...
    assert d.evidence["control_verdict"].endswith(": an AMP fault")  # ... because FP32 from a snapshot held
    losses = d.evidence["trajectory_fp32_losses"]
    assert all(isinstance(v, float) and v < 4 * d.evidence["loss_level"] for v in losses)
    assert d.evidence["trajectory_snapshot_step"] < d.step <= d.evidence["trajectory_window"][1]


def test_a_learning_rate_too_high_for_fp32_too_is_not_blamed_on_fp16(tmp_path: Any) -> None:
    watch = AmpWatch(verbose=False, snapshot_every=5)
    _fit(tmp_path, lambda: Regressor(lr=0.5), regression_data(), watch, max_steps=30)
    d = _alarms(watch)[0]
    assert d.finding is Finding.FP32_UNSTABLE
    assert "not an AMP fault" in d.evidence["control_verdict"] or d.evidence.get("diverged_first") is True
    assert "Lower the learning rate" in d.advice


class LrJump(Regressor):
    """A regressor that learns fast (Adam), until its learning rate jumps 100x at step 20 (a scheduler bug, a bad
    resume)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=3e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 100.0 if step >= 20 else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_an_lr_jump_whose_nan_comes_later_is_dated_near_the_jump(tmp_path: Any) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, LrJump, regression_data(), watch, max_steps=40)
    d = _alarms(watch)[0]
    assert d.finding is Finding.LR_SCHEDULE
    assert d.evidence["lr_change_step"] == 20
    assert 20 <= d.step <= 25
    assert d.evidence["lr_before"] == pytest.approx(3e-2) and d.evidence["lr_after"] == pytest.approx(3.0)


class HandLogSoftmax(pl.LightningModule):
    """log(softmax) written by hand: once the logits spread past ~17, exp underflows to 0 in float16 for the
    unlikely classes and log(0) = -inf; the loss (the likely class) stays finite but its gradient is 0 * inf =
    NaN, at any loss scale. Float32 has room to a spread of ~100. The spread grows 12x at step 12 (a temperature
    schedule gone wrong)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x) * (12.0 if self.trainer.global_step >= 12 else 1.0)
        e = (logits - logits.max(-1, keepdim=True).values).exp()
        logp = (e / e.sum(-1, keepdim=True)).log()
        target = logits.argmax(-1)  # the likely class: its log-probability stays finite
        return -logp.gather(1, target[:, None]).float().mean() + 0.0 * y.float().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def test_gradients_that_overflow_at_scale_one_are_unscaled_overflow_with_no_scaler_advice(tmp_path: Any) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, HandLogSoftmax, separable(), watch, max_steps=24)
    d = _alarms(watch)[0]
    assert d.finding is Finding.GRADIENT_OVERFLOW and d.evidence["pattern"] == "unscaled_overflow"
    assert d.evidence["replay_unscaled_grads_finite"] is False
    assert "init_scale" not in d.advice and "growth" not in d.advice
    assert "safe_scale" not in d.evidence


class Glitchy(Regressor):
    """A healthy regressor, except that at step 30 something outside its arithmetic corrupts one forward (a flag
    set once, standing in for a flipped bit): replaying the step does not bring it back."""

    def __init__(self) -> None:
        super().__init__(lr=1e-2)
        self.glitched = False

    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        if self.trainer.global_step == 30 and not self.glitched:
            self.glitched = True
            out = out * float("inf")
        return out


def test_a_bf16_one_off_nan_that_does_not_reproduce_is_not_blamed_on_amp(tmp_path: Any) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, Glitchy, regression_data(), watch, precision="bf16-mixed", max_steps=36)
    [d] = _alarms(watch)
    assert d.finding is Finding.NOT_REPRODUCED and d.step == 30
    assert "did not reproduce" in d.evidence["control_verdict"]
    assert not any(a.finding in (Finding.FORWARD_OVERFLOW, Finding.GRADIENT_OVERFLOW) for a in watch.diagnoses)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.seen.append(float(outputs["loss"]))


def test_the_loss_level_tracks_the_run_not_its_first_step(tmp_path: Any) -> None:
    watch, losses = AmpWatch(verbose=False), Losses()
    pl.seed_everything(0, verbose=False)
    model = LrJump()
    trainer = make_trainer(tmp_path, [losses, watch], "fp16", max_steps=40)
    trainer.fit(model, DataLoader(regression_data(), batch_size=32))
    d = _alarms(watch)[0]
    recent = statistics.median(losses.seen[d.step - 16:d.step])  # the 16 steps before the onset (loss_window)
    assert losses.seen[0] > 5 * recent  # the run learned a lot since its first step ...
    assert d.evidence["loss_level"] == pytest.approx(recent, rel=1e-3)  # ... and the level is the recent one


class Counted(ExpSoftmax):
    """ExpSoftmax with a torchmetrics counter updated in training_step: a replay must not count."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = SumMetric()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.rows.update(torch.tensor(float(len(batch[0]))))
        self.log("rows", self.rows.compute())
        return super().training_step(batch, batch_idx)


def _end(trainer: pl.Trainer, model: Counted) -> dict[str, Any]:
    return {"weights": [t.clone() for t in model.state_dict().values()],
            "optimizer": [t.clone() for s in trainer.optimizers[0].state.values() for t in s.values()],
            "scaler": trainer.precision_plugin.scaler.state_dict(),  # type: ignore[attr-defined]
            "rows": model.rows.compute().clone(), "logged": trainer.logged_metrics.get("rows"),
            "rng": torch.rand(3)}


def test_the_controls_leave_the_run_bit_identical(tmp_path: Any) -> None:
    runs = []
    for i, watch in enumerate([None, AmpWatch(verbose=False, snapshot_every=5)]):
        trainer, model = _fit(tmp_path / str(i), Counted, separable(), watch, scaler={"init_scale": 2.0**8}, max_steps=24,
                       logger=pl.loggers.CSVLogger(str(tmp_path / str(i))), log_every_n_steps=4)
        runs.append(_end(trainer, model))
        if watch is not None:
            assert "trajectory_fp32_losses" in _alarms(watch)[0].evidence  # both controls ran mid-run
    plain, watched = runs
    for key in plain:
        a, b = plain[key], watched[key]
        if isinstance(a, list):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), key
        elif isinstance(a, dict):
            assert a == b, key
        else:
            assert torch.equal(a, b), key
    assert float(watched["rows"]) == 24 * 32  # every real batch counted once, none of the replays


def test_a_snapshot_that_does_not_fit_the_budget_falls_back_to_the_single_batch(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    watch = AmpWatch(verbose=False, snapshot_every=5, snapshot_budget=64)
    caplog.set_level(logging.INFO, logger="lightning.pytorch")
    _fit(tmp_path, ExpSoftmax, separable(), watch, scaler={"init_scale": 2.0**8}, max_steps=24)
    said = [r.getMessage() for r in caplog.records if "snapshot" in r.getMessage()]
    assert len(said) == 1 and "budget of 64 bytes" in said[0] and "falls back" in said[0]
    d = _alarms(watch)[0]
    assert d.evidence["trajectory_control"].startswith("not run: the snapshot ring is off")
    assert d.evidence["control_verdict"] == "control finite: an AMP fault"  # the single-batch control's


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_snapshot_flags_are_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="snapshot_every"):
        AmpWatch(snapshot_every=bad)
    with pytest.raises(ValueError, match="snapshot_budget"):
        AmpWatch(snapshot_budget=bad if bad is not True else 0)
