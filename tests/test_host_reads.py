"""How often AmpWatch makes the host wait for the device on a healthy fp16 run: never on an ordinary step, and
(the goal the callback is being rewritten for) at most one packed read per log step.

Reads are counted with torch.profiler per training batch (``tests/_reads.py``), and what AmpWatch adds is the
difference between the same seeded run with it and without it: a real Trainer, a real GradScaler on the CPU,
a real CSVLogger, so the log steps do all their work. Step 0 is left out: once per fit AmpWatch reads the first
loss (the loss level for the FP32 control, the loss-graph check); once per fit is not per step.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, steps
from lightning_ampwatch.scenarios import Regressor, regression_data

from _reads import ReadsByStep, added_reads, reads_per_step
from conftest import make_trainer

LOG_EVERY, MAX_STEPS = 8, 24
LOG_STEPS = {7, 15, 23}  # Lightning logs when (global_step + 1) % LOG_EVERY == 0
COUNTED_STEPS = range(1, MAX_STEPS)


def healthy_fit(root: Path, callbacks: list[Callback]) -> Callable[[list[Callback]], pl.Trainer]:
    """A seeded healthy fp16 fit: a scale the gradients never overflow and no growth, so not one skipped step."""

    def fit(marks: list[Callback]) -> pl.Trainer:
        pl.seed_everything(0, verbose=False)
        trainer = make_trainer(root, [*marks, *callbacks], "fp16", {"init_scale": 2.0**10, "growth_interval": 1000},
                               max_steps=MAX_STEPS, log_every_n_steps=LOG_EVERY,
                               logger=CSVLogger(str(root), name="csv", version=0))
        trainer.fit(Regressor(lr=1e-2), DataLoader(regression_data(), batch_size=32))
        return trainer

    return fit


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> ReadsByStep:
    """The reads of the run with nothing added: Lightning's and the scaler's own."""
    reads, _ = reads_per_step(healthy_fit(tmp_path_factory.mktemp("bare"), []))
    return reads


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory, bare: ReadsByStep) -> tuple[ReadsByStep, pl.Trainer, AmpWatch]:
    """The reads AmpWatch adds to that run, per step, with the trainer and the callback. The ledger keeps each loss
    as an unread tensor, as it does on an accelerator: on the CPU it would take each loss's value as it comes (no
    synchronisation there; see ``test_on_the_cpu_each_loss_is_taken_as_it_comes``), and the accelerator's way is the
    one these counts judge."""
    watch = AmpWatch(verbose=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steps.losses, "HOST_TAPE_DEVICES", frozenset())
        reads, trainer = reads_per_step(healthy_fit(tmp_path_factory.mktemp("watched"), [watch]))
    return added_reads(reads, bare), trainer, watch


@pytest.fixture(scope="module")
def watched_on_cpu(tmp_path_factory: pytest.TempPathFactory,
                   bare: ReadsByStep) -> tuple[ReadsByStep, pl.Trainer, AmpWatch]:
    """The same run with the CPU's way (the default there): each loss taken as a float when it comes."""
    watch = AmpWatch(verbose=False)
    reads, trainer = reads_per_step(healthy_fit(tmp_path_factory.mktemp("watched_cpu"), [watch]))
    return added_reads(reads, bare), trainer, watch


class ReadEveryStep(Callback):
    """A positive control: reads the step's loss in a known way at the end of every training batch."""

    def __init__(self, read: Callable[[torch.Tensor], Any]) -> None:
        self.read = read

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.read(outputs["loss"].detach())


@pytest.mark.parametrize(("read", "expected"), [
    (lambda loss: loss.item(), {"_local_scalar_dense": 1}),
    (lambda loss: bool(torch.isfinite(loss)), {"_local_scalar_dense": 1}),
    (lambda loss: [float(loss), float(loss * 2), float(loss * 3)], {"_local_scalar_dense": 3}),
    (lambda loss: torch.stack([loss, loss * 2, loss * 3]).tolist(), {"Tensor.tolist": 1}),
    (lambda loss: torch.stack([loss, loss * 2, loss * 3]).cpu().numpy(), {"Tensor.numpy": 1}),
], ids=["item", "bool", "three floats", "stacked tolist", "cpu numpy"])
def test_the_counter_sees_each_read_once(tmp_path: Path, bare: ReadsByStep, read: Callable[[torch.Tensor], Any],
                                         expected: dict[str, int]) -> None:
    # the bare run has reads of its own on every step (the scaler's found-inf check): subtraction removes them
    assert all(bare[step]["_local_scalar_dense"] >= 1 for step in COUNTED_STEPS), bare
    reads, _ = reads_per_step(healthy_fit(tmp_path, [ReadEveryStep(read)]))
    added = added_reads(reads, bare)
    assert {step: dict(added[step]) for step in COUNTED_STEPS} == {step: expected for step in COUNTED_STEPS}


def _logged_scales(trainer: pl.Trainer) -> list[float]:
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        return [float(row["ampwatch/scale"]) for row in csv.DictReader(f) if row.get("ampwatch/scale")]


def test_no_added_reads_between_log_steps(watched: tuple[ReadsByStep, pl.Trainer, AmpWatch]) -> None:
    added, trainer, watch = watched
    assert watch.machine is not None
    assert watch.machine.steps_seen == trainer.global_step == MAX_STEPS  # every step was watched ...
    assert watch.machine.skipped_total == 0 and watch.diagnoses == []  # ... and every step was healthy
    assert _logged_scales(trainer) == [2.0**10] * len(LOG_STEPS)  # the log steps did their work
    between = {step: dict(added[step]) for step in COUNTED_STEPS if step not in LOG_STEPS and added[step]}
    assert between == {}, f"reads AmpWatch added on steps that are not log steps: {between}"


def test_at_most_one_read_per_log_step(watched: tuple[ReadsByStep, pl.Trainer, AmpWatch]) -> None:
    added, _, _ = watched
    at_log_steps = {step: dict(added[step]) for step in sorted(LOG_STEPS)}
    assert all(sum(reads.values()) <= 1 for reads in at_log_steps.values()), \
        f"reads AmpWatch added per log step (at most one packed read wanted): {at_log_steps}"


def test_on_the_cpu_each_loss_is_taken_as_it_comes(watched_on_cpu: tuple[ReadsByStep, pl.Trainer, AmpWatch],
                                                   watched: tuple[ReadsByStep, pl.Trainer, AmpWatch]) -> None:
    # On the CPU a read waits for nothing: the loss's value is taken with one scalar read at each backward, and a log
    # step reads the scaler's scale and growth tracker as two scalars, with no packed read of the losses
    added, trainer, watch = watched_on_cpu
    assert watch.machine is not None and watch.machine.steps_seen == trainer.global_step == MAX_STEPS
    assert watch.machine.skipped_total == 0 and watch.diagnoses == []
    assert _logged_scales(trainer) == [2.0**10] * len(LOG_STEPS)
    assert {step: dict(added[step]) for step in COUNTED_STEPS} == {
        step: {"_local_scalar_dense": 3 if step in LOG_STEPS else 1} for step in COUNTED_STEPS}
    # the same losses, read either way, and the same loss level from them
    _, _, as_tensors = watched
    cpu_ledger, tensor_ledger = watch.watcher.ledger, as_tensors.watcher.ledger
    assert cpu_ledger is not None and tensor_ledger is not None and len(cpu_ledger.recent_losses) == MAX_STEPS
    assert list(cpu_ledger.recent_losses) == list(tensor_ledger.recent_losses)
    assert as_tensors.machine is not None and watch.machine.state.reference is not None
    assert watch.machine.state.reference == as_tensors.machine.state.reference
