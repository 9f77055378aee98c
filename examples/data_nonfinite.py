"""DATA_NONFINITE: a NaN in the dataset, not a mixed-precision problem.

Run it:  python examples/data_nonfinite.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

One row of the training data holds a NaN. The loss of the batch that contains it is NaN whatever the
precision; under float16 the scaler just skips that step. AmpWatch checks the batch of the bad step
(and only that batch) and names the row.

AmpWatch should name it DATA_NONFINITE. The script exits 1 if it does not.
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
    data = regression_data(nan_rows=(200,))  # the culprit: row 200 holds a NaN (in batch 6)
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=12,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-data_nonfinite-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.DATA_NONFINITE)



if __name__ == "__main__":
    sys.exit(main())
