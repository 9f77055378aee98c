"""NOT_REPRODUCED: a one-off NaN that replaying the same steps does not bring back; AMP is not blamed.

Run it:  python examples/not_reproduced.py    (about 10 s on 2 CPU cores, most of it importing torch; no GPU)

A bf16-mixed run whose model, once, at step 30, sees a glitch from outside its own arithmetic: a flag set by
something else (here a counter in the model, standing in for a flipped bit or a racy cache) turns one
activation into inf. The loss is NaN, the weights are ruined (no scaler protects a bf16 run). AmpWatch takes
the snapshot it kept from before the step and runs the same steps again, with the same batches and random
state, in float32 and in bf16: both stay finite. The fault did not reproduce, so it is not an overflow of
reduced precision, and AmpWatch says so instead of blaming bf16.

AmpWatch should name it NOT_REPRODUCED. The script exits 1 if it does not.
"""

import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, expect, regression_data


class Glitchy(Regressor):
    """A healthy regressor, except that at step 30 something outside its arithmetic corrupts one forward."""

    def __init__(self) -> None:
        super().__init__(lr=1e-2)
        self.glitch_at, self.glitched = 30, False

    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        if self.trainer.global_step == self.glitch_at and not self.glitched:
            self.glitched = True  # the culprit: state the replay cannot bring back
            out = out * float("inf")
        return out


def main() -> int:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",  # bfloat16 autocast: no scaler, so the NaN reaches the weights
        max_steps=40,
        callbacks=[watch],
        log_every_n_steps=10,
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-not_reproduced-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Glitchy(), DataLoader(regression_data(), batch_size=32))
    return expect(watch, Finding.NOT_REPRODUCED)


if __name__ == "__main__":
    sys.exit(main())
