"""Learning rates and optimizers changed outside the schedulers, by a callback: real fp16 fits on the CPU.

A callback that raises the LR by hand (no scheduler) must be read as the LR rise it is, dated to the step that first
ran with it, and the FP32 trajectory control must replay each step at the LRs the run ran with (not the snapshot's):
else the replay stays finite and the alarm reads as a hardware suspicion. A callback that swaps in a new optimizer must
not leave the step hook on the old one (every later step counted as skipped: a false alarm on a healthy run)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin
from lightning_ampwatch.taxonomy import Finding
from lightning_ampwatch.timeline import TIMELINE_NAME, read_timeline
from lightning_ampwatch.trajectory.replay import replay_trajectory


def _alarms(watch: AmpWatch) -> list[Any]:
    """The diagnoses but the scaler finding its level (a skip at the first steps, said or not as the run goes)."""
    return [d for d in watch.diagnoses if d.finding is not Finding.NORMAL_SCALING]


def _fit(root: Path, callbacks: list[Any], model: pl.LightningModule, epochs: int = 4) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[true_fp16_plugin()], callbacks=callbacks,
                         default_root_dir=str(root), max_steps=-1, max_epochs=epochs, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, logger=False)
    trainer.fit(model, DataLoader(regression_data(), batch_size=32))
    return trainer


class RaiseLr(Callback):
    """At epoch 2 (step 32), the first param group's LR goes from 0.02 to 0.8: by hand, no scheduler."""

    def __init__(self, hook: str = "epoch") -> None:
        self.hook = hook

    def _raise(self, trainer: pl.Trainer) -> None:
        trainer.optimizers[0].param_groups[0]["lr"] = 0.8

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.hook == "epoch" and trainer.current_epoch == 2:
            self._raise(trainer)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.hook == "batch" and trainer.global_step == 32:
            self._raise(trainer)


@pytest.mark.parametrize("hook", ["epoch", "batch"])
def test_lr_raised_by_a_callback_is_an_lr_rise_not_a_hardware_fault(tmp_path: Path, hook: str) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, [watch, RaiseLr(hook)], Regressor(lr=0.02))
    findings = [d.finding for d in watch.diagnoses]
    assert Finding.NOT_REPRODUCED not in findings, findings
    first = _alarms(watch)[0]
    assert first.finding is Finding.LR_SCHEDULE, findings
    ev = first.evidence
    assert ev["lr_event"] == "lr_increase"
    assert (ev["lr_before"], ev["lr_after"], ev["lr_change_step"]) == (0.02, 0.8, 32)


class ReplayAt(Callback):
    """Records the run's losses; at step 29 replays steps 11-29 from the snapshot after step 10 at the run's own
    precision (the FP32 control's twin), as AmpWatch's trajectory control does: its losses are the run's exactly
    only if each replayed step runs at the LR the run did."""

    def __init__(self, watch: AmpWatch) -> None:
        self.watch = watch
        self.live: dict[int, float] = {}
        self.replayed: list[float | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step - 1
        self.live[step] = float(outputs["loss"])
        if step == 29:
            watcher = self.watch.watcher
            watcher.caught_up()  # the clean steps' batches the ledger held back reach the ring now
            control = watcher.trajectory
            snapshot = control.ring.newest_before(20)
            assert snapshot is not None and snapshot.step == 10
            result = replay_trajectory(control.state, snapshot, control.ring.batches(11, 29), precision="amp")
            self.replayed = result.losses


def test_replay_runs_each_step_at_the_lrs_the_run_ran_with(tmp_path: Path) -> None:
    # A callback raises the LR from 0.02 to 0.05 at step 24 (no scheduler; the run stays healthy). The snapshot's
    # param groups hold 0.02: a replay that kept it would run steps 24-29 at the wrong LR and part from the run
    watch = AmpWatch(verbose=False, snapshot_every=10)
    probe = ReplayAt(watch)

    class RaiseAt24(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 24:
                trainer.optimizers[0].param_groups[0]["lr"] = 0.05

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[true_fp16_plugin()],
                         callbacks=[watch, RaiseAt24(), probe], default_root_dir=str(tmp_path), max_steps=32,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         logger=False)
    trainer.fit(Regressor(lr=0.02), DataLoader(regression_data(), batch_size=32))
    assert len(probe.replayed) == 19
    live = [probe.live[s] for s in range(11, 30)]
    assert probe.replayed == pytest.approx(live, rel=1e-6), list(zip(range(11, 30), live, probe.replayed))
    assert _alarms(watch) == []


class Swap(Callback):
    """At epoch 2 a new optimizer replaces the first (a healthy run: Adam at a small LR)."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 2:
            trainer.strategy.optimizers = [torch.optim.Adam(pl_module.parameters(), lr=1e-3)]


def test_a_swapped_optimizer_is_read_and_its_steps_are_not_counted_as_skipped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        trainer = _fit(tmp_path, [watch, Swap()], Regressor(lr=0.02))
    adam = trainer.optimizers[0]
    assert int(next(iter(adam.state.values()))["step"]) == 32  # the real run: Adam took every step of its epochs
    assert _alarms(watch) == [], [(d.finding, d.step) for d in watch.diagnoses]
    assert watch.machine is not None and watch.machine.skipped_total <= 1  # at most the scaler's first step
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("AmpWatch")]
    assert out[-1].startswith("AmpWatch: 64 optimizer steps") and "Healthy run." in out[-1], out
    said = [r.getMessage() for r in caplog.records if "optimizers changed" in r.getMessage()]
    assert len(said) == 1 and "Adam" in said[0], said


class SwapHot(Callback):
    """At epoch 2 a new optimizer at a far higher LR (0.8 against 0.02) replaces the first: the run falls apart."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == 2:
            trainer.strategy.optimizers = [torch.optim.SGD(pl_module.parameters(), lr=0.8)]


def test_a_swapped_optimizer_at_a_higher_lr_is_that_lr_rise(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, [watch, SwapHot()], Regressor(lr=0.02))
    alarm = _alarms(watch)[0]
    assert alarm.finding is Finding.LR_SCHEDULE, [(d.finding, d.step) for d in watch.diagnoses]
    ev = alarm.evidence
    assert (ev["lr_event"], ev["lr_before"], ev["lr_after"], ev["lr_change_step"]) == ("lr_increase", 0.02, 0.8, 32)


class Backbone(Regressor):
    """A model BackboneFinetuning can unfreeze: its encoder is the backbone, frozen until epoch 2."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backbone = self.encoder

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def test_a_param_group_added_mid_run_is_read(tmp_path: Path) -> None:
    # BackboneFinetuning adds the backbone as a new param group, at a far too high LR, at epoch 2 (step 32): the
    # run falls apart. The new group is noticed and its LR read from the first anomalous step on (in the timeline,
    # and for the replay), not only at the next log step (which this run never reaches)
    watch = AmpWatch(verbose=False)
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=2, backbone_initial_lr=20.0, should_align=False,
                                    lambda_func=lambda _: 1.0)
    _fit(tmp_path, [watch, finetuning], Backbone(lr=0.02), epochs=3)
    assert _alarms(watch), [(d.finding, d.step) for d in watch.diagnoses]
    alarm = _alarms(watch)[0]
    data = read_timeline(tmp_path / "ampwatch" / TIMELINE_NAME)
    assert all(len(lrs) == 1 for step, lrs in zip(data.steps, data.lrs) if step < 32)
    assert any(lrs == (0.02, 20.0) for step, lrs in zip(data.steps, data.lrs) if step <= alarm.step + 1), \
        list(zip(data.steps, data.lrs))
