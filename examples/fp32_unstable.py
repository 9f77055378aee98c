"""FP32_UNSTABLE: the loss diverges in plain float32; mixed precision is not to blame.

Run it:  python examples/fp32_unstable.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

No autocast, no scaler: full precision with a learning rate far too high (5.0 with SGD). The loss
grows until it is inf/NaN. AmpWatch watches the loss without a scaler and says this is an
optimisation problem, not an AMP one.

AmpWatch should name it FP32_UNSTABLE. The script exits 1 if it does not.
"""

import sys
import tempfile

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, expect, regression_data


def main() -> int:
    pl.seed_everything(0, verbose=False)
    model = Regressor(lr=5.0)  # the culprit: a learning rate far too high
    data = regression_data()
    watch = AmpWatch()  # diagnose only; AmpWatch(remediate=True) would also apply the fix mid-run
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="32-true",  # full precision: no autocast, no GradScaler
        max_steps=40,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-fp32_unstable-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=32))
    return expect(watch, Finding.FP32_UNSTABLE)



if __name__ == "__main__":
    sys.exit(main())
