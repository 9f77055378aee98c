"""'Healthy' must mean healthy: verdicts and recovery measured against a reference known to be healthy, or none.

Real fits on the CPU, true float16 autocast with a real GradScaler (or plain float32), on small models of our own
whose trouble comes from the real mechanism: a learning rate far too high for AdamW on a char-level GPT, a too-high
head LR on a frozen backbone, a finite blow-up with no skip and no NaN, a few hard batches, a real float16 overflow.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from _healthy_models import FrozenBackbone, TinyGPT, char_data, features_data
from conftest import make_trainer
from test_trajectory import ExpSoftmax, separable
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, regression_data
from lightning_ampwatch.summary import RunStats, summary_lines

AMP_FINDINGS = {Finding.FORWARD_OVERFLOW, Finding.GRADIENT_OVERFLOW, Finding.GROWTH_OVERFLOW, Finding.INPUT_RANGE}


class Losses(pl.Callback):
    """Every step's loss as the run reported it."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.seen.append(float(outputs["loss"]))

    @property
    def final(self) -> float:
        finite = [v for v in self.seen[-10:] if v == v and abs(v) != float("inf")]
        return statistics.median(finite) if finite else float("inf")


def _fit(tmp_path: Path, model: Callable[[], pl.LightningModule], data: Any, watch: AmpWatch | None,
         precision: str = "fp16", max_steps: int = 40, seed: int = 0, scaler: dict[str, Any] | None = None,
         **kw: Any) -> Losses:
    pl.seed_everything(seed, verbose=False)
    module, losses = model(), Losses()
    trainer = make_trainer(tmp_path, [losses, *([watch] if watch else [])], precision, scaler,
                           max_steps=max_steps, **kw)
    trainer.fit(module, DataLoader(data, batch_size=32, shuffle=True))
    return losses


def _alarms(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.is_alarm]


def _summary(watch: AmpWatch) -> str:
    machine = watch.machine
    assert machine is not None
    return "\n".join(summary_lines(watch.diagnoses, RunStats(steps=machine.steps_seen, skipped=machine.skipped_total,
                                                             nonfinite=machine.nonfinite_total)))


# ----------------------------------------------------------------------------- a far too high LR, from step 1


@pytest.mark.parametrize("seed", [0, 1])
def test_adamw_far_too_high_on_a_small_lm_is_fp32_unstable_with_no_healthy_level(tmp_path: Path, seed: int) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, lambda: TinyGPT(lr=1.0), char_data(), watch, seed=seed)
    alarms = _alarms(watch)
    assert alarms and alarms[0].finding is Finding.FP32_UNSTABLE
    assert not any(d.finding in AMP_FINDINGS for d in alarms)
    ev = alarms[0].evidence
    assert ev["loss_reference"] is None and "no healthy" in ev["loss_reference_why"]
    # the FP32 trajectory from the state before the first step climbs far above where it started ...
    fp32 = ev["trajectory_fp32_losses"]
    assert ev["trajectory_snapshot_step"] == -1 and max(fp32) > 4 * fp32[0]
    assert ev["trajectory_verdict"] == "fp32_diverges"
    # ... and the same steps at the run's precision with the LR ten times lower train clean and fall
    assert ev["lower_lr_factor"] == pytest.approx(0.1)
    lower = ev["lower_lr_losses"]
    assert all(isinstance(v, float) for v in lower) and sum(ev["lower_lr_skipped"]) <= 1  # one probe of the scale
    assert statistics.median(lower[-3:]) < lower[0]
    assert ev["lower_lr_verdict"] == "lr_is_the_cause"
    assert "Lower the learning rate" in alarms[0].advice


def test_remediate_true_never_calls_a_too_high_lr_recovered(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True)
    _fit(tmp_path, lambda: TinyGPT(lr=1.0), char_data(), watch, max_steps=60)
    assert all(d.outcome != "recovered" for d in watch.diagnoses)
    assert not any(d.finding in AMP_FINDINGS for d in _alarms(watch))
    assert not any(d.remedy in ("bf16_fallback", "fp32_island", "lower_init_scale") for d in watch.diagnoses)
    assert "recovery verified" not in _summary(watch)


def test_remediate_all_rolls_back_lowers_the_lr_and_ends_near_a_healthy_run(tmp_path: Path) -> None:
    healthy = _fit(tmp_path / "healthy", lambda: TinyGPT(lr=3e-3), char_data(), None, max_steps=80)
    watch = AmpWatch(verbose=False, remediate="all")
    treated = _fit(tmp_path / "treated", lambda: TinyGPT(lr=1.0), char_data(), watch, max_steps=80)
    remedied = [d for d in watch.diagnoses if d.remedy]
    assert remedied and remedied[0].finding is Finding.FP32_UNSTABLE and remedied[0].remedy == "reduce_lr"
    assert remedied[0].evidence["rollback"].startswith("rolled back")
    assert treated.final < 2 * healthy.final


def test_onset_does_not_depend_on_whether_remedies_are_allowed(tmp_path: Path) -> None:
    onsets = []
    for i, remediate in enumerate((False, "all")):
        watch = AmpWatch(verbose=False, remediate=remediate)
        _fit(tmp_path / str(i), lambda: TinyGPT(lr=1.0), char_data(), watch, max_steps=30)
        onsets.append(_alarms(watch)[0].step)
    assert onsets[0] == onsets[1]


def test_a_renamed_finding_keeps_no_amp_evidence(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, lambda: TinyGPT(lr=1.0), char_data(), watch)
    ev = _alarms(watch)[0].evidence
    for key in ("pattern", "safe_scale", "batch_control_verdict", "first_nonfinite_step"):
        if key in ev:
            assert key == "pattern" and ev[key] != "persistent"
    assert all(not v.endswith(": an AMP fault") for v in ev.values() if isinstance(v, str))


# ----------------------------------------------------------------------------- a frozen backbone


def test_a_frozen_backbone_with_a_far_too_high_head_lr_is_not_an_amp_finding(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, lambda: FrozenBackbone(lr=1e4), features_data(), watch)
    alarms = _alarms(watch)
    assert alarms and not any(d.finding in AMP_FINDINGS for d in alarms)
    assert alarms[0].finding is Finding.FP32_UNSTABLE


def test_every_remedy_allowed_a_head_lr_far_too_high_climbs_the_lr_ladder_only(tmp_path: Path) -> None:
    """fp16 overflows come and go while the run diverges: they are that episode, never an AMP fault with an AMP
    remedy; each reduce_lr rung compounds on the one before, though the rollback restores the original LR."""
    watch = AmpWatch(verbose=False, remediate="all")
    _fit(tmp_path, lambda: FrozenBackbone(lr=1e4), features_data(), watch, max_steps=60)
    assert {a.name for a in watch.applied} == {"reduce_lr"}
    assert not any(d.finding in AMP_FINDINGS for d in _alarms(watch))
    assert all(d.outcome != "recovered" for d in watch.diagnoses)
    lrs = [a.details["lr_after"][0] for a in watch.applied]
    assert lrs == pytest.approx([1e3, 1e2])


# ----------------------------------------------------------------------------- finite divergence


@pytest.mark.parametrize("precision", ["fp16", "bf16-mixed", "32-true"])
def test_a_finite_divergence_is_reported_once_and_never_called_healthy(tmp_path: Path, precision: str) -> None:
    watch = AmpWatch(verbose=False)
    losses = _fit(tmp_path, lambda: FrozenBackbone(lr=20.0), features_data(), watch, precision=precision,
                  max_steps=60)
    assert all(v == v and abs(v) != float("inf") for v in losses.seen)  # no NaN, no inf ...
    machine = watch.machine
    assert machine is not None and machine.skipped_total == 0  # ... and no skipped step
    [d] = _alarms(watch)
    assert d.finding is Finding.FP32_UNSTABLE and d.evidence["pattern"] == "finite_divergence"
    assert d.step <= 2
    assert "Lower the learning rate" in d.advice
    assert "Healthy run" not in _summary(watch)


def test_a_few_hard_batches_that_spike_and_come_back_are_not_reported(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    losses = _fit(tmp_path, lambda: FrozenBackbone(lr=0.5, hard_batches=(40, 41, 42)), features_data(), watch,
                  max_steps=60)
    level = statistics.median(losses.seen[24:40])
    assert max(losses.seen[40:43]) > 4 * level  # the spike is real ...
    assert _alarms(watch) == []  # ... and not a divergence
    assert "Healthy run" in _summary(watch)


# ----------------------------------------------------------------------------- a real float16 fault, no level yet


class OffsetExpSoftmax(ExpSoftmax):
    """A hand-written softmax whose scores carry a constant offset of 9 (a bias softmax ignores, exp does not):
    exp(9 + score) summed over 4 classes fits float16 at the first step and passes 65504 once the first update has
    spread the scores. Float32 has room to spare and trains down, whatever the offset."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        e = (self.net(x) + 9.0).exp()
        p = e / e.sum(-1, keepdim=True)
        return -p.gather(1, y[:, None]).float().log().mean()


def test_a_genuine_fp16_forward_overflow_at_step_one_is_still_confirmed(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [watch], "fp16", scaler={"init_scale": 2.0**8}, max_steps=12)
    trainer.fit(OffsetExpSoftmax(), DataLoader(separable(), batch_size=32))
    d = _alarms(watch)[0]
    assert d.finding is Finding.FORWARD_OVERFLOW and d.step <= 2
    assert d.evidence["trajectory_verdict"] == "amp_confirmed"
    assert d.evidence["trajectory_snapshot_step"] == -1


# ----------------------------------------------------------------------------- the LR story


class LateWarmup(FrozenBackbone):
    """A head whose LR warms up linearly (from a thousandth) to a peak far too high, reached at step 40: it fails
    on the way up, some ten steps before the peak."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.head.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.001 + 0.999 * min(s, 40) / 40)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_fault_while_warmup_still_rises_is_not_warmup_end(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, lambda: LateWarmup(lr=20.0), features_data(), watch, max_steps=50)
    d = _alarms(watch)[0]
    assert 20 <= d.step < 40 and d.finding is Finding.LR_SCHEDULE
    assert d.evidence["lr_event"] != "warmup_end"
    assert "warmup reached its peak" not in d.advice
    assert d.evidence["lr_before"] > 10 * 0.001 * 20.0  # the LR just before the rise, not the start of the ramp ...
    assert d.evidence["lr_ramp_start"] == pytest.approx(0.001 * 20.0)  # ... which is its own field


def test_two_reduce_lr_rungs_leave_a_hundredth_of_the_lr(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"])
    pl.seed_everything(0, verbose=False)
    model = FrozenBackbone(lr=2000.0)
    trainer = make_trainer(tmp_path, [watch], "32-true", max_steps=60)
    trainer.fit(model, DataLoader(features_data(), batch_size=32, shuffle=True))
    rungs = [a for a in watch.applied if a.name == "reduce_lr"]
    assert len(rungs) == 2
    assert rungs[0].details["lr_after"] == pytest.approx([200.0])
    assert rungs[1].details["lr_after"] == pytest.approx([20.0])
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(20.0)


def test_a_level_that_took_in_a_climbs_first_losses_gives_way_to_the_one_before(tmp_path: Path) -> None:
    """BackboneFinetuning unfreezes the backbone at step 32 with a learning rate of 2: the loss climbs. The newest
    healthy level had taken in the climb's first losses (still under the alarm's threshold when they came), so it
    reaches past the onset and cannot be the episode's reference; the level before it can. The remedy's recovery is
    then judged against a healthy level (it was "no healthy loss level before the episode" after 32 healthy
    steps)."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    from lightning_ampwatch.scenarios import true_fp16_plugin

    class Backboned(Regressor):
        def __init__(self) -> None:
            super().__init__(lr=0.02)
            self.backbone = self.encoder

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate="all", snapshot_every=10, verbose=False)
    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=2, backbone_initial_lr=2.0, should_align=False,
                                  lambda_func=lambda epoch: 1.0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[true_fp16_plugin()], callbacks=[watch, unfreeze],
                         default_root_dir=str(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                         logger=False, enable_checkpointing=False, max_epochs=3)
    trainer.fit(Backboned(), DataLoader(regression_data(), batch_size=32))
    alarm = next(d for d in watch.diagnoses if d.is_alarm and d.step >= 32)
    recovery = alarm.evidence["recovery"]
    assert recovery["loss_before"] is not None, recovery
    assert "no healthy loss level before the episode" not in recovery["reason"]
