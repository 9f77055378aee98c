"""A batch with NaN rows under bf16 (no scaler to skip its step), on a model of our own on the CPU: the NaN reaches
the weights. With remedies allowed the run goes back to before the batch and trains on without it; without, the
panel and the summary say the weights are lost, and ``on_unrecoverable`` applies."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.taxonomy import AmpWatchError

BAD_STEP = 9


class Tagger(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 5))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.mlp(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *a: Any) -> None:
        self.seen.append(float(outputs["loss"]))


def _fit(tmp_path: Path, watch: AmpWatch, precision: str = "bf16-mixed") -> tuple[Losses, Tagger]:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40 * 16, 12, generator=g)
    y = x[:, :5].argmax(1)
    x[BAD_STEP * 16 + 2, 3] = float("nan")  # one row of one batch
    x[BAD_STEP * 16 + 11, 0] = float("nan")
    losses, module = Losses(), Tagger()
    trainer = make_trainer(tmp_path, [losses, watch], precision, max_steps=40)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    return losses, module


def _weights_finite(module: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_with_remedies_the_run_goes_back_before_the_nan_batch_and_trains_on_without_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch(remediate=True, log_dir=str(tmp_path / "log"))
    losses, module = _fit(tmp_path, watch)
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    assert d.finding is Finding.DATA_NONFINITE and d.step == BAD_STEP
    assert d.remedy == "skip_batch"
    assert d.evidence["rollback"].startswith("rolled back from step ")
    assert f"..{BAD_STEP} are skipped" in d.evidence["rollback"] or f"{BAD_STEP}..{BAD_STEP}" in d.evidence["rollback"]
    assert d.outcome == "recovered", d.evidence["recovery"]
    assert _weights_finite(module)
    assert sum(not math.isfinite(v) for v in losses.seen) == 1  # the bad batch's own loss, and no other
    out = capsys.readouterr().out
    assert f"the run went back to before the batch of step {BAD_STEP}" in out
    assert "fixed with skip_batch, recovery verified" in out


def test_without_remedies_the_panel_and_summary_say_the_weights_are_lost(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch(log_dir=str(tmp_path / "log"))
    losses, module = _fit(tmp_path, watch)
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    assert d.finding is Finding.DATA_NONFINITE and d.remedy is None
    assert not _weights_finite(module)  # the truth the panel must tell
    assert "the run cannot recover" in d.evidence["weights_lost"]
    out = capsys.readouterr().out
    assert "weights after this step" in out
    assert "the weights now hold NaN/inf and the run cannot recover" in out  # the summary line
    assert "the rest of the run is lost" in d.advice


def test_without_remedies_on_unrecoverable_raise_stops_the_run_at_the_lost_weights(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, on_unrecoverable="raise")
    with pytest.raises(AmpWatchError, match="DATA_NONFINITE"):
        _fit(tmp_path, watch)


def test_under_a_scaler_the_step_is_skipped_and_nothing_is_rolled_back(tmp_path: Path) -> None:
    watch = AmpWatch(remediate=True, verbose=False)
    losses, module = _fit(tmp_path, watch, precision="fp16")
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    assert d.finding is Finding.DATA_NONFINITE and d.remedy is None and "weights_lost" not in d.evidence
    assert _weights_finite(module)
