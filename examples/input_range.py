"""INPUT_RANGE: features of magnitude ~1e5, beyond what float16 holds (65504).

Run it:  python examples/input_range.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

The inputs were never normalised. They are fine in float32, but autocast casts them to float16 for
the first Linear layer and they overflow at once. AmpWatch finds the largest magnitude in the batch
of the failing step and says where it is.

AmpWatch should name it INPUT_RANGE. The script exits 1 if it does not.
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
    model = Regressor()
    data = regression_data(x_scale=1e5)  # the culprit: unnormalised features
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=8,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-input_range-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.INPUT_RANGE)



if __name__ == "__main__":
    sys.exit(main())
