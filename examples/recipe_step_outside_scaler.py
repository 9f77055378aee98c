"""STEP_OUTSIDE_SCALER: the raw optimizer is stepped directly, past the GradScaler.

Run it:  python examples/recipe_step_outside_scaler.py      (a few seconds on a CPU; no GPU needed)

In manual optimization ``self.optimizers()`` hands back a LightningOptimizer whose ``step()`` goes through the
scaler: unscale, skip on inf/NaN, update the scale. Reaching for ``.optimizer.step()`` applies gradients that
are still multiplied by 2**16, and nothing checks them for overflow. AmpWatch sees the optimizer step while the
scaler's state for it is not "unscaled" and names the line.

AmpWatch should name it STEP_OUTSIDE_SCALER at the raw step. The script exits 1 if it does not.
"""

import sys
import tempfile

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import expect


class RawStep(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self.net(x).squeeze(-1), y))
        opt.optimizer.step()  # the mistake

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def main() -> int:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256))
    watch = AmpWatch()
    # A raw step never advances Lightning's step counter, so the run is bounded by epochs instead.
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=-1,
        max_epochs=1,
        callbacks=[watch],
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_step_outside_scaler-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RawStep(), DataLoader(data, batch_size=32))
    return expect(watch, Finding.STEP_OUTSIDE_SCALER, script=__file__, marker="# the mistake")




if __name__ == "__main__":
    sys.exit(main())
