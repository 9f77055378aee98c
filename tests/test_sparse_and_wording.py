"""Sparse gradients (``nn.Embedding(sparse=True)``) through the replay, the live probe and the trajectory control,
with real float16 and a real GradScaler; and the forward-fault and divergence wording, which names the run's
precision and says no more than the probes measured."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.probes import LiveProbe, MicroBatch, Replayer, stored_values
from lightning_ampwatch.scenarios import regression_data, true_fp16_plugin
from lightning_ampwatch.taxonomy import Diagnosis, advise


class _Indexed(Dataset):
    """The regression rows, each with an embedding index."""

    def __init__(self, y_scale: float = 1.0) -> None:
        self.rows = regression_data(y_scale=y_scale)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        x, y = self.rows[i]
        return x, y, torch.tensor(i % 50)


class _SparseEmbedding(pl.LightningModule):
    """An ``nn.Embedding(sparse=True)`` added to the features, a dense MLP head, plain SGD (which takes sparse
    gradients). A summed loss on large targets: the scaled gradients overflow float16 from the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, sparse=True)
        self.base = nn.Linear(16, 32)
        self.head = nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y, idx = batch
        h = torch.relu(self.base(x + self.emb(idx)))
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y, reduction="sum")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def test_a_model_with_sparse_gradients_is_replayed_and_its_overflow_located(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=True)  # remediation: the trajectory control runs too
    trainer = pl.Trainer(accelerator="cpu", max_steps=12, plugins=[true_fp16_plugin()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[watch])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_SparseEmbedding(), DataLoader(_Indexed(y_scale=4.0), batch_size=32))
    internal = [str(w.message) for w in caught if "internal error" in str(w.message)]
    assert not internal, internal
    alarm = next(d for d in watch.diagnoses if d.is_alarm)
    assert alarm.finding is Finding.GRADIENT_OVERFLOW
    assert alarm.evidence.get("replay_grads_finite") is False  # the replay measured the gradients, sparse ones too
    assert alarm.location is not None


class _TwoPaths(nn.Module):
    """A sparse embedding whose gradient passes through float16 (so it overflows at a large scale) and a dense
    float32 head whose gradient does not."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, idx = batch
        through_half = self.emb(idx).half().float()  # backward casts the gradient to float16
        return through_half.sum() + self.head(x).sum()


def _two_paths_batch() -> tuple[Tensor, Tensor]:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 3, 3, 5])


def test_the_replay_names_the_sparse_parameter_whose_gradient_overflowed() -> None:
    torch.manual_seed(0)
    model = _TwoPaths()
    replayer = Replayer(model, lambda: torch.autocast("cpu", dtype=torch.float16), torch.device("cpu"))
    result = replayer.run([MicroBatch(_two_paths_batch(), 0)], use_autocast=False, grad_scale=2.0 ** 16,
                          probe=True)
    assert result.error is None
    assert result.grads_finite is False and result.first_nonfinite_param == "emb.weight"
    assert result.unscaled_grads_finite is True  # at scale 1 the same graph's gradients are finite
    assert result.grad_absmax is not None and 1.0 <= result.grad_absmax < 100.0  # index 3 twice: 2.0, coalesced


def test_a_live_probe_reads_a_sparse_gradient_at_the_optimizer_step() -> None:
    torch.manual_seed(0)
    model = _TwoPaths()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = LiveProbe(model)
    (model.training_step(_two_paths_batch(), 0) * 2.0 ** 16).backward()
    assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
    probe.optimizer_step(optimizer)
    _, first_param, _ = probe.finish()
    assert first_param == "emb.weight"


def test_a_sparse_gradient_is_read_coalesced() -> None:
    """An index a batch repeats is one value, the sum: two finite float16 halves of 40000 make an overflow."""
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 0]]), torch.tensor([[40000.0], [40000.0]]),
                                   (2, 1), check_invariants=True).half()
    assert not grad.is_coalesced()
    assert not bool(torch.isfinite(stored_values(grad)).all())
    dense = torch.tensor([[1.0], [-3.0]])
    assert stored_values(dense) is not None and torch.equal(stored_values(dense), dense)


class _RoundsToZero(pl.LightningModule):
    """-log(1 - sigmoid(z)) with z around 9: finite in float32 (about 9), but 1 - sigmoid(z) rounds to 0 in float16
    and in bfloat16, and the log goes to inf. No value comes anywhere near float16's range limit."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.enc(x)).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        z = self(x) * 2.0 + 9.0
        return -torch.log(1 - torch.sigmoid(z)).mean() * 0.01 + nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _Diverges(_RoundsToZero):
    """A plain regression with a learning rate far too high: the loss climbs, then goes non-finite."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=5.0)


def _first_alarm(model: pl.LightningModule, root: Path, steps: int, **precision: Any) -> Diagnosis:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root),
                         callbacks=[watch], **precision)
    trainer.fit(model, DataLoader(regression_data(), batch_size=32))
    return next(d for d in watch.diagnoses if d.is_alarm)


def test_a_float16_rounding_fault_is_not_called_an_overflow_and_bf16_is_not_promised_to_fix_it(
        tmp_path: Path) -> None:
    alarm = _first_alarm(_RoundsToZero(), tmp_path, 4, plugins=[true_fp16_plugin()])
    assert alarm.finding is Finding.FORWARD_OVERFLOW and alarm.evidence["precision"] == "fp16"
    assert max(65504.0 / 2.0 ** h for h in alarm.evidence["fp16_headroom_log2"].values()) < 100  # far from 65504
    assert "went non-finite under float16 autocast" in alarm.summary
    assert "went past what float16 can hold" not in alarm.headline()
    assert "No float16 module output came near float16's limit" in alarm.advice
    assert "lifts float16's range limit but not the rounding" in alarm.advice
    assert "removes this overflow class" not in alarm.advice


def test_a_bf16_fault_is_told_in_bfloat16_terms(tmp_path: Path) -> None:
    alarm = _first_alarm(_RoundsToZero(), tmp_path, 2, precision="bf16-mixed")
    assert alarm.finding is Finding.FORWARD_OVERFLOW and alarm.evidence["precision"] == "bf16"
    assert "under bfloat16" in alarm.summary and "float16 can hold" not in alarm.summary
    assert "not an overflow" in alarm.summary
    assert alarm.advice.startswith("bfloat16 has float32's range")


def test_a_divergence_at_full_precision_does_not_blame_reduced_precision(tmp_path: Path) -> None:
    alarm = _first_alarm(_Diverges(), tmp_path, 12, precision="32-true")
    assert alarm.finding is Finding.FP32_UNSTABLE and alarm.evidence["precision"] == "fp32"
    assert "reduced precision" not in alarm.advice and "AMP" not in alarm.summary
    assert "in a run at full precision" in alarm.advice


def test_the_wording_follows_the_evidence_when_read_back() -> None:
    """The event log has no typed facts: the meaning line is rebuilt from the evidence it holds."""
    near = {"precision": "fp16", "fp16_headroom_log2": {"attention.q": 0.5}}
    diagnosis = Diagnosis(Finding.FORWARD_OVERFLOW, 3, location="attention", evidence=near,
                          advice=advise(Finding.FORWARD_OVERFLOW, near))
    again = Diagnosis.from_dict(diagnosis.to_dict())
    assert again.summary == diagnosis.summary and "most likely past what float16 can hold" in again.summary
    assert "rounds more coarsely than float16" in diagnosis.advice
    half = Diagnosis(Finding.FORWARD_OVERFLOW, 3, evidence={"precision": "half"})
    assert "in float16 (16-true)" in half.summary
    assert "torch.autocast" not in advise(Finding.FORWARD_OVERFLOW, {"precision": "half"})
