"""Remedies that really recover: rolled back before the onset, verified afterwards, never called a fix when the
run is not healthy again. Real fits: true float16 autocast with a real GradScaler on the CPU."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from test_trajectory import separable
from test_trajectory_e2e import LrJump
from torch import nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.remedies import DEFAULT_REMEDIES
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, regression_data
from lightning_ampwatch.summary import RunStats, summary_lines
from lightning_ampwatch.timeline import read_timeline

WITH_LR = [*DEFAULT_REMEDIES, "reduce_lr"]


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.seen.append(float(outputs["loss"]))

    @property
    def final(self) -> float:
        return statistics.median(self.seen[-10:])


def _fit(tmp_path: Path, model: Callable[[], pl.LightningModule], data: Any, watch: AmpWatch | None,
         precision: str = "fp16", max_steps: int = 80, scaler: dict[str, Any] | None = None,
         callbacks: list[Any] = (), **kw: Any) -> tuple[pl.Trainer, pl.LightningModule, Losses]:
    pl.seed_everything(0, verbose=False)
    module, losses = model(), Losses()
    trainer = make_trainer(tmp_path, [losses, *callbacks, *([watch] if watch else [])], precision, scaler,
                           max_steps=max_steps, **kw)
    trainer.fit(module, DataLoader(data, batch_size=32))
    return trainer, module, losses


def _remedied(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.remedy]


def test_a_too_high_lr_is_rolled_back_and_lowered_and_ends_near_a_healthy_run(tmp_path: Path) -> None:
    *_, healthy = _fit(tmp_path / "healthy", lambda: Regressor(lr=0.05), regression_data(), None)
    watch = AmpWatch(verbose=False, remediate=WITH_LR)
    *_, treated = _fit(tmp_path / "treated", lambda: Regressor(lr=0.5), regression_data(), watch)
    [d] = _remedied(watch)
    assert (d.finding, d.remedy, d.outcome) == (Finding.FP32_UNSTABLE, "reduce_lr", "recovered")
    assert d.evidence["rollback"].startswith("rolled back from step ")
    assert d.evidence["remedy_details"]["factor"] == 0.1
    assert treated.final <= 2 * healthy.final


def test_without_reduce_lr_a_diverging_run_is_never_called_fixed(tmp_path: Path, capsys: Any) -> None:
    watch = AmpWatch(remediate=True)  # every remedy but reduce_lr: no AMP setting may silence a divergence
    _fit(tmp_path, lambda: Regressor(lr=0.5), regression_data(), watch)
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert alarms and all(d.remedy is None for d in alarms)
    assert alarms[0].finding is Finding.FP32_UNSTABLE and "Lower the learning rate" in alarms[0].advice
    out = capsys.readouterr().out
    assert "fixed with" not in out and "not fixed: see the advice above" in out


class Head(nn.Module):
    """A softmax written by hand (exp without subtracting the max): its exp overflows float16 once Adam has grown
    the logits past ~11; float32 has room up to ~88."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.proj(x).exp()
        return e / e.sum(-1, keepdim=True)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.head = Head()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return -self.head(x).gather(1, y[:, None]).float().clamp_min(1e-6).log().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.3)


def test_a_forward_overflow_islanded_after_a_rollback_ends_near_the_fp32_run(tmp_path: Path) -> None:
    *_, fp32 = _fit(tmp_path / "fp32", Classifier, separable(), None, precision="32-true", max_steps=40)
    watch = AmpWatch(verbose=False, remediate=True, snapshot_every=5)
    *_, treated = _fit(tmp_path / "fp16", Classifier, separable(), watch, scaler={"init_scale": 2.0**8},
                       max_steps=40)
    [d] = _remedied(watch)
    assert (d.finding, d.location, d.remedy, d.outcome) == (Finding.FORWARD_OVERFLOW, "head", "fp32_island",
                                                            "recovered")
    assert "the in-memory snapshot taken after step 5" in d.evidence["rollback"]
    assert d.evidence["recovery"]["skipped"] == 0
    assert treated.final <= 1.5 * fp32.final


def test_lower_init_scale_at_the_first_alarm_cuts_a_startup_collapse_short(tmp_path: Path) -> None:
    scenario = SCENARIOS["gradient_overflow"]
    skipped = {}
    for remediate in (False, ["lower_init_scale"]):
        watch = AmpWatch(verbose=False, remediate=remediate)
        pl.seed_everything(0, verbose=False)
        trainer = make_trainer(tmp_path / str(bool(remediate)), [watch], "fp16", {"init_scale": 2.0**24},
                               max_steps=30)
        trainer.fit(scenario.model(), scenario.dataloader())
        skipped[bool(remediate)] = watch.machine.skipped_total  # type: ignore[union-attr]
        if remediate:
            [d] = _remedied(watch)
            assert d.evidence["pattern"] == "startup" and d.evidence["skipped_in_row"] == 4  # acted at once
            details = d.evidence["remedy_details"]
            assert details["scale_after"] == d.evidence["safe_scale"] < details["scale_before"]
            assert d.evidence["skips_saved_estimate"] >= 4
    assert skipped[True] <= skipped[False] - 4


def test_reduce_lr_after_an_lr_jump_goes_back_to_the_lr_before_it_and_recovers(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"])
    trainer, *_ = _fit(tmp_path, LrJump, regression_data(), watch, max_steps=50)
    [d] = _remedied(watch)
    # The rollback went to the fit's start (the snapshot after step 0): one loss before it is not a stretch, so the
    # remedied run is held to what the run first reached on the same steps from the same state. The learning rates
    # are held at or under the LR before the jump, and the steps before the jump re-run at the LR they first ran
    # with, so it gets there (scaling the whole schedule by 0.01 slowed them a hundredfold: not recovered, 2.9x).
    assert (d.finding, d.remedy, d.outcome) == (Finding.LR_SCHEDULE, "reduce_lr", "recovered")
    recovery = d.evidence["recovery"]
    assert recovery["loss_before_from"] == "what the run first reached from the same state, on steps 1..8 before the " \
                                           "episode"
    details = d.evidence["remedy_details"]
    assert details["back_to"] == pytest.approx(3e-2) and details["ceiling"] == pytest.approx([3e-2])
    assert details["factor"] == 1.0  # the rollback brought the LR before the jump back: nothing to scale
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-2)  # held after the jump came again
    # the first step run with the remedy is recorded at the LR it really ran with, not the one before the rollback
    timeline = read_timeline(tmp_path / "ampwatch" / "timeline.jsonl")
    lr_at = dict(zip(timeline.steps, timeline.lrs))
    first = watch.applied[0].step
    assert lr_at[first] == tuple(watch.applied[0].details["lr_after"]) != lr_at[first - 1]


def test_after_an_lr_jump_the_rerun_runs_at_the_first_runs_lr_before_the_jump_and_is_held_there_after_it(
        tmp_path: Path) -> None:
    """What the ceiling changes, read from the timeline: the re-run steps before the jump run at the LR the first
    run had on them (a scaled schedule ran them at a hundredth), and after the jump comes again the LR stays there
    (the schedule alone would go to 3.0)."""
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"])
    trainer, *_ = _fit(tmp_path, LrJump, regression_data(), watch, max_steps=50)
    first = watch.applied[0].step
    timeline = read_timeline(tmp_path / "ampwatch" / "timeline.jsonl")
    first_run = {lr for step, lr in zip(timeline.steps, timeline.lrs) if 1 <= step < 20}
    rerun = [lr for step, lr in zip(timeline.steps, timeline.lrs) if step >= first]
    # the re-run's scheduler went back to step 1 at ``first``: its jump (step 20) is at first + 19; some are after it
    after_jump = [step for step in timeline.steps if step >= first + 19]
    assert first_run == {(3e-2,)} and len(rerun) >= 10 and len(after_jump) >= 3
    assert set(rerun) == first_run, rerun
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch >= 20 and sched.get_last_lr() == [pytest.approx(3e-2)]  # the jump came, and was held
    assert "lr_scheduler_step" not in LrJump.__dict__ and "lr_scheduler_step" not in trainer.lightning_module.__dict__


def test_a_remedy_that_silences_nan_but_leaves_the_loss_high_is_not_recovered_and_escalates(tmp_path: Path) -> None:
    # No snapshot and no rollback: the remedies act on weights the too-high LR has already ruined, and the
    # single-batch control alone cannot tell the divergence apart (the replay of one batch stays finite in FP32).
    watch = AmpWatch(verbose=False, remediate=True, snapshot_every=0, rollback=False)
    _fit(tmp_path, lambda: Regressor(lr=0.5), regression_data(), watch)
    outcomes = [(d.remedy, d.outcome) for d in _remedied(watch)]
    tried = [t for d in _remedied(watch) for t in d.evidence.get("remedies_tried", [])]
    assert ("recovered" not in [o for _, o in outcomes]), outcomes
    assert tried and tried[0]["outcome"] == "not_recovered"  # the first remedy was judged, and escalated
    lines = summary_lines(watch.diagnoses, RunStats(80))
    assert not any("fixed with" in line for line in lines)


def test_rollback_goes_to_a_checkpoint_file_when_snapshots_are_off(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)
    _fit(tmp_path, LrJump, regression_data(), watch, max_steps=50, callbacks=[ckpt], enable_checkpointing=True)
    [d] = _remedied(watch)
    assert d.evidence["rollback"].startswith("rolled back from step ")
    assert "the checkpoint file" in d.evidence["rollback"] and "step=20.ckpt" in d.evidence["rollback"]
    assert d.outcome == "recovered"


def test_resume_after_a_rollback_keeps_the_remedy_and_does_not_announce_it_again(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=10)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"])
    _fit(tmp_path, LrJump, regression_data(), watch, max_steps=40, callbacks=[ckpt], enable_checkpointing=True)
    [before] = _remedied(watch)
    resumed = AmpWatch(verbose=False, remediate=["reduce_lr"])
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [resumed], "fp16", max_steps=60)
    trainer.fit(LrJump(), DataLoader(regression_data(), batch_size=32), ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert [d.to_dict() for d in _remedied(resumed)] == [before.to_dict()]
    assert [a.name for a in resumed.applied] == ["reduce_lr"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(3e-2)  # the lowered LR came back with it


def test_replay_episode_trains_on_the_episodes_batches_again_with_the_remedy(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=5, replay_episode=True)
    trainer, *_ = _fit(tmp_path, LrJump, regression_data(), watch, max_steps=50)
    [d] = _remedied(watch)
    rollback = d.evidence["rollback"]
    assert "were trained on again with the remedy (losses " in rollback and "skipped" not in rollback
    # the snapshot after step 15 (every 5, before the LR change at 20): steps 16.. trained again at the lower LR
    assert "the in-memory snapshot taken after step 15" in rollback
    losses = [float(v) for v in rollback.split("(losses ")[1].rstrip(")").split(", ")]
    assert all(v < 1.0 for v in losses)  # at the LR from before the jump the episode's batches train normally
    assert d.outcome == "recovered"


def test_a_nan_batch_inside_a_remedys_watch_is_not_held_against_the_remedy(tmp_path: Path) -> None:
    """A gradient overflow at start-up gets lower_init_scale; two steps into its watch a batch holding NaN makes
    that step's loss NaN, which no precision setting prevents. The step is left out of the judgement (and said to
    be), so the remedy is not called a failure and the ladder does not climb to bf16_fallback, which would drop the
    scaler and let the next NaN batch reach the weights (it once did)."""
    from lightning_ampwatch.scenarios import build_trainer

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate=True, verbose=False)
    trainer = build_trainer(SCENARIOS["gradient_overflow"], [watch], str(tmp_path), max_steps=40)
    trainer.fit(Regressor(lr=1e-4, reduction="sum"),
                DataLoader(regression_data(y_scale=4.0, nan_rows=(260,)), batch_size=32))
    assert [a.name for a in watch.applied] == ["lower_init_scale"]
    overflow = next(d for d in watch.diagnoses if d.finding is Finding.GRADIENT_OVERFLOW)
    recovery = overflow.evidence["recovery"]
    assert overflow.outcome != "not_recovered" and recovery["data_steps_left_out"] == [8], recovery
    assert "step 8 left out: the batch itself held NaN/inf" in recovery["reason"]
    assert [d.step for d in watch.diagnoses if d.finding is Finding.DATA_NONFINITE][:1] == [8]
    assert all(p.isfinite().all() for p in trainer.lightning_module.parameters())


class Warmup(Regressor):
    """SGD with a linear warmup from a hundredth of ``peak`` to ``peak`` over ``steps`` steps; to 1.5 over 60, in
    float16 the loss climbs from about step 13, once the LR has about doubled from where it stood six steps before
    (a warmup too steep for the model)."""

    def __init__(self, peak: float = 1.5, steps: int = 60) -> None:
        super().__init__()
        self.peak, self.steps = peak, steps

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.peak)
        sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, end_factor=1.0, total_iters=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_reduce_lr_after_a_warmup_rise_holds_the_lr_near_the_one_before_the_rise_not_the_one_restored(
        tmp_path: Path, capsys: Any) -> None:
    """The rollback goes back to the warmup's first steps, far below the LR before the rise: the ceiling is the LR
    before the rise (here at most half the raised LR), the re-run steps run the warmup as they first ran it up to
    there, and the rest of the run trains at the ceiling, not at the LR the rollback restored."""
    watch = AmpWatch(remediate="all")
    trainer, *_ = _fit(tmp_path, Warmup, regression_data(), watch, max_steps=40)
    [d] = _remedied(watch)
    assert (d.finding, d.remedy, d.outcome) == (Finding.LR_SCHEDULE, "reduce_lr", "recovered")
    assert "to step 1 (the in-memory snapshot taken after step 0)" in d.evidence["rollback"]
    before, raised = d.evidence["lr_before"], d.evidence["lr_after"]
    details = d.evidence["remedy_details"]
    ceiling = min(before, raised / 2)
    restored = details["lr_before"][0]  # the warmup's LR at step 1, where the rollback went back to
    assert details["factor"] == 1.0 and details["ceiling"] == [pytest.approx(ceiling)]
    assert details["lr_after"] == [pytest.approx(restored)] and ceiling > 3 * restored
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(ceiling)  # what the rest of the run trains at
    timeline = read_timeline(tmp_path / "ampwatch" / "timeline.jsonl")
    first = watch.applied[0].step
    first_run = [lr[0] for step, lr in zip(timeline.steps, timeline.lrs) if 1 <= step < first]  # from the snapshot
    rerun = [lr[0] for step, lr in zip(timeline.steps, timeline.lrs) if step >= first]
    below = [lr for lr in first_run if lr <= ceiling]
    assert len(below) >= 4 and rerun[:len(below)] == pytest.approx(below)  # the warmup as it first ran, up to there
    assert rerun[len(below):] == pytest.approx([ceiling] * (len(rerun) - len(below)))  # then held there
    assert len(rerun) - len(below) >= 8
    out = re.sub(r"(\s*│\s*)+", " ", capsys.readouterr().out)  # the panel's wrapped lines joined
    assert (f"Applied: reduce_lr: learning rates held at or under {ceiling:g} (at most half the LR the rise reached; "
            f"the LR before it was {before:g})") in out, out


def test_reduce_lr_after_a_steeper_warmup_rolled_back_past_its_start_scales_down_to_the_lr_before_the_rise(
        tmp_path: Path) -> None:
    """To 3.0 over 40 steps: the rise began at the fit's first step (0.03), and the snapshot after it restores the
    warmup's second LR, already past that: the rates are scaled down to the LR before the rise and held there (the
    factor used to be applied to the restored LR, which put the ceiling 3x under the warmup's first LR)."""
    watch = AmpWatch(verbose=False, remediate="all")
    trainer, *_ = _fit(tmp_path, lambda: Warmup(3.0, 40), regression_data(), watch, max_steps=40)
    [d] = _remedied(watch)
    assert (d.finding, d.remedy) == (Finding.LR_SCHEDULE, "reduce_lr")
    before = d.evidence["lr_before"]
    assert before == pytest.approx(0.03)  # the warmup's first LR, a hundredth of 3.0
    details = d.evidence["remedy_details"]
    assert details["lr_before"][0] > before and details["factor"] < 1
    assert details["lr_after"] == [pytest.approx(before)] and details["ceiling"] == [pytest.approx(before)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(before)  # what the rest of the run trains at


def test_a_remedy_still_watched_when_the_checkpoint_was_written_is_judged_after_the_resume(tmp_path: Path) -> None:
    """reduce_lr is applied and the run stops 4 steps into its 8-step watch; resumed from the checkpoint written
    then, the run judges the remedy over the steps it runs (it once never did: "the run ended first")."""
    from lightning_ampwatch.scenarios import StepSchedule, build_trainer

    def fit(root: Path, max_steps: int, ckpt: str | None) -> AmpWatch:
        pl.seed_everything(0, verbose=False)
        watch = AmpWatch(remediate="all", verbose=False)
        every = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1,
                                filename="{step}")
        trainer = build_trainer(SCENARIOS["lr_schedule"], [watch, every], str(root), max_steps=max_steps,
                                enable_checkpointing=True)
        trainer.fit(Regressor(lr=0.02, lr_lambda=StepSchedule(15, 40.0)),
                    DataLoader(regression_data(), batch_size=32), ckpt_path=ckpt)
        return watch

    first = fit(tmp_path / "a", 26, None)
    [cut] = [d for d in first.diagnoses if d.remedy == "reduce_lr"]
    assert cut.outcome == "not_verified" and cut.evidence["recovery"]["reason"].startswith("the run ended 4 optimizer steps")
    resumed = fit(tmp_path / "b", 40, str(tmp_path / "ckpt" / "step=26.ckpt"))
    [judged] = [d for d in resumed.diagnoses if d.remedy == "reduce_lr"]
    assert judged.step == cut.step and judged.outcome == "recovered", judged.evidence.get("recovery")
