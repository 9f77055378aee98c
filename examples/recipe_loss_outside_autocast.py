"""LOSS_OUTSIDE_AUTOCAST: the loss is computed with autocast switched off, on float16 model outputs.

Run it:  python examples/recipe_loss_outside_autocast.py      (a few seconds on a CPU; no GPU needed)

Lightning runs ``training_step`` inside autocast, where cross-entropy runs in float32. This module turns
autocast off around the loss, so log-softmax and the reduction run in float16 on float16 logits. AmpWatch sees
a float32-only loss op that produced float16 in the loss's autograd graph, once, and names the line that
returned the loss.

AmpWatch should name it LOSS_OUTSIDE_AUTOCAST at the return line. The script exits 1 if it does not.
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


class LossWithoutAutocast(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)  # float16 under autocast
        with torch.autocast("cpu", enabled=False):
            return F.cross_entropy(logits, y)  # the mistake

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main() -> int:
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
    watch = AmpWatch()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        max_steps=10,
        callbacks=[watch],
        default_root_dir=tempfile.mkdtemp(prefix="ampwatch-recipe_loss_outside_autocast-"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LossWithoutAutocast(), DataLoader(data, batch_size=32))
    return verdict(watch, Finding.LOSS_OUTSIDE_AUTOCAST, line_of("# the mistake"))


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
