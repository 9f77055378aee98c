"""A remedy applied in place, steps after the replays of its episode began, is judged against FP32 training from the
state it really started from, on the very batches it trained on (a model of our own: a regression whose summed
squared error on targets of up to ~9e3 overflows float16's scaled gradients from the first step, real float16
autocast and a real GradScaler on the CPU). Measured without AmpWatch: float16 with GradScaler(init_scale=2**-11)
from the start trains step for step like FP32. AmpWatch once held the run, four steps behind, to where the episode's
FP32 replay ended, called the working fix "not fixed", rolled back twelve steps and switched the run to bf16."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding


class PriceModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 48), nn.SiLU(), nn.Linear(48, 48), nn.SiLU())
        self.head = nn.Linear(48, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        pred = self.head(self.body(x)).float().squeeze(-1)  # the loss in float32: the targets never meet float16
        return F.mse_loss(pred, y, reduction="sum")

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.3)


def prices(steps: int = 40, batch: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(21)
    x = torch.randn(steps * batch, 12, generator=g)
    y = 9e3 * torch.sigmoid(x[:, :3].sum(1))
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def test_a_lower_scale_applied_in_place_is_verified_on_the_steps_it_trained(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate=True, verbose=False, log_dir=str(tmp_path / "log"))
    trainer = make_trainer(tmp_path, [watch], "fp16", max_steps=40)
    trainer.fit(PriceModel(), prices())
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert [d.finding for d in alarms] == [Finding.GRADIENT_OVERFLOW]
    [d] = alarms
    recovery = d.evidence["recovery"]
    assert (d.remedy, d.outcome) == ("lower_init_scale", "recovered"), recovery
    assert "tracks FP32 training from the same state" in recovery["reason"], recovery
    assert d.evidence["rollback"].startswith("none: the scaler skipped every step"), d.evidence["rollback"]
    assert "remedies_tried" not in d.evidence  # no second rung: no bf16, no rollback of the steps it trained
    assert trainer.precision == "16-mixed"
