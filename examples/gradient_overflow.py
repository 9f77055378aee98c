"""GRADIENT_OVERFLOW: gradients too large for float16 at GradScaler's default scale of 2**16.

Run it:  python examples/gradient_overflow.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

The loss is summed over the batch instead of averaged, so the gradients are ~32x larger than usual.
Multiplied by the default scale they overflow float16; the scaler skips step after step, halving the
scale each time, until it reaches one the gradients fit under. AmpWatch names the scale that held.

AmpWatch should name it GRADIENT_OVERFLOW. The script exits 1 if it does not.
"""

import sys
import tempfile

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, expect, regression_data


def main() -> int:
    pl.seed_everything(0, verbose=False)
    model = Regressor(lr=1e-4, reduction="sum")  # the culprit: sum, not mean, over the batch
    data = regression_data(y_scale=4.0)
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=60,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-gradient_overflow-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.GRADIENT_OVERFLOW)



if __name__ == "__main__":
    sys.exit(main())
