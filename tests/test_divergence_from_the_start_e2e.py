"""A run that climbs from its first steps (a frozen trunk whose new head has a far too high learning rate), on a
model of our own in real float16 on the CPU: no healthy level is taken from the climbing steps (the panel says so),
the onset is where the climb starts, and with remedies allowed the run is rolled back once, to before it."""

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


class FrozenTrunkHotHead(pl.LightningModule):
    def __init__(self, lr: float = 2.0, width: int = 128) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.trunk = nn.Sequential(nn.Linear(20, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, width),
                                   nn.GELU(), nn.LayerNorm(width))
        with torch.no_grad():  # "pretrained": fixed weights, never trained here
            for p in self.trunk.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        self.trunk.requires_grad_(False)
        self.classifier = nn.Linear(width, 8)
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.classifier(self.trunk(x)), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.classifier.parameters(), lr=self.lr, momentum=0.9)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *a: Any) -> None:
        self.seen.append(float(outputs["loss"]))


def _fit(tmp_path: Path, watch: AmpWatch) -> Losses:
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(60 * 32, 20, generator=g)
    losses = Losses()
    trainer = make_trainer(tmp_path, [losses, watch], "fp16", max_steps=60)
    trainer.fit(FrozenTrunkHotHead(), DataLoader(TensorDataset(x, x[:, :8].argmax(1)), batch_size=32))
    return losses


def test_no_healthy_level_is_taken_from_steps_already_climbing_and_the_onset_is_where_it_starts(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    losses = _fit(tmp_path, watch)
    assert losses.seen[1] > losses.seen[0] and losses.seen[10] > 4 * losses.seen[0]  # the climb is real, from step 1
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    assert d.finding is Finding.FP32_UNSTABLE
    assert d.step == 1  # not where 8 losses in a row first passed 4x a "level" made of the climb itself
    ev = d.evidence
    assert ev["loss_reference"] is None and "loss_reference_steps" not in ev
    assert "already climbed" in ev["loss_reference_why"] and "no healthy level is taken from them" in \
        ev["loss_reference_why"]
    assert "rising from the run's first loss since step 1" in ev["divergence"]
    assert ev["loss_at_onset"] == losses.seen[1]


def test_with_every_remedy_the_run_goes_back_once_to_before_the_climb_and_trains(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate="all", log_dir=str(tmp_path / "log"))
    losses = _fit(tmp_path, watch)
    [d] = [d for d in watch.diagnoses if d.is_alarm]  # one episode: no second alarm for the same climb
    assert d.finding is Finding.FP32_UNSTABLE and d.remedy == "reduce_lr"
    assert d.evidence["rollback"].startswith("rolled back from step ") and " to step 0 " in d.evidence["rollback"]
    assert "remedies_tried" not in d.evidence  # one rollback for the episode
    assert max(losses.seen[-20:]) < losses.seen[0] * 1.5  # back to training, not diverging from a rolled-in state
    log = "".join(p.read_text() for p in (tmp_path / "log").rglob("*") if p.is_file() and p.suffix in (".jsonl", ".txt"))
    assert log and "NaNs are gone" not in log and "NaN" not in d.evidence["recovery"]["reason"]
