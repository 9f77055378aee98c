"""The lower-LR replay is never the one the replay-step cap leaves out when the LR rose before the onset: where the
whole window no longer fits, it runs over as much of it as fits, through the onset (a model of our own: an
unguarded exp in the forward pass during a linear warmup, real float16 on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Thresholds


class WarmupExp(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.out = nn.Linear(10, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.enc(x) * 4.0)  # its values grow with the weights until float16 overflows
        return self.out(e / (1 + e.sum(-1, keepdim=True)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 30))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _alarm(tmp_path: Path, cap: int) -> Any:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(60 * 16, 10, generator=g)
    watch = AmpWatch(verbose=False, thresholds=Thresholds(replay_steps=cap))
    make_trainer(tmp_path, [watch], "fp16", max_steps=40).fit(
        WarmupExp(), DataLoader(TensorDataset(x, x[:, :3].argmax(1)), batch_size=16))
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    return d


def test_a_tight_cap_shortens_the_lower_lr_replay_instead_of_leaving_it_out(tmp_path: Path) -> None:
    full = _alarm(tmp_path / "full", 96)
    tight = _alarm(tmp_path / "tight", 56)
    assert tight.step == full.step == 15 and "lr_change_step" in tight.evidence  # the LR rose before the onset
    tried = str(tight.evidence["tried"])
    assert "LR/10: not tried" not in tried, tried
    assert "LR/10 (steps 1-18: the window shortened to the replay-step cap of 56): 0 skips" in tried, tried
    assert tight.finding is full.finding  # the shortened replay measures what the whole window did
