"""A rollback from a snapshot is exactly the fix applied by hand from the same state: the treated run's weights at
the end equal those of an unwatched run that keeps the state after the snapshot's step itself, puts it back (model,
optimizer, scaler) where the treated run rolled back, and runs the located module in float32 from there. Real
float16 autocast and a real GradScaler; the same check on CUDA is in tests/test_cuda.py."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from conftest import make_trainer
from test_recovery_e2e import Classifier
from test_trajectory import separable
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding

ROLLED_BACK = re.compile(r"rolled back from step (\d+) to step (\d+) \(the in-memory snapshot")


class FixByHand(pl.Callback):
    """Keeps deep copies of the model's, optimizer's and scaler's state after optimizer step ``keep_after`` (0-based);
    once ``at`` optimizer steps are done, puts them back and runs ``module`` (a submodule's name) in float32 with
    autocast off: what a snapshot rollback with an FP32 island does, written out by hand."""

    def __init__(self, keep_after: int, at: int, module: str) -> None:
        self.keep_after, self.at, self.module = keep_after, at, module
        self.kept: Any = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        done = trainer.global_step
        scaler = trainer.precision_plugin.scaler
        if done == self.keep_after + 1:
            self.kept = copy.deepcopy((pl_module.state_dict(), trainer.optimizers[0].state_dict(),
                                       scaler.state_dict()))
        if done == self.at:
            model_state, optimizer_state, scaler_state = self.kept
            pl_module.load_state_dict(model_state)
            trainer.optimizers[0].load_state_dict(optimizer_state)
            scaler.load_state_dict(scaler_state)
            target = pl_module.get_submodule(self.module)
            plain = target.forward

            def in_float32(x: torch.Tensor) -> torch.Tensor:
                with torch.autocast(x.device.type, enabled=False):
                    return plain(x.float())

            target.forward = in_float32


def rollback_against_hand(fit: Callable[[Path, list[Any]], pl.LightningModule], root: Path) -> tuple[Any, Any, Any]:
    """The treated run (AmpWatch rolls back and islands), then the same run with the fix by hand from the same state:
    ``(diagnosis, treated module, module fixed by hand)``."""
    watch = AmpWatch(verbose=False, remediate=True, snapshot_every=5)
    treated = fit(root / "treated", [watch])
    [d] = [d for d in watch.diagnoses if d.remedy]
    assert (d.finding, d.location, d.remedy) == (Finding.FORWARD_OVERFLOW, "head", "fp32_island"), d
    found = ROLLED_BACK.match(d.evidence["rollback"])
    assert found is not None, d.evidence["rollback"]
    now, to_step = map(int, found.groups())
    by_hand = fit(root / "by_hand", [FixByHand(to_step - 1, now, "head")])
    return d, treated, by_hand


def _cpu_fit(root: Path, callbacks: list[Any]) -> pl.LightningModule:
    pl.seed_everything(0, verbose=False)
    module = Classifier()
    make_trainer(root, callbacks, "fp16", {"init_scale": 2.0**8}, max_steps=40).fit(
        module, DataLoader(separable(), batch_size=32))
    return module


def test_a_snapshot_rollback_with_an_island_equals_the_fix_applied_by_hand(tmp_path: Path) -> None:
    d, treated, by_hand = rollback_against_hand(_cpu_fit, tmp_path)
    assert d.outcome == "recovered"
    for (name, a), b in zip(treated.named_parameters(), by_hand.parameters()):
        assert bool(torch.isfinite(a).all()), name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
