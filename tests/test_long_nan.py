"""A run stuck at NaN for thousands of steps keeps flat memory: no snapshot is taken while trouble lasts, so the
batches held for the trajectory control are capped, and the snapshots from before it are let go (and said to be).

The 18,000-step check takes minutes on a shared CPU: it runs with ``AMPWATCH_SLOW=1`` (as the examples run all
with ``AMPWATCH_ALL_EXAMPLES=1``); the bound itself is checked on every run in a few hundred steps."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch


class StuckAtNaN(pl.LightningModule):
    """Healthy for ``healthy`` steps (so snapshots are taken), then a NaN loss on every step for good."""

    def __init__(self, healthy: int) -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.healthy = healthy

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        return loss if self.global_step < self.healthy else loss * float("nan")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class Probe(pl.Callback):
    """Runs after AmpWatch: the most batches its snapshot ring held, and the RSS at chosen steps."""

    def __init__(self, watch: AmpWatch, rss_at: tuple[int, ...] = ()) -> None:
        self.watch, self.rss_at = watch, rss_at
        self.most_held = 0
        self.rss: dict[int, float] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trajectory = self.watch.watcher.trajectory  # the core owns the trajectory control
        if trajectory is not None:
            self.most_held = max(self.most_held, len(trajectory.ring._batches))
        if trainer.global_step in self.rss_at:
            gc.collect()
            self.rss[trainer.global_step] = _rss_mib()


def _fit(tmp_path: Path, steps: int, watch: AmpWatch, probe: Probe) -> None:
    pl.seed_everything(0, verbose=False)
    data = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, default_root_dir=str(tmp_path),
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
                         callbacks=[watch, probe], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(StuckAtNaN(healthy=45), data)


def test_batches_held_through_a_nan_streak_are_capped(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    probe = Probe(watch)
    _fit(tmp_path, 400, watch, probe)
    cap = 20 * (2 + 2)  # snapshot_every * (the two snapshots kept + 2)
    assert 0 < probe.most_held <= cap
    assert [d.finding.value for d in watch.diagnoses if d.is_alarm]  # the streak was diagnosed


@pytest.mark.skipif(os.environ.get("AMPWATCH_SLOW") != "1", reason="18,000 steps: set AMPWATCH_SLOW=1")
def test_rss_stays_flat_over_an_18000_step_nan_streak(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    probe = Probe(watch, rss_at=(3_000, 17_999))
    _fit(tmp_path, 18_000, watch, probe)
    growth = probe.rss[17_999] - probe.rss[3_000]
    assert growth < 4.0, f"RSS grew {growth:.1f} MiB over 15,000 NaN steps"  # 29 MiB before the cap
