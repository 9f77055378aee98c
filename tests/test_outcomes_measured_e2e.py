"""Outcomes measured against what the run should have done, on small models of our own (real float16 autocast and a
real GradScaler on the CPU): a remedy that plainly worked is "recovered" although no healthy level existed before
the episode, because the run after it tracks FP32 training from the same state (within a stated tolerance), or, for
a stall, trains down decisively; a remedy the run does not track stays unproven."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding, Thresholds


class SummedRegression(pl.LightningModule):
    """Large targets and a summed squared error: the scaled gradients overflow float16 from the first step, the
    scaler skips its way down, and nothing is wrong with the model (FP32 trains it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.body(x), y, reduction="sum")

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def summed_data(n: int = 48 * 32) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=g)
    y = 40.0 * torch.sin(x[:, :3] * 1.5) + 0.05 * torch.randn(n, 3, generator=g)
    return TensorDataset(x, y)


class ClipsScaledGrads(pl.LightningModule):
    """Manual optimization that clips the gradients while they are still multiplied by the loss scale: the clip
    acts as 1/65536 of its limit, and the classifier hardly learns."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layers = nn.Sequential(nn.Linear(24, 96), nn.SiLU(), nn.Linear(96, 96), nn.SiLU(), nn.Linear(96, 6))

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.layers(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = self.loss_of(*batch)
        opt.zero_grad()
        self.manual_backward(loss)
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)
        opt.step()
        return loss.detach()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def class_data(n: int = 60 * 32) -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, 24, generator=g)
    y = (x[:, :6] * 2.0 + x[:, 6:12]).argmax(1)
    return TensorDataset(x, y)


def _fit(tmp_path: Path, module: pl.LightningModule, data: TensorDataset, watch: AmpWatch, steps: int) -> None:
    trainer = make_trainer(tmp_path, [watch], "fp16", max_steps=steps)
    trainer.fit(module, DataLoader(data, batch_size=32))


def test_start_up_overflow_fixed_by_a_lower_scale_is_verified_against_fp32_from_the_same_state(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate=True, log_dir=str(tmp_path / "log"))
    _fit(tmp_path, SummedRegression(), summed_data(), watch, steps=40)
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert [d.finding for d in alarms] == [Finding.GRADIENT_OVERFLOW]
    d = alarms[0]
    assert d.remedy == "lower_init_scale"
    reason = d.evidence["recovery"]["reason"]
    # no healthy level existed before the episode (it began at step 0): the run is judged by how it tracks FP32
    assert d.outcome == "recovered", reason
    assert "tracks FP32 training from the same state" in reason and "within the 10% allowed" in reason, reason
    assert d.evidence["recovery"]["track_tolerance"] == 0.1
    assert "0 skipped" in reason
    out = capsys.readouterr().out
    assert "fixed with lower_init_scale, recovery verified" in out
    assert "recovery not verified" not in out


def test_the_users_tolerance_is_the_one_the_outcome_is_judged_by(tmp_path: Path) -> None:
    """The tolerance is the user's (Thresholds.track_tolerance): the outcome states it, and the verdict follows the
    step-by-step ratio against it. (The remedied run and FP32 now start from the same state and train on the same
    batches, so a float16 run at a safe scale tracks FP32 to its rounding: it once compared against an FP32 replay
    that had also trained on the skipped start-up steps, and a 1e-6 tolerance then read "not recovered".)"""
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate=True, verbose=False, thresholds=Thresholds(track_tolerance=1e-6))
    _fit(tmp_path, SummedRegression(), summed_data(), watch, steps=40)
    d = next(d for d in watch.diagnoses if d.finding is Finding.GRADIENT_OVERFLOW)
    recovery = d.evidence["recovery"]
    assert recovery["track_tolerance"] == 1e-6 and "0.0001% allowed" in recovery["reason"], recovery
    assert d.outcome == ("recovered" if recovery["loss_ratio"] <= 1 + 1e-6 else "not_recovered"), recovery


def test_clipping_moved_after_unscale_in_manual_optimization_is_verified_by_the_loss_falling(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate=True, log_dir=str(tmp_path / "log"))
    _fit(tmp_path, ClipsScaledGrads(), class_data(), watch, steps=60)
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert [d.finding for d in alarms] == [Finding.CLIP_BEFORE_UNSCALE]
    d = alarms[0]
    assert d.remedy == "unscale_before_clip"
    reason = d.evidence["recovery"]["reason"]
    assert d.outcome == "recovered", reason
    assert "fell decisively" in reason and "20% fall_margin" in reason, reason
    out = capsys.readouterr().out
    assert "fixed with unscale_before_clip, recovery verified" in out


class ClipsScaledGradsOfASummedPenalty(ClipsScaledGrads):
    """ClipsScaledGrads with an activation penalty summed over the batch (as an auxiliary loss often is): its
    scaled gradients overflow float16 at the scaler's first scale, so GradScaler skips its first steps while it
    halves the scale down to one that fits, as it would with the clip in the right place."""

    def loss_of(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.layers[:4](x)  # the hidden features, before the classifier
        return F.cross_entropy(self.layers[4](h), y) + 3.0 * h.float().pow(2).sum()


def test_the_scalers_start_up_search_does_not_fail_a_remedy_that_is_not_about_the_scale(tmp_path: Path) -> None:
    """The clip is moved after unscale_ at step 1, while GradScaler is still halving its first scale (it had not
    stepped once): those skips are the scaler's own search, which any run at that scale makes, not the clip's
    fault coming back. The remedy is verified by the loss falling, and the outcome says which skips it left out
    (it read "not fixed: the scaler still skipped 3 of the 8 steps after it")."""
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate=True, verbose=False, log_dir=str(tmp_path / "log"))
    _fit(tmp_path, ClipsScaledGradsOfASummedPenalty(), class_data(), watch, steps=30)
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    assert d.finding is Finding.CLIP_BEFORE_UNSCALE and d.remedy == "unscale_before_clip"
    recovery = d.evidence["recovery"]
    assert d.outcome == "recovered", recovery["reason"]
    assert recovery["startup_search_steps"] == [1, 2, 3], recovery
    assert "fell decisively" in recovery["reason"] and "skips at steps 1..3 left out" in recovery["reason"], recovery
    # the skips were the scaler settling, as the machine says too: a normal scaling call, no second alarm
    assert [x.finding for x in watch.diagnoses if not x.is_alarm] == [Finding.NORMAL_SCALING]


def test_the_decisive_fall_is_the_remedys_doing_not_the_runs_own(tmp_path: Path) -> None:
    """The premise of judging a stall's fix by a decisive fall: left unremedied, the same run does not fall that far
    over the same steps (the clip holds it at 1/65536 of its limit), and nothing calls it recovered."""
    pl.seed_everything(0, verbose=False)
    seen: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                               *a: Any) -> None:
            seen.append(float(outputs["loss"]))

    watch = AmpWatch(verbose=False)
    trainer = make_trainer(tmp_path, [Losses(), watch], "fp16", max_steps=24)
    trainer.fit(ClipsScaledGrads(), DataLoader(class_data(), batch_size=32))
    d = next(d for d in watch.diagnoses if d.is_alarm)
    assert d.finding is Finding.CLIP_BEFORE_UNSCALE and d.outcome is None
    first, end = seen[1], sorted(seen[-3:])[1]
    assert end > 0.8 * first, (first, end)  # no decisive fall without the remedy


def test_a_fault_that_returns_after_a_resume_takes_the_earlier_recovery_back(tmp_path: Path) -> None:
    """The recovery is in the checkpoint: a resumed fit whose gradients overflow again (targets 30x larger) re-opens
    the recovered record as relapsed, as the same fit would have."""
    pl.seed_everything(0, verbose=False)
    first = AmpWatch(remediate=True, verbose=False)
    trainer = make_trainer(tmp_path, [first], "fp16", max_steps=30)
    trainer.fit(SummedRegression(), DataLoader(summed_data(), batch_size=32))
    [d] = [d for d in first.diagnoses if d.is_alarm]
    assert d.finding is Finding.GRADIENT_OVERFLOW and d.outcome == "recovered"
    ckpt = tmp_path / "after_recovery.ckpt"
    trainer.save_checkpoint(ckpt)

    x, y = summed_data().tensors
    louder = TensorDataset(x, 30.0 * y)  # the same model, now with gradients far past the scale it settled on
    resumed = AmpWatch(remediate=True, verbose=False)
    trainer = make_trainer(tmp_path, [resumed], "fp16", max_steps=60)
    trainer.fit(SummedRegression(), DataLoader(louder, batch_size=32), ckpt_path=str(ckpt))
    old = next(r for r in resumed.diagnoses if r.step == d.step and r.finding is d.finding)
    assert old.outcome == "relapsed", old.evidence.get("recovery")
    recovery = old.evidence["recovery"]
    assert recovery["relapsed_at"] >= 30
    assert "the same fault came back at step" in recovery["reason"]
    assert recovery["recovered_first"] == d.evidence["recovery"]["reason"]


def test_an_alarm_located_at_a_parameter_names_its_module_in_the_fixes_tried(tmp_path: Path) -> None:
    """The alarm is titled with a parameter (``body.4.weight``) of a gradient overflow: the panel's "fixes tried"
    names the owning module and why the scale, not an island, is what reaches it: never "not located in a module"."""
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, SummedRegression(), summed_data(), watch, steps=20)
    [d] = [d for d in watch.diagnoses if d.is_alarm]
    assert d.location == "body.4.weight"
    tried = str(d.evidence["tried"])
    assert "not located in a module" not in tried, tried
    assert "fp32 island: not tried (the fault is in the gradients of body.4.weight, not in a forward output of " \
           "body.4: a lower loss scale is what reaches it)" in tried, tried


def test_a_parameter_maps_to_the_module_that_owns_it() -> None:
    from lightning_ampwatch.trajectory.judge import owning_module

    model = SummedRegression()
    assert owning_module(model, "body.4.weight") == "body.4"
    assert owning_module(model, "body.4") == "body.4"
    assert owning_module(model, "body.4.nothing") is None
    assert owning_module(model, "s5_manual_clip.py:24") is None and owning_module(model, None) is None
    assert owning_module(model, "") is None  # the model itself is no island


def test_tracking_judges_a_lag_by_whether_the_reference_saw_the_same_batches() -> None:
    from lightning_ampwatch.verdicts import judge_tracking

    ref = {s: 2.0 - 0.05 * s for s in range(10, 18)}
    lagging = [(s, 1.3 * v) for s, v in ref.items()]
    kw = dict(steps=8, skipped=0, track_from="the reference", tolerance=0.1)
    same = judge_tracking(lagging, ref, **kw)  # type: ignore[arg-type]
    assert same.outcome.value == "not_recovered" and "more than the 10% allowed" in same.reason
    other = judge_tracking(lagging, ref, same_batches=False, **kw)  # type: ignore[arg-type]
    assert other.outcome.value == "not_verified" and "on other batches" in other.reason
    far = judge_tracking([(s, 2.5 * v) for s, v in ref.items()], ref, same_batches=False, **kw)  # type: ignore[arg-type]
    assert far.outcome.value == "not_recovered"
    close = judge_tracking([(s, 1.02 * v) for s, v in ref.items()], ref, **kw)  # type: ignore[arg-type]
    assert close.outcome.value == "recovered" and "trains down" in close.reason and "within the 10% allowed" in close.reason
