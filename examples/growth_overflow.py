"""GROWTH_OVERFLOW: the GradScaler grows its scale so often that each growth overflows.

Run it:  python examples/growth_overflow.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

GradScaler doubles the scale after growth_interval clean steps (2000 by default). Here it is told
to grow after every 3, so the scale keeps climbing past what the gradients can take, and the step
right after each growth overflows and is thrown away.

AmpWatch should name it GROWTH_OVERFLOW. The script exits 1 if it does not.
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
    model = Regressor(lr=1e-2)
    data = regression_data()
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)  # the culprit: the default is 2000
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        max_steps=60,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-growth_overflow-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.GROWTH_OVERFLOW)



if __name__ == "__main__":
    sys.exit(main())
