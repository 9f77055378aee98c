"""Snapshots that hold what is trained, and the failures around them that must never cost the run's accounting.

Real fits on the CPU (real float16 autocast and a real GradScaler, or a GradScaler made with ``enabled=False``);
the model's failure comes from the real mechanism (a hand-written softmax whose ``exp`` overflows float16)."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from lightning.pytorch.plugins import MixedPrecision
from test_trajectory import separable
from torch import nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.summary import RunStats


class FrozenBase(pl.LightningModule):
    """A frozen base (float32 or bf16) under a trainable head: ``exp`` of the head's raw logits, no max-subtraction.
    On separable data Adam grows the logits until their exp overflows float16 (FP32 has room)."""

    def __init__(self, base_dtype: torch.dtype = torch.float32, lora: bool = False, dim: int = 8,
                 classes: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim).to(base_dtype).requires_grad_(False)
        with torch.no_grad():  # near the identity: the data stays separable through the base
            self.base.weight.copy_(torch.eye(dim) + 0.05 * torch.randn(dim, dim))
        self.head = nn.Linear(dim, classes)
        # a LoRA-style low-rank update of the base, trained (B starts at zero, as LoRA's does)
        self.lora_a = nn.Parameter(0.1 * torch.randn(2, dim)) if lora else None
        self.lora_b = nn.Parameter(torch.zeros(dim, 2)) if lora else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.base(x.to(self.base.weight.dtype)).float()
        if self.lora_a is not None:
            h = h + x @ self.lora_a.t() @ self.lora_b.t()
        e = self.head(h).exp()
        p = e / e.sum(-1, keepdim=True)
        return -p.gather(1, y[:, None]).float().log().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.3)


def _fit(tmp_path: Any, module: pl.LightningModule, watch: AmpWatch, max_steps: int = 24,
         plugin: Any = None) -> pl.Trainer:
    if plugin is None:
        trainer = make_trainer(tmp_path, [watch], "fp16", {"init_scale": 2.0**8}, max_steps=max_steps)
    else:
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, default_root_dir=str(tmp_path),
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[watch], plugins=[plugin])
    trainer.fit(module, DataLoader(separable(), batch_size=32))
    return trainer


def _internal_failures(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "internal error" in str(w.message)]


@pytest.mark.parametrize("base_dtype, lora", [(torch.float32, False), (torch.bfloat16, False),
                                              (torch.bfloat16, True)],
                         ids=["fp32-base-head", "bf16-base-head", "bf16-base-lora"])
def test_a_frozen_base_is_left_out_of_snapshots_and_the_trajectory_control_runs(
        tmp_path: Any, base_dtype: torch.dtype, lora: bool) -> None:
    pl.seed_everything(0, verbose=False)
    module = FrozenBase(base_dtype, lora)
    watch = AmpWatch(verbose=False, snapshot_every=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path, module, watch)
    assert not _internal_failures(caught)
    d = next(d for d in watch.diagnoses if d.is_alarm)
    assert "trajectory_verdict" in d.evidence, d.evidence.get("trajectory_control")
    assert d.finding in (Finding.FORWARD_OVERFLOW, Finding.GRADIENT_OVERFLOW)
    assert d.evidence["control_verdict"].endswith(": an AMP fault")
    # the bytes of the trained state: weights, Adam's two moments and step count per trainable parameter, and
    # the scaler's scale and growth tracker; the frozen base is not in them
    trained = [p for p in module.parameters() if p.requires_grad]
    expected = 3 * sum(p.nbytes for p in trained) + 4 * len(trained) + 8
    assert d.evidence["trajectory_snapshot_bytes"] == expected
    assert sum(p.nbytes for p in module.base.parameters()) > 0 and all(
        not p.requires_grad for p in module.base.parameters())


def test_a_frozen_parameter_changed_in_place_stops_the_snapshots_with_the_reason(tmp_path: Any) -> None:
    class Drifting(FrozenBase):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 7:  # a "frozen" base someone edits in place (an EMA, a manual merge ...)
                with torch.no_grad():
                    self.base.bias.add_(0.0)

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=5)
    _fit(tmp_path, Drifting(), watch)
    d = next(d for d in watch.diagnoses if d.is_alarm)
    assert "trajectory_verdict" not in d.evidence
    assert "'base.bias' was changed in place" in d.evidence["trajectory_control"]


def test_a_disabled_grad_scaler_is_watched_without_internal_failure(tmp_path: Any) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=2)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", enabled=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, FrozenBase(), watch, max_steps=12, plugin=plugin)
    assert not _internal_failures(caught)
    assert watch.precision.scaler is None
    stats = RunStats.of_run(watch.watcher.machine, watch.watcher.ledger.mirror)
    assert stats is not None and stats.steps == trainer.global_step == 12 and stats.scale is None


class LockedAdam(torch.optim.Adam):
    """An optimizer that keeps a lock in its param groups (a handle a user's optimizer may carry): it cannot be
    deep-copied, so every snapshot of it fails, the real way."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group["lock"] = threading.Lock()


class Scales(pl.Callback):
    """The run's own count of skipped steps: the scaler's scale backs off exactly on a skipped step."""

    def __init__(self) -> None:
        self.skipped = 0
        self._last: float | None = None

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._last = float(trainer.precision_plugin.scaler.get_scale())  # the initial scale, before any step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        scale = float(trainer.precision_plugin.scaler.get_scale())
        if self._last is not None and scale < self._last:
            self.skipped += 1
        self._last = scale


def test_a_failing_snapshot_is_reported_once_and_every_step_stays_counted(tmp_path: Any) -> None:
    class Locked(FrozenBase):
        def configure_optimizers(self) -> Any:
            return LockedAdam([p for p in self.parameters() if p.requires_grad], lr=0.3)

    pl.seed_everything(0, verbose=False)
    watch, scales = AmpWatch(verbose=False, snapshot_every=2), Scales()
    trainer = make_trainer(tmp_path, [watch, scales], "fp16", {"init_scale": 2.0**20}, max_steps=30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Locked(), DataLoader(separable(), batch_size=32))
    failures = _internal_failures(caught)
    assert len(failures) == 1 and "snapshot" in failures[0]
    stats = RunStats.of_run(watch.watcher.machine, watch.watcher.ledger.mirror)
    assert stats.steps == trainer.global_step == 30
    assert scales.skipped >= 3 and stats.skipped == scales.skipped  # the start-up skips, every one counted
    assert stats.scale == float(trainer.precision_plugin.scaler.get_scale())
    alarm = next(d for d in watch.diagnoses if d.is_alarm)
    assert "snapshot failed" in alarm.evidence.get("trajectory_control", "")


def test_the_default_snapshot_budget_is_the_nodes_shared_by_its_processes() -> None:
    from lightning_ampwatch.trajectory.ring import SnapshotRing, default_budget_bytes

    assert SnapshotRing().budget_bytes == default_budget_bytes()
    assert SnapshotRing(processes_per_node=8).budget_bytes == default_budget_bytes() // 8
    assert SnapshotRing(2**20, processes_per_node=8).budget_bytes == 2**20  # a budget given is the process's
