"""Localisation and the FP32 control with a real Trainer, true float16 autocast and a real GradScaler on the CPU."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.probes import MicroBatch, Replayer
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, regression_data, run_scenario, true_fp16_plugin


def _alarm(watch: AmpWatch) -> Any:
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert alarms, f"no alarm; got {watch.diagnoses}"
    return alarms[0]


def test_forward_overflow_names_the_attention_submodule_and_the_control_is_finite(tmp_path: Path) -> None:
    watch = run_scenario("forward_overflow", str(tmp_path), AmpWatch(verbose=False))
    d = _alarm(watch)
    assert d.finding is Finding.FORWARD_OVERFLOW
    assert d.location == "attention"  # ExpAttention: its q/k/v Linears are finite, its exp() is not
    assert math.isfinite(d.evidence["fp32_control_loss"])
    assert d.evidence["replay_loss"] == "nan" or not math.isfinite(float(d.evidence["replay_loss"]))
    assert "control finite" in d.evidence["control_verdict"]
    # headroom: the modules closest to float16's limit, each with log2(65504 / absmax)
    headroom = d.evidence["fp16_headroom_log2"]
    assert headroom and all(isinstance(v, float) for v in headroom.values())


def test_large_features_are_input_range_located_at_the_first_layer(tmp_path: Path) -> None:
    watch = run_scenario("input_range", str(tmp_path), AmpWatch(verbose=False))
    d = _alarm(watch)
    assert d.finding is Finding.INPUT_RANGE
    assert d.location == "encoder.0"
    assert d.evidence["input_absmax"] > 1e4
    assert math.isfinite(d.evidence["fp32_control_loss"])


def test_learning_rate_that_diverges_in_fp32_too_is_fp32_unstable(tmp_path: Path) -> None:
    watch = run_scenario("diverging_lr", str(tmp_path), AmpWatch(verbose=False))
    d = _alarm(watch)
    assert d.finding is Finding.FP32_UNSTABLE
    assert "diverging" in d.evidence["control_verdict"]
    assert d.evidence["fp32_control_loss"] > 1e3 * d.evidence["loss_level"]
    assert "not the cause" in d.advice or "diverging" in d.advice


def test_nan_rows_are_data_nonfinite_confirmed_by_the_control_with_batch_index(tmp_path: Path) -> None:
    watch = run_scenario("nan_data", str(tmp_path), AmpWatch(verbose=False))
    d = _alarm(watch)
    assert d.finding is Finding.DATA_NONFINITE
    # row 200 of the dataset: batch 6 (batch_size 32), row 8 within it
    assert d.evidence["batch_idx"] == [6]
    assert d.evidence["nonfinite_where"] == "batch[0] rows [8]"
    assert d.evidence["fp32_control_loss"] == "nan"
    assert d.evidence["control_verdict"] == "control failed too"


def test_control_replay_off_leaves_no_control_evidence(tmp_path: Path) -> None:
    watch = run_scenario("forward_overflow", str(tmp_path), AmpWatch(verbose=False, control_replay=False))
    d = _alarm(watch)
    assert d.finding is Finding.FORWARD_OVERFLOW and d.location == "attention"
    assert "fp32_control_loss" not in d.evidence


class _HotLayer(pl.LightningModule):
    """``hot`` sees inputs 3000x larger with weights 3000x smaller: its output is ordinary, but its weight
    gradient (grad_out x input) is 3000x larger than any other, so it overflows first. The learning rate is small
    enough for that gradient (at 1e-3, and still at 1e-6, the first step that goes through blows the loss up, in
    float32 too: the FP32 trajectory control, replayed from the fit's start, rightly calls that FP32_UNSTABLE)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(16, 16)
        self.hot = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.hot.weight.div_(3000.0)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        h = self.hot(self.encoder(x) * 3000.0)
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-8)


def test_gradient_overflow_is_located_at_the_first_nonfinite_gradient(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=14, plugins=[true_fp16_plugin()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[watch])
    trainer.fit(_HotLayer(), DataLoader(regression_data(), batch_size=32))
    d = _alarm(watch)
    assert d.finding is Finding.GRADIENT_OVERFLOW
    assert d.location == "hot.weight"
    assert d.evidence["replay_grads_finite"] is False
    assert d.evidence["fp32_control_grads_finite"] is True
    # at the run's loss scale the gradients overflow, unscaled (the same graph, scale 1) they are finite
    assert d.evidence["replay_unscaled_grads_finite"] is True
    assert 0 < d.evidence["replay_grad_absmax"] < 65504
    assert "fp32_control_unscaled_grads_finite" not in d.evidence  # the control ran at scale 1: nothing to add
    assert math.isfinite(d.evidence["fp32_control_grad_absmax"])


def test_a_forward_overflow_replay_finds_the_gradients_non_finite_unscaled_too(tmp_path: Path) -> None:
    alarm = _alarm(run_scenario("forward_overflow", str(tmp_path), AmpWatch(verbose=False)))
    assert alarm.evidence["replay_unscaled_grads_finite"] is False  # no loss scale can help a forward overflow


def test_the_largest_unscaled_gradient_gives_a_loss_scale_that_does_not_overflow() -> None:
    pl.seed_everything(0, verbose=False)
    model = _HotLayer()
    x, y = regression_data()[:32]
    replayer = Replayer(model, lambda: torch.autocast("cpu", dtype=torch.float16), torch.device("cpu"))
    batch = [MicroBatch((x, y), 0)]
    high = replayer.run(batch, use_autocast=True, grad_scale=65536.0, probe=True)
    assert high.grads_finite is False and high.unscaled_grads_finite is True
    assert high.first_nonfinite_param == "hot.weight"
    safe = 2.0 ** math.floor(math.log2(65504 / high.grad_absmax)) / 2  # one power of two of margin
    at_safe = replayer.run(batch, use_autocast=True, grad_scale=safe, probe=False)
    assert at_safe.grads_finite is True
    assert at_safe.grad_absmax == pytest.approx(high.grad_absmax, rel=1e-6)  # the same unscaled gradients
    assert all(p.grad is None for p in model.parameters())  # gradients were taken, never accumulated


class _Stochastic(pl.LightningModule):
    """Dropout and BatchNorm, and a logged metric: everything a replay could disturb."""

    def __init__(self, nan_batch: int | None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
        self.nan_batch = nan_batch

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y, reduction="sum")
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _run_stochastic(root: Path, replay: bool) -> tuple[dict[str, Tensor], list[dict[str, str]], AmpWatch]:
    pl.seed_everything(3, verbose=False)
    model = _Stochastic(None)
    watch = AmpWatch(verbose=False, control_replay=replay, localize=replay)
    logger = CSVLogger(str(root), name="run")
    trainer = pl.Trainer(accelerator="cpu", max_steps=16, plugins=[true_fp16_plugin()], logger=logger,
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(root), callbacks=[watch])
    trainer.fit(model, DataLoader(regression_data(y_scale=8.0), batch_size=32, shuffle=True))
    with open(Path(logger.log_dir) / "metrics.csv") as fh:
        rows = [{k: v for k, v in row.items() if not k.startswith("ampwatch/")} for row in csv.DictReader(fh)]
    return {k: v.clone() for k, v in model.state_dict().items()}, rows, watch


def test_replay_leaves_no_trace_runs_end_bit_identical(tmp_path: Path) -> None:
    weights_a, rows_a, watch_a = _run_stochastic(tmp_path / "a", replay=True)
    weights_b, rows_b, watch_b = _run_stochastic(tmp_path / "b", replay=False)
    # the replaying run really replayed: its alarm carries replay evidence, the other does not
    assert [d.finding for d in watch_a.diagnoses] == [d.finding for d in watch_b.diagnoses]
    alarm = _alarm(watch_a)
    assert "replay_loss" in alarm.evidence and "replay_loss" not in _alarm(watch_b).evidence
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:  # parameters and BatchNorm running statistics
        assert torch.equal(weights_a[key], weights_b[key]), key
    assert rows_a == rows_b  # the logged train_loss, step by step: no extra or changed self.log calls


def test_no_hooks_on_a_healthy_run_and_none_left_after_a_replay(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[str] = []
    original = nn.Module.register_forward_hook

    def counting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        registered.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "register_forward_hook", counting)
    run_scenario("healthy", str(tmp_path / "healthy"), AmpWatch(verbose=False))
    assert registered == []

    model_holder: dict[str, Any] = {}
    scenario = SCENARIOS["forward_overflow"]
    original_factory = scenario.model

    def keep(**_: Any) -> Any:
        model_holder["model"] = original_factory()
        return model_holder["model"]

    monkeypatch.setattr(scenario, "model", keep)
    run_scenario("forward_overflow", str(tmp_path / "faulty"), AmpWatch(verbose=False))
    assert registered, "the faulty run should have armed the forward probes"
    assert all(not m._forward_hooks for m in model_holder["model"].modules())


class _ManualAttention(Regressor):
    """The forward_overflow model under manual optimization: training_step steps the optimizer itself."""

    def __init__(self) -> None:
        super().__init__(attention=True)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        opt.step()


def test_manual_optimization_is_located_by_watching_the_next_step(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"training_step": 0}
    original = _ManualAttention.training_step

    def counting(self: Any, batch: Any, batch_idx: int) -> None:
        calls["training_step"] += 1
        original(self, batch, batch_idx)

    monkeypatch.setattr(_ManualAttention, "training_step", counting)
    pl.seed_everything(0, verbose=False)
    model = _ManualAttention()
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, plugins=[true_fp16_plugin()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[watch])
    trainer.fit(model, DataLoader(regression_data(x_scale=10.0), batch_size=32))
    d = _alarm(watch)
    assert (d.finding, d.step, d.location) == (Finding.FORWARD_OVERFLOW, 0, "attention")
    assert "manual optimization" in d.evidence["replay"]  # training_step was not run again ...
    assert calls["training_step"] == 4  # ... exactly once per batch
    assert d.evidence["live_first_nonfinite_module"] == "attention"
    assert "next training step watched" in d.evidence["live_probe"]
    assert all(not m._forward_hooks for m in model.modules())  # the probe's hooks are gone
