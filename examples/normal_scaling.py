"""NORMAL_SCALING: a healthy float16 run where the scaler skips a step now and then. Not an alarm.

Run it:  python examples/normal_scaling.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

The GradScaler starts at 2**18, a little above what the gradients allow; it skips a step or two,
backs off, and training goes on. That is dynamic loss scaling working as designed: AmpWatch says so
once, as information, and raises no alarm.

AmpWatch should name it NORMAL_SCALING. The script exits 1 if it does not.
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
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**18))],
        max_steps=40,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-normal_scaling-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.NORMAL_SCALING)



if __name__ == "__main__":
    sys.exit(main())
