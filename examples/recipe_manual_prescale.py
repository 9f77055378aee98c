"""MANUAL_PRESCALE: the loss is multiplied by hand before the GradScaler multiplies it again.

Run it:  python examples/recipe_manual_prescale.py      (a few seconds on a CPU; no GPU needed)

``self.manual_backward(loss * 1024)`` on top of the scaler's 2**16 makes the gradients 2**26 times too large:
they overflow float16 and the scaler skips step after step while it halves its way back down. AmpWatch reads
the constant factor from the loss's autograd graph (once per call site, no device read) and names the line.
Dividing the loss by the number of accumulation steps is the one factor that is fine.

AmpWatch should name it MANUAL_PRESCALE at the manual_backward line. The script exits 1 if it does not.
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


class HandScaledLoss(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.manual_backward(loss * 1024)  # the mistake
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main() -> int:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256))
    watch = AmpWatch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=10,
        callbacks=[watch],
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_manual_prescale-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(HandScaledLoss(), DataLoader(data, batch_size=32))
    return expect(watch, Finding.MANUAL_PRESCALE, script=__file__, marker="# the mistake")




if __name__ == "__main__":
    sys.exit(main())
