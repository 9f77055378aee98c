"""The watch path costs nothing on a healthy step, and what it logs reaches TensorBoard.

The no-sync test patches the few tensor methods that force a host-device synchronisation (patching is
allowed in this one test) and counts the calls whose call stack passes through lightning_ampwatch code.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

import lightning_ampwatch
from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, regression_data
from lightning_ampwatch.signals import LossTape

from conftest import make_trainer

PACKAGE_DIR = str(Path(lightning_ampwatch.__file__).resolve().parent)
# The demo models and the CLI are user-side code that happens to live in the package: not the watch path.
NOT_WATCH_CODE = ("scenarios.py", "cli.py")

#: Tensor methods that read a device value on the host (a sync on an accelerator).
SYNCING_TENSOR_METHODS = ("item", "__bool__", "__float__", "__int__", "tolist")


def _called_from_watch_code() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(PACKAGE_DIR) and not filename.endswith(NOT_WATCH_CODE):
            return True
        frame = frame.f_back
    return False


class SyncCounter:
    """Counts syncing calls made from lightning_ampwatch while ``active``; records the step of each."""

    def __init__(self) -> None:
        self.active = False
        self.step = -1
        self.calls: list[tuple[int, str]] = []

    def wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.active and _called_from_watch_code():
                self.calls.append((self.step, name))
            return original(*args, **kwargs)

        return counted

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in SYNCING_TENSOR_METHODS:
            monkeypatch.setattr(torch.Tensor, name, self.wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch.amp.GradScaler, "get_scale",
                            self.wrap("GradScaler.get_scale", torch.amp.GradScaler.get_scale))


class CountingWindow(Callback):
    """Turns counting on for each training batch from the second optimizer step on, off at the end of training.

    Step 0 is left out on purpose: once per fit AmpWatch reads the first loss (the run's loss level for the
    FP32 control, and the loss-graph check for a hand-made prescale). Once per fit is not per step.
    """

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counter.step = trainer.global_step
        self.counter.active = trainer.global_step >= 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counter.active = False


def healthy_fp16_fit(tmp_path: Path, counter: SyncCounter, log_every_n_steps: int,
                     max_steps: int = 24) -> tuple[pl.Trainer, AmpWatch]:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch()
    # a scale the gradients never overflow and no growth inside the run: not one skipped step
    trainer = make_trainer(tmp_path, [CountingWindow(counter), watch], "fp16",
                           {"init_scale": 2.0**10, "growth_interval": 1000},
                           max_steps=max_steps, log_every_n_steps=log_every_n_steps)
    trainer.fit(Regressor(lr=1e-2), DataLoader(regression_data(), batch_size=32))
    return trainer, watch


def test_healthy_steps_add_no_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = SyncCounter()
    counter.install(monkeypatch)
    trainer, watch = healthy_fp16_fit(tmp_path, counter, log_every_n_steps=1000)

    assert watch.machine is not None
    assert watch.machine.steps_seen == trainer.global_step == 24  # every step was watched ...
    assert watch.machine.skipped_total == 0 and watch.diagnoses == []  # ... and every step was healthy
    assert counter.calls == [], f"syncs from lightning_ampwatch on healthy non-log steps: {counter.calls}"

    # the counter does see a read made by package code (so the zero above means something)
    counter.active = True
    tape = LossTape()
    tape.add(torch.tensor(3.0), 1.0)
    assert tape.read() == 3.0
    assert counter.calls and counter.calls[-1][1] == "Tensor.__float__"


def test_log_steps_are_where_the_watch_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = SyncCounter()
    counter.install(monkeypatch)
    trainer, watch = healthy_fp16_fit(tmp_path, counter, log_every_n_steps=8)
    assert watch.machine is not None and watch.machine.skipped_total == 0
    read_steps = {step for step, _ in counter.calls}
    assert read_steps, "the scale is read at log steps"
    assert read_steps <= {7, 15, 23}, counter.calls  # Lightning logs when (step + 1) % 8 == 0


def test_tensorboard_holds_the_scalars_and_the_diagnosis_text(tmp_path: Path) -> None:
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb", version=0)
    scenario = SCENARIOS["gradient_overflow"]
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = make_trainer(tmp_path, [watch], "fp16", logger=logger, max_steps=30, log_every_n_steps=5)
    trainer.fit(scenario.model(), scenario.dataloader())
    logger.experiment.flush()
    diagnosis = next(d for d in watch.diagnoses if d.finding is Finding.GRADIENT_OVERFLOW)

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    for name in ("ampwatch/scale", "ampwatch/skipped_steps", "ampwatch/nonfinite_losses"):
        assert name in tags["scalars"], tags["scalars"]

    scales = [e.value for e in events.Scalars("ampwatch/scale")]
    assert len(scales) == 6  # steps 4, 9, ..., 29
    assert all(math.log2(s).is_integer() for s in scales), scales  # GradScaler only halves and doubles
    assert max(scales) <= 2.0**16 and min(scales) < 2.0**16  # the scaler backed off from its start
    skipped = [e.value for e in events.Scalars("ampwatch/skipped_steps")]
    assert skipped == sorted(skipped) and skipped[-1] == watch.machine.skipped_total > 0  # type: ignore[union-attr]

    text_tags = [t for t in tags["tensors"] if t.startswith("ampwatch/diagnosis")]
    assert text_tags, tags["tensors"]
    texts = [tensor_event.tensor_proto.string_val[0].decode()
             for tag in text_tags for tensor_event in events.Tensors(tag)]
    assert any("GRADIENT_OVERFLOW" in t and f"at step {diagnosis.step}" in t for t in texts), texts
    assert any(diagnosis.advice[:60] in t for t in texts)
    # with a logger, the event log sits in the logger's directory
    assert (Path(logger.log_dir) / "ampwatch" / "diagnoses.jsonl").is_file()
