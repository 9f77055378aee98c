"""Remedies applied mid-run by a real Trainer on real faults (true float16 autocast, a real GradScaler, CPU)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, AmpWatchError, Finding
from lightning_ampwatch.remedies import ISLAND_ATTR
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, regression_data, true_fp16_plugin


def _fit(root: Path, model: pl.LightningModule, data: Any, watch: AmpWatch, max_steps: int,
         scaler: dict[str, Any] | None = None, batch_size: int = 32, callbacks: list[Any] = (),
         **trainer_kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=max_steps, plugins=[true_fp16_plugin(**(scaler or {}))], logger=False,
        enable_checkpointing=bool(trainer_kwargs.pop("enable_checkpointing", False)), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), callbacks=[watch, *callbacks], **trainer_kwargs,
    )
    trainer.fit(model, DataLoader(data, batch_size=batch_size))
    return trainer


def _scenario(name: str, root: Path, watch: AmpWatch, steps: int | None = None) -> tuple[pl.LightningModule, Any]:
    pl.seed_everything(0, verbose=False)
    scenario = SCENARIOS[name]
    model = scenario.model()
    trainer = _fit(root, model, scenario.data(), watch, steps or scenario.max_steps * 2,
                   scaler=scenario.scaler, batch_size=scenario.batch_size)
    return model, trainer


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _alarms(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.is_alarm]


class LossRecorder(Callback):
    """The loss of every optimizer step, read after the fact (a test may synchronise)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def test_fp32_island_fixes_a_forward_overflow_and_the_run_trains_on(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True)
    model, _ = _scenario("forward_overflow", tmp_path, watch)
    [d] = _alarms(watch)
    assert (d.finding, d.location, d.remedy) == (Finding.FORWARD_OVERFLOW, "attention", "fp32_island")
    assert d.evidence["remedy_details"] == {"module": "attention"}
    assert getattr(model.attention, ISLAND_ATTR, None) is not None
    assert watch.machine.skipped_total == 1  # only the step that overflowed; 15 clean steps after the island
    assert _finite(model)


def test_bf16_fallback_switches_the_run_and_drops_the_scaler(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True)
    model, trainer = _scenario("input_range", tmp_path, watch)
    [d] = _alarms(watch)
    assert (d.finding, d.remedy) == (Finding.INPUT_RANGE, "bf16_fallback")
    assert d.evidence["remedy_details"] == {"precision_before": "16-mixed", "precision_after": "bf16-mixed"}
    assert trainer.precision_plugin.precision == "bf16-mixed" and trainer.precision_plugin.scaler is None
    assert watch.precision.mode.value == "bf16"
    assert _finite(model)


def test_slow_growth_stops_the_growth_overflow(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=["slow_growth"])
    model, trainer = _scenario("growth_overflow", tmp_path, watch, steps=120)
    [d] = _alarms(watch)
    assert (d.finding, d.remedy) == (Finding.GROWTH_OVERFLOW, "slow_growth")
    scaler = trainer.precision_plugin.scaler
    assert scaler.get_growth_interval() == 100 and scaler.get_growth_factor() == 1.5
    assert d.evidence["remedy_details"]["growth_interval_before"] == 3
    # without the remedy the same run keeps skipping after every growth
    plain = AmpWatch(verbose=False)
    _scenario("growth_overflow", tmp_path / "plain", plain, steps=120)
    assert watch.machine.skipped_total < plain.machine.skipped_total
    assert _finite(model)
    # every overflow was a skipped step and the steps between trained: nothing is thrown away (a rollback to before
    # the first growth once discarded 36 steps of healthy training)
    assert d.evidence["rollback"].startswith("none: each overflow came right after a growth of the scale"), \
        d.evidence["rollback"]


def test_lower_init_scale_skips_fewer_steps_than_the_same_run_without_it(tmp_path: Path) -> None:
    def run(remediate: Any, root: Path) -> AmpWatch:
        pl.seed_everything(0, verbose=False)
        watch = AmpWatch(verbose=False, remediate=remediate)
        _fit(root, Regressor(lr=1e-4, reduction="sum"), regression_data(y_scale=4.0), watch, 60,
             scaler={"growth_interval": 5})
        return watch

    fixed, plain = run(["lower_init_scale"], tmp_path / "a"), run(False, tmp_path / "b")
    d = _alarms(fixed)[0]
    assert (d.finding, d.remedy) == (Finding.GRADIENT_OVERFLOW, "lower_init_scale")
    details = d.evidence["remedy_details"]
    assert details["scale_after"] == d.evidence["safe_scale"] and details["growth_interval_after"] == 20
    assert fixed.machine.skipped_total < plain.machine.skipped_total


def test_reduce_lr_is_opt_in_and_brings_the_lr_back_before_the_rise(tmp_path: Path) -> None:
    default = AmpWatch(verbose=False, remediate=True)
    _scenario("lr_schedule", tmp_path / "default", default)
    assert _alarms(default)[0].finding is Finding.LR_SCHEDULE and _alarms(default)[0].remedy is None

    watch = AmpWatch(verbose=False, remediate=["reduce_lr"])
    model, trainer = _scenario("lr_schedule", tmp_path / "opt_in", watch)
    [d] = _alarms(watch)
    assert (d.finding, d.remedy) == (Finding.LR_SCHEDULE, "reduce_lr")
    # the rollback went to before the rise (the snapshot after step 20), whose LR is the one to go back to: nothing
    # is scaled, the LR is held at or under it from then on, whatever the schedule computes after its 40x step
    details = d.evidence["remedy_details"]
    assert details["factor"] == 1.0 and details["ceiling"] == [pytest.approx(0.02)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.02)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.base_lrs == [pytest.approx(0.02)] and scheduler.last_epoch > 30  # past its step, held
    assert _finite(model)
    assert watch.machine.skipped_total < default.machine.skipped_total


def _shifted_targets(factor: float) -> TensorDataset:
    """Targets that grow ``factor`` times larger from row 256: the gradients outgrow the lowered scale."""
    x, y = regression_data(y_scale=4.0).tensors
    y = y.clone()
    y[256:] *= factor
    return TensorDataset(x, y)


def test_a_gradient_overflow_that_returns_escalates_to_bf16(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=True)
    model = Regressor(lr=1e-5, reduction="sum", optimizer="adam")
    trainer = _fit(tmp_path, model, _shifted_targets(20.0), watch, 16)
    first, second = _alarms(watch)
    assert (first.finding, first.remedy) == (Finding.GRADIENT_OVERFLOW, "lower_init_scale")
    assert (second.finding, second.remedy) == (Finding.GRADIENT_OVERFLOW, "bf16_fallback")
    assert second.step > first.step
    assert [r.name for r in watch.applied] == ["lower_init_scale", "bf16_fallback"]
    assert trainer.precision_plugin.precision == "bf16-mixed"
    assert _finite(model)


def test_an_exhausted_ladder_is_unrecoverable_and_raise_carries_the_diagnosis(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["lower_init_scale"], on_unrecoverable="raise")
    with pytest.raises(AmpWatchError) as info:
        _fit(tmp_path, Regressor(lr=1e-5, reduction="sum", optimizer="adam"), _shifted_targets(20.0), watch, 16)
    assert info.value.diagnosis.finding is Finding.GRADIENT_OVERFLOW
    assert info.value.diagnosis.remedy is None
    assert [r.name for r in watch.applied] == ["lower_init_scale"]  # the first episode was fixed


def test_not_amp_findings_are_never_fixed_and_stop_ends_the_run_cleanly(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True, on_unrecoverable="stop")
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer = _fit(tmp_path, Regressor(), regression_data(nan_rows=(200,)), watch, 40, callbacks=[ckpt],
                   enable_checkpointing=True)
    [d] = _alarms(watch)
    assert d.finding is Finding.DATA_NONFINITE and d.remedy is None
    assert watch.applied == []
    assert trainer.global_step < 40  # stopped at the fault, not at max_steps
    assert (tmp_path / "ckpt" / "last.ckpt").exists()


def test_warn_keeps_going(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True)  # on_unrecoverable="warn" by default
    pl.seed_everything(0, verbose=False)
    trainer = _fit(tmp_path, Regressor(), regression_data(nan_rows=(200,)), watch, 24)
    assert trainer.global_step == 24 and _alarms(watch)[0].finding is Finding.DATA_NONFINITE


class _ManualClip(pl.LightningModule):
    """Manual optimization that clips with Lightning's own ``clip_gradients`` before ``opt.step()``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        opt.step()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning has unscaled by now: the norm the optimizer will really use
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_unscale_before_clip_makes_lightning_manual_clipping_clip_real_gradients(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["unscale_before_clip"])
    model = _ManualClip()
    _fit(tmp_path, model, regression_data(), watch, 6)
    [d] = _alarms(watch)
    assert (d.finding, d.remedy) == (Finding.CLIP_BEFORE_UNSCALE, "unscale_before_clip")
    # step 0 clipped still-scaled gradients to 0.01, i.e. to 0.01 / 65536 in real units; from step 1 on the
    # limit follows the scale, so the optimizer sees gradients clipped to 0.01 exactly
    assert model.norms[0] < 1e-5
    assert all(n == pytest.approx(0.01, rel=1e-3) for n in model.norms[1:])


def test_hold_lr_on_skip_keeps_the_lr_curve_of_the_steps_that_were_taken(tmp_path: Path) -> None:
    class RecordLr(Callback):
        """The LR after each batch, and how many optimizer steps really ran so far (a step post-hook)."""

        def __init__(self) -> None:
            self.lrs: list[float] = []
            self.taken: list[int] = []
            self._count = 0

        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            trainer.optimizers[0].register_step_post_hook(self._taken)

        def _taken(self, *args: Any) -> None:
            self._count += 1

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
            self.taken.append(self._count)

    def run(hold: bool) -> RecordLr:
        pl.seed_everything(0, verbose=False)
        watch, record = AmpWatch(verbose=False, hold_lr_on_skip=hold), RecordLr()
        model = Regressor(lr=1e-4, reduction="sum", lr_lambda=lambda step: 1.0 + step)
        _fit(tmp_path / str(hold), model, regression_data(y_scale=4.0), watch, 12, callbacks=[record])
        return record

    held = run(True)
    assert held.taken[4] == 0 and held.taken[-1] < 12  # the scaler skipped the first steps (and some later)
    # the schedule advanced once per step that ran: the LR curve of a run whose skipped steps never happened
    assert held.lrs == [pytest.approx(1e-4 * (1 + taken)) for taken in held.taken]
    plain = run(False)
    assert plain.lrs == [pytest.approx(1e-4 * (1 + k)) for k in range(1, 13)]


def test_hold_lr_on_skip_silences_torchs_scheduler_order_warning(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, hold_lr_on_skip=True)
    with _no_warning("lr_scheduler.step()"):
        _fit(tmp_path, Regressor(lr=1e-4, reduction="sum", lr_lambda=lambda step: 1.0), regression_data(y_scale=4.0),
             watch, 8)


class _no_warning:
    """Fail if a warning containing ``text`` is raised inside the block."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __enter__(self) -> None:
        import warnings

        self._catcher = warnings.catch_warnings(record=True)
        self._seen = self._catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: Any) -> None:
        self._catcher.__exit__(*exc)
        offending = [str(w.message) for w in self._seen if self.text in str(w.message)]
        assert not offending, offending


class PrecisionAtStart(Callback):
    """What the run looks like at the first step after a resume."""

    def __init__(self) -> None:
        self.first: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.first is None:
            attention = getattr(pl_module, "attention", None)
            self.first = {
                "precision": trainer.precision_plugin.precision,
                "island": attention is not None and getattr(attention, ISLAND_ATTR, None) is not None,
                "step": trainer.global_step,
            }


@pytest.mark.parametrize("name,remedy,expect", [
    ("forward_overflow", "fp32_island", {"precision": "16-mixed", "island": True}),
    ("input_range", "bf16_fallback", {"precision": "bf16-mixed", "island": False}),
])
def test_resume_after_a_remedy_puts_it_back_before_the_first_step(tmp_path: Path, name: str, remedy: str,
                                                                  expect: dict[str, Any]) -> None:
    scenario = SCENARIOS[name]
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=True)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=4)
    _fit(tmp_path, scenario.model(), scenario.data(), watch, 8, callbacks=[ckpt], enable_checkpointing=True)
    assert [r.name for r in watch.applied] == [remedy]

    resumed, probe = AmpWatch(verbose=False, remediate=True), PrecisionAtStart()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=16, plugins=[true_fp16_plugin()], logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[resumed, probe],
    )
    model = scenario.model()
    trainer.fit(model, DataLoader(scenario.data(), batch_size=scenario.batch_size),
                ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert probe.first == {**expect, "step": 8}
    assert [r.name for r in resumed.applied] == [remedy]
    assert [d.remedy for d in resumed.diagnoses if d.is_alarm] == [remedy]  # the old one, not announced again
    assert len(_alarms(resumed)) == 1
    assert _finite(model)


@pytest.mark.parametrize("name,remedy,precision,expect", [
    ("input_range", "bf16_fallback", "32-true", {"precision": "32-true", "island": False}),
    ("input_range", "bf16_fallback", "bf16-true", {"precision": "bf16-true", "island": False}),
    ("forward_overflow", "fp32_island", "16-true", {"precision": "16-true", "island": False}),
    ("forward_overflow", "fp32_island", "32-true", {"precision": "32-true", "island": False}),
    ("gradient_overflow", "lower_init_scale", "bf16-mixed", {"precision": "bf16-mixed", "island": False}),
    ("forward_overflow", "fp32_island", "bf16-mixed", {"precision": "bf16-mixed", "island": True}),
    ("input_range", "bf16_fallback", "bf16-mixed", {"precision": "bf16-mixed", "island": False}),
])
def test_resume_at_another_precision_keeps_it_and_says_which_remedy_was_not_put_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, remedy: str, precision: str,
        expect: dict[str, Any]) -> None:
    """A run resumed at a precision it was not checkpointed at is the user's choice: a bf16_fallback does not switch
    a 32-true or bf16-true run to bf16-mixed, an FP32 island is not attached where nothing autocasts (in a 16-true
    run it cast the inputs to float32 against float16 weights, and the run crashed), a scaler's remedy has no scaler
    to act on; one line says which remedies were not put back, and why. Under mixed precision the island is put back,
    and a bf16 run needs no switch: nothing is said."""
    scenario = SCENARIOS[name]
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=True)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=4)
    _fit(tmp_path, scenario.model(), scenario.data(), watch, 8, scaler=scenario.scaler,
         batch_size=scenario.batch_size, callbacks=[ckpt], enable_checkpointing=True)
    assert [r.name for r in watch.applied] == [remedy]

    resumed, probe = AmpWatch(verbose=False, remediate=True), PrecisionAtStart()
    trainer = pl.Trainer(accelerator="cpu", max_steps=16, precision=precision, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=[resumed, probe])
    model = scenario.model()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):  # where Lightning's rank-zero lines go
        trainer.fit(model, DataLoader(scenario.data(), batch_size=scenario.batch_size),
                    ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert probe.first == {**expect, "step": 8}
    assert trainer.precision_plugin.precision == precision and trainer.global_step == 16  # trained on, as built
    said = [r.getMessage() for r in caplog.records if "not applied again" in r.getMessage()]
    if expect["island"] or precision == "bf16-mixed" and remedy == "bf16_fallback":
        assert said == []
    else:
        assert said == [f"AmpWatch: the checkpoint's {remedy} was not applied again: the resumed run trains at "
                        f"{precision}, the precision it was built with."]
    assert [r.name for r in resumed.applied] == [remedy]  # the record is kept, as it was


def test_resume_after_unscale_before_clip_keeps_clipping_real_gradients(tmp_path: Path) -> None:
    """The switch lives in the recipe guards, which no checkpoint holds: the resumed fit must put it back."""
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=3)
    watch = AmpWatch(verbose=False, remediate=["unscale_before_clip"])
    _fit(tmp_path, _ManualClip(), regression_data(), watch, 3, callbacks=[ckpt], enable_checkpointing=True)
    assert [r.name for r in watch.applied] == ["unscale_before_clip"]

    resumed, model = AmpWatch(verbose=False, remediate=["unscale_before_clip"]), _ManualClip()
    trainer = pl.Trainer(accelerator="cpu", max_steps=6, plugins=[true_fp16_plugin()], logger=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[resumed])
    trainer.fit(model, DataLoader(regression_data(), batch_size=32), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert len(model.norms) == 3  # steps 3, 4, 5, each clipped to 0.01 in real units from the first one on
    assert all(n == pytest.approx(0.01, rel=1e-3) for n in model.norms)
    assert [r.name for r in resumed.applied] == ["unscale_before_clip"]


class _ManualLrRise(Regressor):
    """The lr_schedule scenario's model, stepping its optimizer and scheduler itself (manual optimization)."""

    def __init__(self) -> None:
        from lightning_ampwatch.scenarios import StepSchedule

        super().__init__(lr=0.02, lr_lambda=StepSchedule(30, 40.0))
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.lr_schedulers().step()
        return loss


def test_under_manual_optimization_the_rollback_says_why_no_snapshot_is_kept(tmp_path: Path) -> None:
    """The user never turned snapshots off: the rollback evidence gives the reason none is kept (manual
    optimization), not "snapshots are off"."""
    from lightning_ampwatch.scenarios import build_trainer

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate="all", verbose=False)
    scenario = SCENARIOS["lr_schedule"]
    build_trainer(scenario, [watch], str(tmp_path), max_steps=60).fit(_ManualLrRise(), scenario.dataloader())
    alarm = next(d for d in watch.diagnoses if d.finding is Finding.LR_SCHEDULE)
    rollback = alarm.evidence["rollback"]
    assert rollback.startswith("none: no snapshot is kept (the trajectory control is not available under manual "
                               "optimization"), rollback
    assert "snapshots are off" not in rollback
