"""Manual optimization, two optimizers (a small GAN), and a discriminator loss multiplied by inf inside
``training_step``: no module output is non-finite, so the forward overflow is where the code around the modules made
it, ``<Model>.training_step``, the place the watch can defend (it cannot replay a step that steps its optimizers).
One process, and two under DDP (gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import true_fp16_plugin
from _limits import HANG_S
from test_ddp import DumpDiagnoses  # each rank writes the diagnoses its AmpWatch published

INF_FROM = 6  # the discriminator's loss is multiplied by inf from this batch on


class TinyGAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        fake = self.generator(noise)
        d_loss = nn.functional.softplus(-self.discriminator(real)).mean() + \
            nn.functional.softplus(self.discriminator(fake.detach())).mean()
        if batch_idx >= INF_FROM:
            d_loss = d_loss * float("inf")  # the user's own arithmetic, outside every module
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = nn.functional.softplus(-self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return (torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3))


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 4, generator=g)),
                      batch_size=16, shuffle=False)



def fit(out_dir: str, devices: int) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=2 * 12,
        # (the generator's step leaves the discriminator unused, and the other way round: DDP must be told)
        strategy=DDPStrategy(start_method="fork", find_unused_parameters=True) if devices > 1 else "auto",
        plugins=[true_fp16_plugin()], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, callbacks=[watch, DumpDiagnoses(watch, out_dir)],
        use_distributed_sampler=False,
    )
    trainer.fit(TinyGAN(), train_dataloaders=_data())


def _forward_overflows(diagnoses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in diagnoses if d["finding"] == Finding.FORWARD_OVERFLOW.value]


def test_a_loss_made_infinite_in_training_step_is_located_there(tmp_path: Path) -> None:
    fit(str(tmp_path), 1)
    [d] = _forward_overflows(json.loads((tmp_path / "rank0.json").read_text()))
    assert d["location"] == "TinyGAN.training_step"


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_under_ddp_every_rank_locates_it_there_too(tmp_path: Path) -> None:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_gan_location as t; "
            f"t.fit({str(tmp_path)!r}, 2)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0 == rank1
    [d] = _forward_overflows(rank0)
    assert d["location"] == "TinyGAN.training_step"
