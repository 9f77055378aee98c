"""The probes with real Trainers, true float16 autocast and a real GradScaler on the CPU: replays leave no trace
in torchmetrics, keyword inputs count as inputs, gradients are measured unscaled too, and a live probe watches a
whole manual-optimization step (two optimizers) before it names anything."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.probes import LiveProbe, MicroBatch, Replayer
from lightning_ampwatch.scenarios import ExpAttention, Regressor, regression_data, run_scenario, true_fp16_plugin


def _fit(model: pl.LightningModule, root: Path, data: Any, max_steps: int, callbacks: list[Any]) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, plugins=[true_fp16_plugin()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(root), callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=32))


def _alarm(watch: AmpWatch) -> Any:
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert alarms, f"no alarm; got {watch.diagnoses}"
    return alarms[0]


class _Counted(Regressor):
    """Counts the rows it trains on in torchmetrics: a tensor state (sum) and a list state (cat)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = torchmetrics.SumMetric()
        self.losses = torchmetrics.CatMetric(nan_strategy="disable")  # keep the NaN batch too

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.rows.update(torch.ones(len(batch[0])))
        self.losses.update(loss.detach().float())
        return loss


def test_a_replay_leaves_torchmetrics_states_as_they_were(tmp_path: Path) -> None:
    model = _Counted()
    watch = AmpWatch(verbose=False)
    _fit(model, tmp_path, regression_data(nan_rows=(200,)), 12, [watch])  # row 200: batch 6 goes NaN
    alarm = _alarm(watch)
    assert alarm.finding is Finding.DATA_NONFINITE
    assert "replay_loss" in alarm.evidence and "fp32_control_loss" in alarm.evidence  # batch 6 was replayed twice
    assert model.rows._update_count == 12 and model.losses._update_count == 12
    assert model.rows.compute().item() == 12 * 32  # the rows of the 12 real batches, none replayed
    assert len(model.losses.value) == 12


class _KeywordEncoder(nn.Module):
    """Called Hugging Face style, with keyword tensors only."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, *, inputs_embeds: Tensor) -> Tensor:
        return self.proj(inputs_embeds)


class _KeywordModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _KeywordEncoder()
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.encoder(inputs_embeds=x)).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_a_module_called_with_keyword_tensors_is_not_blamed_for_a_nan_it_was_given(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(_KeywordModel(), tmp_path, regression_data(nan_rows=(200,)), 12, [watch])
    alarm = _alarm(watch)
    assert alarm.finding is Finding.DATA_NONFINITE
    assert "replay_loss" in alarm.evidence  # the batch was replayed under the probes ...
    assert "replay_first_nonfinite_module" not in alarm.evidence  # ... and no module made the NaN: the data did


class _KeywordBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = ExpAttention(16)

    def forward(self, *, hidden: Tensor) -> Tensor:
        return self.attention(hidden)


class _KeywordAttention(Regressor):
    """The forward_overflow model with its ExpAttention reached through a keyword-only wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _KeywordBlock()

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(hidden=self.encoder(x))).squeeze(-1)


def test_an_overflow_inside_a_keyword_called_module_is_still_located(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(_KeywordAttention(), tmp_path, regression_data(x_scale=10.0), 8, [watch])
    alarm = _alarm(watch)
    assert alarm.finding is Finding.FORWARD_OVERFLOW
    assert alarm.location == "block.attention"


def test_a_replay_that_raises_still_restores_metrics_and_removes_its_hooks() -> None:
    model = _Counted()
    model.rows.update(torch.ones(5))
    x, y = regression_data()[:32]
    replayer = Replayer(model, lambda: torch.autocast("cpu", dtype=torch.float16), torch.device("cpu"))

    def failing(batch: Any, batch_idx: int) -> Tensor:
        model.rows.update(torch.ones(32))
        raise RuntimeError("the user's training_step failed")

    model.training_step = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="training_step failed"):
        replayer.run([MicroBatch((x, y), 0)], use_autocast=True, grad_scale=1.0, probe=True)
    assert model.rows.compute().item() == 5 and model.rows._update_count == 1
    assert all(not m._forward_hooks for m in model.modules())


class _Gan(pl.LightningModule):
    """Manual optimization with two optimizers, generator step first: the discriminator's exp() overflows on the
    (large) real data, which it only sees in its own step, after the generator's optimizer stepped."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.d = nn.Sequential(nn.Linear(16, 16), ExpAttention(16), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        x, _ = batch
        fake = self.g(torch.randn_like(x))
        g_loss = -self.d(fake).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = self.d(x).mean() - self.d(fake.detach()).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.g.parameters(), lr=1e-3), torch.optim.SGD(self.d.parameters(), lr=1e-3)


class _WatchOneStep(pl.Callback):
    """Arms a LiveProbe over one training step the way AmpWatch should: each optimizer's gradients at its step,
    everything read at the batch end."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx
        self.probe: LiveProbe | None = None
        self.seen: tuple[str | None, str | None, list[tuple[str, float]]] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx == self.batch_idx:
            self.probe = LiveProbe(pl_module)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.probe is not None:
            self.probe.optimizer_step(optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.probe is not None:
            self.seen, self.probe = self.probe.finish(), None


def test_a_live_probe_watches_every_optimizer_of_a_manual_step(tmp_path: Path) -> None:
    model = _Gan()
    watcher = _WatchOneStep(batch_idx=1)
    _fit(model, tmp_path, regression_data(x_scale=10.0), 6, [watcher])  # 3 batches, 2 optimizer steps each
    assert watcher.seen is not None
    module, param, _ = watcher.seen
    assert module == "d.1"  # the discriminator's ExpAttention, in the second optimizer's forward
    assert param is not None and param.startswith("d.")  # the discriminator's own step: its fresh gradients
    assert all(not m._forward_hooks for m in model.modules())


def test_a_live_probe_ignores_another_optimizers_stale_gradients(tmp_path: Path) -> None:
    model = _Gan()
    watcher = _WatchOneStep(batch_idx=1)

    class _GeneratorStepOnly(pl.Callback):
        """Stop the probe's step after the generator's optimizer step: only its gradients are fresh."""

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                     optimizer: torch.optim.Optimizer) -> None:
            if watcher.probe is not None and optimizer is trainer.optimizers[0]:
                watcher.probe.optimizer_step(optimizer)
                watcher.seen, watcher.probe = watcher.probe.finish(), None

    _fit(model, tmp_path, regression_data(x_scale=10.0), 6, [_GeneratorStepOnly(), watcher])
    assert watcher.seen is not None
    module, param, _ = watcher.seen
    # the discriminator's .grad still holds batch 0's overflowed gradients (opt_d.zero_grad comes later), but
    # the generator's optimizer does not apply them, and the generator's forward and gradients were finite
    assert (module, param) == (None, None)


def test_a_gan_forward_overflow_is_never_placed_at_a_parameter(tmp_path: Path) -> None:
    model = _Gan()
    watch = AmpWatch(verbose=False)
    _fit(model, tmp_path, regression_data(x_scale=10.0), 8, [watch])
    alarm = _alarm(watch)
    assert alarm.finding is Finding.FORWARD_OVERFLOW
    # a forward finding is where a module's output went non-finite; a parameter only ever stays in the evidence
    assert alarm.location is None or alarm.location in dict(model.named_modules())


def test_a_gan_forward_overflow_is_located_at_a_module(tmp_path: Path) -> None:
    model = _Gan()
    watch = AmpWatch(verbose=False)
    _fit(model, tmp_path, regression_data(x_scale=10.0), 8, [watch])
    alarm = _alarm(watch)
    assert alarm.finding is Finding.FORWARD_OVERFLOW
    assert alarm.location == "d.1"
    assert alarm.evidence["live_first_nonfinite_module"] == "d.1"
