"""CLIP_BEFORE_UNSCALE: Lightning's manual-optimization clipping runs on gradients still multiplied by the scale.

Run it:  python examples/recipe_clip_before_unscale.py      (a few seconds on a CPU; no GPU needed)

In manual optimization ``self.clip_gradients(opt, ...)`` before ``opt.step()`` clips the *scaled* gradients:
``opt.step()`` unscales only afterwards. With the default scale 2**16 a limit of 1.0 really clips at 1.5e-5,
so training barely moves. AmpWatch names the line and the fix that works in Lightning (clip in
``on_before_optimizer_step``, which runs after unscaling).

AmpWatch should name it CLIP_BEFORE_UNSCALE at the clip_gradients line. The script exits 1 if it does not.
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


class ManualClipping(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self.net(x).squeeze(-1), y))
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")  # the mistake
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
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_clip_before_unscale-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(ManualClipping(), DataLoader(data, batch_size=32))
    return expect(watch, Finding.CLIP_BEFORE_UNSCALE, script=__file__, marker="# the mistake")




if __name__ == "__main__":
    sys.exit(main())
