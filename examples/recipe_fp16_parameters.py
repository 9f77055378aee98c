"""FP16_PARAMETERS: the model is already float16 under 16-mixed precision.

Run it:  python examples/recipe_fp16_parameters.py      (a few seconds on a CPU; no GPU needed)

16-mixed keeps the weights in float32 and lets autocast run the matrix products in float16. Calling ``.half()``
on the model as well leaves nothing in float32: the updates lose precision, and GradScaler refuses to unscale
float16 gradients, so the first optimizer step fails with "Attempting to unscale FP16 gradients". AmpWatch
checks the parameter dtypes at fit start and names the first float16 parameter before that error arrives.

AmpWatch should name it FP16_PARAMETERS. The script exits 1 if it does not.
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


class HalfModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).half()  # the mistake

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

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
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_fp16_parameters-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(HalfModel(), DataLoader(data, batch_size=32))
    except ValueError as err:  # GradScaler: "Attempting to unscale FP16 gradients."
        print(f"The run failed as expected: {err}")
    return expect(watch, Finding.FP16_PARAMETERS, location="net.0.weight")


if __name__ == "__main__":
    sys.exit(main())
