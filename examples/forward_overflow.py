"""FORWARD_OVERFLOW: an operation in the forward pass overflows float16.

Run it:  python examples/forward_overflow.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

The model has a hand-written softmax attention that takes exp() of the raw scores without
subtracting their maximum (lightning_ampwatch.scenarios.ExpAttention). In float16, exp overflows
once a score passes ~11, so the loss itself is inf/NaN although the data are finite.

AmpWatch should name it FORWARD_OVERFLOW. The script exits 1 if it does not.
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
    model = Regressor(attention=True)  # the culprit: exp() of raw attention scores in float16
    data = regression_data(x_scale=10.0)
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=8,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-forward_overflow-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.FORWARD_OVERFLOW)



if __name__ == "__main__":
    sys.exit(main())
