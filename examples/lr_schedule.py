"""LR_SCHEDULE: the learning rate jumps, and a few steps later float16 overflows.

Run it:  python examples/lr_schedule.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

A LambdaLR multiplies the learning rate by 40 at step 30 (as a schedule restart or a warmup that ends
too high would). The weights blow up, the activations overflow float16, and the scaler starts
skipping. The scaler is not the cause: AmpWatch points at the LR change, with the LR before and after.

AmpWatch should name it LR_SCHEDULE. The script exits 1 if it does not.
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
    model = Regressor(lr=0.02, lr_lambda=lambda step: 40.0 if step >= 30 else 1.0)  # the culprit
    data = regression_data()
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=60,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-lr_schedule-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.LR_SCHEDULE)



if __name__ == "__main__":
    sys.exit(main())
