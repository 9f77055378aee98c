"""STEP_OUTSIDE_SCALER: the raw optimizer is stepped directly, past the GradScaler.

Run it:  python examples/recipe_step_outside_scaler.py      (a few seconds on a CPU; no GPU needed)

In manual optimization ``self.optimizers()`` hands back a LightningOptimizer whose ``step()`` goes through the
scaler: unscale, skip on inf/NaN, update the scale. Reaching for ``.optimizer.step()`` applies gradients that
are still multiplied by 2**16, and nothing checks them for overflow. AmpWatch sees the optimizer step while the
scaler's state for it is not "unscaled" and names the line.

AmpWatch should name it STEP_OUTSIDE_SCALER at the raw step. The script exits 1 if it does not.
"""

import os
import sys
import tempfile

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding


class RawStep(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self.net(x).squeeze(-1), y))
        opt.optimizer.step()  # the mistake

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def main() -> int:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randn(256))
    watch = AmpWatch()
    # A raw step never advances Lightning's step counter, so the run is bounded by epochs instead.
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=-1,
        max_epochs=1,
        callbacks=[watch],
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_step_outside_scaler-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(RawStep(), DataLoader(data, batch_size=32))
    return verdict(watch, Finding.STEP_OUTSIDE_SCALER, line_of("# the mistake"))


def line_of(marker: str) -> int:
    """The line of this script that makes the mistake: AmpWatch should name exactly that one."""
    with open(__file__, encoding="utf-8") as fh:
        return next(i for i, text in enumerate(fh, 1) if text.rstrip().endswith(marker))


def verdict(watch: AmpWatch, expected: Finding, line: int) -> int:
    """One line a person (or a test) can read: was the expected finding made, at the right line?"""
    found = [d for d in watch.diagnoses if d.finding is expected]
    if not found:
        seen = ", ".join(d.finding.value for d in watch.diagnoses) or "nothing"
        print(f"FAILED: expected {expected.value}, AmpWatch diagnosed {seen}.")
        return 1
    path, _, at = str(found[0].location).rpartition(":")
    if not (os.path.exists(path) and os.path.samefile(path, __file__) and at == str(line)):
        print(f"FAILED: {expected.value} was placed at {found[0].location}, not at line {line} of this script.")
        return 1
    print(f"Diagnosed {expected.value} at {found[0].location}. Event log: {watch.event_log.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
