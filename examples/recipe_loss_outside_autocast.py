"""LOSS_OUTSIDE_AUTOCAST: the loss is computed with autocast switched off, on float16 model outputs.

Run it:  python examples/recipe_loss_outside_autocast.py      (a few seconds on a CPU; no GPU needed)

Lightning runs ``training_step`` inside autocast, where cross-entropy runs in float32. This module turns
autocast off around the loss, so log-softmax and the reduction run in float16 on float16 logits. AmpWatch sees
a float32-only loss op that produced float16 in the loss's autograd graph, once, and names the line that
returned the loss.

AmpWatch should name it LOSS_OUTSIDE_AUTOCAST at the return line. The script exits 1 if it does not.
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


class LossWithoutAutocast(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)  # float16 under autocast
        with torch.autocast("cpu", enabled=False):
            return F.cross_entropy(logits, y)  # the mistake

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main() -> int:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
    watch = AmpWatch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=10,
        callbacks=[watch],
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_loss_outside_autocast-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LossWithoutAutocast(), DataLoader(data, batch_size=32))
    return expect(watch, Finding.LOSS_OUTSIDE_AUTOCAST, script=__file__, marker="# the mistake")




if __name__ == "__main__":
    sys.exit(main())
