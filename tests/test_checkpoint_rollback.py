"""Rolling back to a checkpoint file: only one this fit wrote (or resumed from), only one that holds the whole
training state, and an alarm that is never lost when a rollback fails. Real fits: true float16 autocast with a real
GradScaler on the CPU, a learning rate that jumps 100x at step 20, real ``ModelCheckpoint`` files."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_trajectory_e2e import LrJump
from torch import nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.scenarios import Regressor, regression_data
from lightning_ampwatch.summary import RunStats, summary_lines


def _fit(tmp_path: Path, module: pl.LightningModule, watch: AmpWatch | None, callbacks: list[Any],
         max_steps: int = 50, ckpt_path: str | None = None) -> tuple[pl.Trainer, list[str]]:
    """The fit, and the internal-error warnings AmpWatch gave during it."""
    trainer = make_trainer(tmp_path, [*callbacks, *([watch] if watch else [])], "fp16", max_steps=max_steps,
                           enable_checkpointing=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(regression_data(), batch_size=32), ckpt_path=ckpt_path)
    return trainer, [str(w.message) for w in caught if "AmpWatch hit an internal error" in str(w.message)]


def _alarm(watch: AmpWatch) -> Any:
    """The LR jump's alarm, the first one treated."""
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert alarms, "the LR jump's alarm was lost"
    return alarms[0]


def _not_healthy(watch: AmpWatch, steps: int) -> None:
    lines = summary_lines(watch.diagnoses, RunStats(steps))
    assert not any("Healthy run" in line for line in lines), lines


def test_a_weights_only_checkpoint_is_never_rolled_back_to(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    weights = ModelCheckpoint(dirpath=str(tmp_path / "weights"), save_weights_only=True, every_n_train_steps=5,
                              save_top_k=-1)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)
    _, errors = _fit(tmp_path, LrJump(), watch, [weights])
    assert errors == []
    d = _alarm(watch)
    assert d.remedy == "reduce_lr"  # applied in place: no file holds the optimizer's state to go back to
    rollback = d.evidence["rollback"]
    assert rollback.startswith("none: snapshots are off and no checkpoint file from before it could be rolled back to")
    assert "hold only the weights, written with save_weights_only=True" in rollback
    assert ".ckpt" not in rollback
    _not_healthy(watch, 50)


def test_a_full_checkpoint_is_rolled_back_to_even_when_a_newer_weights_only_one_exists(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    weights = ModelCheckpoint(dirpath=str(tmp_path / "weights"), save_weights_only=True, every_n_train_steps=3,
                              save_top_k=-1)
    full = ModelCheckpoint(dirpath=str(tmp_path / "full"), every_n_train_steps=7, save_top_k=-1)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)
    _, errors = _fit(tmp_path, LrJump(), watch, [weights, full])
    assert errors == []
    d = _alarm(watch)
    rollback = d.evidence["rollback"]
    # the LR jumped at step 20: the weights-only file at step 18 is newer, the full one at step 14 restores everything
    assert os.path.exists(tmp_path / "weights" / "epoch=1-step=18.ckpt")
    assert f"(the checkpoint file {tmp_path / 'full' / 'epoch=0-step=14.ckpt'})" in rollback, rollback
    assert "rolled back from step " in rollback and " to step 14 " in rollback
    assert d.remedy == "reduce_lr"


class Wider(Regressor):
    """Another model (a wider hidden layer) that an earlier, unrelated run trained, with a steady LR."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


class Steady(Regressor):
    """The same model as :class:`LrJump`, with an LR that never jumps: an earlier, healthy run."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=3e-2)
        return {"optimizer": opt, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), "interval": "step"}}


@pytest.mark.parametrize("earlier", [Steady, Wider], ids=["same_model", "other_model"])
def test_a_checkpoint_another_run_left_in_the_folder_is_never_rolled_back_to(tmp_path: Path, earlier: type) -> None:
    folder = tmp_path / "ckpt"
    pl.seed_everything(1, verbose=False)
    _fit(tmp_path / "earlier", earlier(), None, [ModelCheckpoint(dirpath=str(folder), every_n_train_steps=10,
                                                                 save_top_k=-1)], max_steps=20)
    theirs = set(os.listdir(folder))
    assert theirs  # files at steps 10 and 20, from before the LR jump of the run below
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)
    _, errors = _fit(tmp_path, LrJump(), watch, [ModelCheckpoint(dirpath=str(folder), every_n_train_steps=100)])
    assert errors == []
    d = _alarm(watch)
    rollback = d.evidence["rollback"]
    assert not any(name in rollback for name in theirs), rollback
    assert rollback.startswith("none: ") and "2 files that were already there when this fit began" in rollback
    assert d.remedy == "reduce_lr"
    _not_healthy(watch, 50)


def test_this_fits_own_file_is_rolled_back_to_beside_another_runs_files(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    pl.seed_everything(1, verbose=False)
    _fit(tmp_path / "earlier", Steady(), None, [ModelCheckpoint(dirpath=str(folder), every_n_train_steps=10,
                                                                save_top_k=-1)], max_steps=20)
    theirs = set(os.listdir(folder))
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)
    _, errors = _fit(tmp_path, LrJump(), watch, [ModelCheckpoint(dirpath=str(folder), every_n_train_steps=5,
                                                                 save_top_k=-1)])
    assert errors == []
    rollback = _alarm(watch).evidence["rollback"]
    assert rollback.startswith("rolled back from step ") and " to step 20 " in rollback
    path = rollback.split("(the checkpoint file ")[1].split(")")[0]
    assert os.path.basename(path) not in theirs and os.path.dirname(path) == str(folder)


def test_a_resumed_fit_rolls_back_to_the_file_it_resumed_from(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    pl.seed_everything(0, verbose=False)
    first = ModelCheckpoint(dirpath=str(folder), every_n_train_steps=9, save_top_k=-1)
    _fit(tmp_path, LrJump(), None, [first], max_steps=18)
    resumed_from = folder / "epoch=1-step=18.ckpt"
    assert resumed_from.exists() and (folder / "epoch=0-step=9.ckpt").exists()
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)
    _, errors = _fit(tmp_path, LrJump(), watch, [ModelCheckpoint(dirpath=str(folder), every_n_train_steps=100)],
                     ckpt_path=str(resumed_from))
    assert errors == []
    rollback = _alarm(watch).evidence["rollback"]
    assert f"(the checkpoint file {resumed_from})" in rollback and " to step 18 " in rollback, rollback


class FailsToLoad(LrJump):
    """Its ``on_load_checkpoint`` hook raises (a user's hook that cannot read a file): a rollback fails."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        raise RuntimeError("this module reads no checkpoints")


def test_a_rollback_that_fails_still_publishes_the_alarm_saying_why(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    full = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)
    _, errors = _fit(tmp_path, FailsToLoad(), watch, [full])
    assert len(errors) == 1 and "this module reads no checkpoints" in errors[0]
    d = _alarm(watch)
    assert d.remedy is None  # not applied to a state the failed rollback may have left partly restored
    rollback = d.evidence["rollback"]
    assert rollback.startswith("failed: restoring the checkpoint file ") and "step=20.ckpt" in rollback
    assert "RuntimeError: this module reads no checkpoints" in rollback
    assert rollback.endswith("nothing had been restored from it yet; no remedy was applied")
    _not_healthy(watch, 50)
    assert [r.name for r in watch.applied] == []
    from lightning_ampwatch.reporters import unremedied_reason  # the summary's words for why it got no remedy

    assert unremedied_reason(d, watch.diagnoses, watch.remedies) == \
        "its rollback failed, so no remedy was applied (the rollback row says why)"
