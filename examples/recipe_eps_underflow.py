"""EPS_UNDERFLOW: under 16-true, Adam's default eps=1e-8 rounds to zero in float16.

Run it:  python examples/recipe_eps_underflow.py      (a few seconds on a CPU; no GPU needed)

With precision="16-true" the weights and the optimizer state are float16. Adam divides by sqrt(v) + eps, and
eps is there to keep that finite when v is tiny; but float16 cannot hold 1e-8 (its smallest normal number is
6.1e-5, its smallest subnormal 6e-8), so eps becomes 0 and the guard is gone. AmpWatch checks every param group
of float16 parameters at fit start and names the line of configure_optimizers that returns the optimizer.

AmpWatch should name it EPS_UNDERFLOW at that line. The script exits 1 if it does not.
"""

import sys
import tempfile

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import expect


class HalfWithAdam(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)  # the mistake: eps=1e-8 by default


def main() -> int:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256))
    watch = AmpWatch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="16-true",  # float16 weights and optimizer state, no scaler
        max_steps=10,
        callbacks=[watch],
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_eps_underflow-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(HalfWithAdam(), DataLoader(data, batch_size=32))
    return expect(watch, Finding.EPS_UNDERFLOW, script=__file__, marker="# the mistake: eps=1e-8 by default")




if __name__ == "__main__":
    sys.exit(main())
