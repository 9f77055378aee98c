"""Remedies and the policy table, on real objects: a real GradScaler, real modules, a real Trainer where a unit
acts on one (its precision plugin, its optimizers, a fit whose island raises)."""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import make_trainer
from lightning_ampwatch import Diagnosis, Finding
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.remedies import (
    DEFAULT_REMEDIES,
    ISLAND_ATTR,
    HoldLrOnSkip,
    LrCeiling,
    REGISTRY,
    AppliedRemedy,
    Effect,
    RemedyContext,
    RemedyError,
    RemedyName,
    RemedyPolicy,
    attach_island,
    detach_island,
    ladder_for,
    parse_remediate,
    reapply_all,
)

fp32_island, lower_init_scale, slow_growth = (
    REGISTRY[n].apply for n in (RemedyName.FP32_ISLAND, RemedyName.LOWER_INIT_SCALE, RemedyName.SLOW_GROWTH))


def _diag(finding: Finding, step: int = 10, location: str | None = None, **evidence: object) -> Diagnosis:
    return Diagnosis(finding=finding, step=step, location=location, evidence=evidence)


def _stepped_scaler(**kwargs: object) -> torch.amp.GradScaler:
    """A CPU GradScaler that has scaled once (so its scale tensor exists), as in a running fit."""
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    scaler.scale(torch.ones(()))
    return scaler


def test_parse_remediate_true_excludes_reduce_lr_and_bad_names_are_named() -> None:
    assert parse_remediate(True) == frozenset(DEFAULT_REMEDIES)
    assert "reduce_lr" not in parse_remediate(True)
    assert parse_remediate(False) == frozenset()
    assert parse_remediate(["reduce_lr"]) == {"reduce_lr"}
    with pytest.raises(ValueError, match="'lower_scale'.*valid names are"):
        parse_remediate(["lower_scale"])
    with pytest.raises(ValueError, match="remediate=3"):
        parse_remediate(3)


def test_not_amp_findings_have_no_remedy() -> None:
    for finding in (Finding.DATA_NONFINITE, Finding.NOT_REPRODUCED, Finding.NORMAL_SCALING):
        assert ladder_for(_diag(finding)) == ()
    # a run that diverges at full precision gets a lower learning rate (twice at most), never an AMP setting
    assert ladder_for(_diag(Finding.FP32_UNSTABLE)) == ("reduce_lr", "reduce_lr")


def test_ladders_drop_rungs_that_cannot_help() -> None:
    assert ladder_for(_diag(Finding.GRADIENT_OVERFLOW)) == ("lower_init_scale", "bf16_fallback")
    assert ladder_for(_diag(Finding.GRADIENT_OVERFLOW, pattern="unscaled_overflow")) == ("bf16_fallback",)
    assert ladder_for(_diag(Finding.FORWARD_OVERFLOW, location="attn")) == ("fp32_island", "bf16_fallback")
    assert ladder_for(_diag(Finding.FORWARD_OVERFLOW)) == ("bf16_fallback",)


def test_policy_escalates_within_the_window_and_restarts_after_it() -> None:
    policy = RemedyPolicy(frozenset(DEFAULT_REMEDIES), escalation_window=100)
    first = _diag(Finding.GRADIENT_OVERFLOW, step=10)
    assert policy.choose(first) == (0, "lower_init_scale")
    policy.record(first, 0)
    assert policy.choose(_diag(Finding.GRADIENT_OVERFLOW, step=50)) == (1, "bf16_fallback")
    assert policy.choose(_diag(Finding.GRADIENT_OVERFLOW, step=500)) == (0, "lower_init_scale")
    policy.record(_diag(Finding.GRADIENT_OVERFLOW, step=60), 1)
    assert policy.choose(_diag(Finding.GRADIENT_OVERFLOW, step=70)) is None  # ladder exhausted
    restored = RemedyPolicy(frozenset(DEFAULT_REMEDIES), escalation_window=100)
    restored.load_state_dict(policy.state_dict())
    assert restored.rungs == policy.rungs


def test_policy_skips_rungs_the_user_did_not_allow() -> None:
    policy = RemedyPolicy(frozenset({"bf16_fallback"}))
    assert policy.choose(_diag(Finding.GROWTH_OVERFLOW)) == (2, "bf16_fallback")
    assert RemedyPolicy(frozenset()).choose(_diag(Finding.GROWTH_OVERFLOW)) is None
    assert RemedyPolicy(frozenset(DEFAULT_REMEDIES)).choose(_diag(Finding.LR_SCHEDULE)) is None  # opt-in only


def test_lower_init_scale_sets_the_safe_power_of_two_and_slows_growth() -> None:
    scaler = _stepped_scaler(growth_interval=10)
    ctx = RemedyContext(trainer=None, module=nn.Linear(1, 1), scaler=scaler, device=torch.device("cpu"))
    details = lower_init_scale(ctx, _diag(Finding.GRADIENT_OVERFLOW, safe_scale=3000.0))
    assert scaler.get_scale() == 2048.0
    assert scaler.get_growth_interval() == 40
    assert details == {"scale_before": 65536.0, "scale_after": 2048.0,
                       "growth_interval_before": 10, "growth_interval_after": 40}


def test_slow_growth_resets_the_tracker_so_the_new_interval_counts_from_zero() -> None:
    scaler = _stepped_scaler(growth_interval=3)
    scaler._growth_tracker.fill_(2)
    ctx = RemedyContext(trainer=None, module=nn.Linear(1, 1), scaler=scaler, device=torch.device("cpu"))
    details = slow_growth(ctx, _diag(Finding.GROWTH_OVERFLOW))
    assert scaler.get_growth_interval() == 100 and scaler.get_growth_factor() == 1.5
    assert int(scaler._growth_tracker) == 0
    assert details["growth_interval_before"] == 3 and details["growth_factor_after"] == 1.5


def test_scaler_remedies_refuse_without_a_scaler() -> None:
    ctx = RemedyContext(trainer=None, module=nn.Linear(1, 1), scaler=None, device=torch.device("cpu"))
    with pytest.raises(RemedyError, match="no GradScaler"):
        lower_init_scale(ctx, _diag(Finding.GRADIENT_OVERFLOW))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_fp32_island_runs_the_module_in_float32_inside_autocast_and_survives_copy_and_pickle() -> None:
    net = _Net()
    ctx = RemedyContext(trainer=None, module=net, scaler=None, device=torch.device("cpu"))
    assert fp32_island(ctx, _diag(Finding.FORWARD_OVERFLOW, location="block")) == {"module": "block"}
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        assert net.block(x).dtype == torch.float32  # the island
        assert net.head(x).dtype == torch.float16  # the rest stays in float16
        assert torch.is_autocast_enabled("cpu")  # autocast is back on after the island
    for clone in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        with torch.autocast("cpu", dtype=torch.float16):
            assert clone.block(x).dtype == torch.float32
    attach_island(net, "block", "cpu")  # idempotent: one pair of hooks
    assert len(net.block._forward_pre_hooks) == 1
    detach_island(net, "block")
    assert not hasattr(net.block, ISLAND_ATTR) and not net.block._forward_pre_hooks


def test_fp32_island_on_a_parameter_location_isolates_its_module() -> None:
    net = _Net()
    ctx = RemedyContext(trainer=None, module=net, scaler=None, device=torch.device("cpu"))
    assert fp32_island(ctx, _diag(Finding.FORWARD_OVERFLOW, location="head.weight")) == {"module": "head"}
    with pytest.raises(RemedyError, match="not a submodule"):
        fp32_island(ctx, _diag(Finding.FORWARD_OVERFLOW, location="nowhere"))


class _RaisesOnce(nn.Module):
    """A layer whose forward raises the first time, as a data-dependent check in user code might."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.raised = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.raised:
            self.raised = True
            raise ValueError("rejected batch")
        return self.linear(x)


class _CatchesIslandError(pl.LightningModule):
    """Its training step calls an islanded layer that raises once and catches the error, then trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.risky = _RaisesOnce()
        self.body = nn.Linear(8, 1)
        self.autocast_after_catch: list[bool] = []
        self.body_errors: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        try:
            x = self.risky(x)
        except ValueError:
            self.autocast_after_catch.append(torch.is_autocast_enabled("cpu"))
        out = self.body(x)
        # what float16 autocast must compute from the weights as they are now (not as they were at an earlier step)
        expected = nn.functional.linear(x.half(), self.body.weight.half(), self.body.bias.half())
        self.body_errors.append(float((out.float() - expected.float()).abs().max().detach()))
        return nn.functional.mse_loss(out.float().squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_an_island_that_raises_leaves_autocast_as_it_was(tmp_path: Path) -> None:
    """An exception out of the island, caught in training_step: autocast is back on at once, so the rest of the
    step runs in float16; and no autocast context is left open, which would keep autocast's cache of float16
    weights alive across later autocast regions (stale weights after an update)."""
    pl.seed_everything(0, verbose=False)
    model = _CatchesIslandError()
    attach_island(model, "risky", "cpu")
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, generator=g))
    make_trainer(tmp_path, [], max_steps=4).fit(model, DataLoader(data, batch_size=16))
    assert model.autocast_after_catch == [True]
    assert max(model.body_errors) == 0.0  # every step's body ran in float16, the first one included

    x = torch.randn(4, 8, generator=g)

    def float16_error() -> float:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model.body(x)
        expected = nn.functional.linear(x.half(), model.body.weight.half(), model.body.bias.half())
        return float((out.float() - expected.float()).abs().max().detach())

    assert float16_error() == 0.0
    with torch.no_grad():
        model.body.weight.add_(1.0)
    assert float16_error() == 0.0  # the updated weights, not a cached float16 copy of the old ones


# ---------------------------------------------------------------------------- the units and their registry


def test_every_remedy_name_has_one_unit_that_declares_what_to_re_read() -> None:
    assert set(REGISTRY) == set(RemedyName)
    assert all(unit.name is name for name, unit in REGISTRY.items())
    assert {name: unit.effects for name, unit in REGISTRY.items() if unit.effects} == {
        RemedyName.LOWER_INIT_SCALE: {Effect.SCALER},
        RemedyName.SLOW_GROWTH: {Effect.SCALER},
        RemedyName.BF16_FALLBACK: {Effect.PRECISION},
        RemedyName.REDUCE_LR: {Effect.OPTIMIZERS},
    }
    # names compare, hash and print as the plain strings users write and the event log holds
    assert RemedyName.REDUCE_LR == "reduce_lr" and "reduce_lr" in {RemedyName.REDUCE_LR}
    assert str(RemedyName.FP32_ISLAND) == f"{RemedyName.FP32_ISLAND}" == "fp32_island"
    record = AppliedRemedy(RemedyName.FP32_ISLAND, 3, "FORWARD_OVERFLOW", {"module": "attention"})
    assert json.loads(json.dumps(record.to_dict()))["name"] == "fp32_island"
    assert AppliedRemedy.from_dict(json.loads(json.dumps(record.to_dict()))) == record


def test_parse_remediate_rejects_items_that_are_not_names_and_names_the_valid_ones() -> None:
    assert parse_remediate("slow_growth") == {RemedyName.SLOW_GROWTH}
    for bad in ([["x"]], [3], ["slow_growth", None]):
        with pytest.raises(ValueError, match=r"not a remedy name; valid names are lower_init_scale, .*reduce_lr"):
            parse_remediate(bad)


def test_scaler_remedies_describe_what_they_changed_and_leave_resume_to_the_checkpoint() -> None:
    scaler = _stepped_scaler(growth_interval=10)
    ctx = RemedyContext(trainer=None, module=nn.Linear(1, 1), scaler=scaler, device=torch.device("cpu"))
    lower, slow = REGISTRY[RemedyName.LOWER_INIT_SCALE], REGISTRY[RemedyName.SLOW_GROWTH]
    assert lower.describe(lower.apply(ctx, _diag(Finding.GRADIENT_OVERFLOW, safe_scale=3000.0))) == \
        "loss scale 2**16 -> 2**11, growth interval 10 -> 40 steps"
    assert slow.describe(slow.apply(ctx, _diag(Finding.GROWTH_OVERFLOW))) == \
        "growth interval 40 -> 400 steps, growth factor 2 -> 1.5"
    record = AppliedRemedy(RemedyName.LOWER_INIT_SCALE, 10, "GRADIENT_OVERFLOW", {"scale_after": 1.0})
    lower.reapply(ctx, record)  # the scaler's state is Lightning's to restore: nothing is changed here
    assert scaler.get_scale() == 2048.0 and scaler.get_growth_interval() == 400


def test_unscale_before_clip_switches_the_guards_clip_rescaling_itself() -> None:
    unit = REGISTRY[RemedyName.UNSCALE_BEFORE_CLIP]
    guards = RecipeGuards()
    ctx = RemedyContext(trainer=None, module=nn.Linear(1, 1), scaler=_stepped_scaler(), device=torch.device("cpu"),
                        guards=guards)
    details = unit.apply(ctx, _diag(Finding.CLIP_BEFORE_UNSCALE))
    assert guards.rescale_clipping
    assert details == {"clip_threshold": "multiplied by the current loss scale"}
    assert unit.describe(details) == "clipping limits are multiplied by the loss scale while the gradients are " \
                                     "still scaled"
    resumed = RecipeGuards()  # a resumed fit has new guards: the switch is put back on them
    unit.reapply(replace(ctx, guards=resumed), AppliedRemedy(unit.name, 3, "CLIP_BEFORE_UNSCALE", details))
    assert resumed.rescale_clipping
    with pytest.raises(RemedyError, match="recipe guards"):
        unit.apply(replace(ctx, guards=None), _diag(Finding.CLIP_BEFORE_UNSCALE))
    with pytest.raises(RemedyError, match="no GradScaler"):
        unit.apply(replace(ctx, scaler=None, guards=RecipeGuards()), _diag(Finding.CLIP_BEFORE_UNSCALE))


def test_bf16_fallback_switches_a_real_trainer_once_and_again_after_a_resume(tmp_path: Path) -> None:
    unit = REGISTRY[RemedyName.BF16_FALLBACK]
    trainer = make_trainer(tmp_path, [])
    ctx = RemedyContext(trainer=trainer, module=nn.Linear(1, 1), scaler=trainer.precision_plugin.scaler,
                        device=torch.device("cpu"))
    details = unit.apply(ctx, _diag(Finding.INPUT_RANGE))
    assert details == {"precision_before": "16-mixed", "precision_after": "bf16-mixed"}
    assert trainer.precision_plugin.precision == "bf16-mixed" and trainer.precision_plugin.scaler is None
    assert unit.describe(details) == "precision 16-mixed -> bf16-mixed, without a GradScaler"
    with pytest.raises(RemedyError, match="already in bf16-mixed"):
        unit.apply(ctx, _diag(Finding.INPUT_RANGE))
    record = AppliedRemedy(unit.name, 5, "INPUT_RANGE", details)
    plugin = trainer.precision_plugin
    unit.reapply(ctx, record)  # already bf16: left as it is
    assert trainer.precision_plugin is plugin
    resumed = make_trainer(tmp_path, [])  # built anew with the original precision
    unit.reapply(replace(ctx, trainer=resumed), record)
    assert resumed.precision_plugin.precision == "bf16-mixed"
    with pytest.raises(RemedyError, match="not supported on meta"):
        unit.apply(replace(ctx, trainer=make_trainer(tmp_path, []), device=torch.device("meta")),
                   _diag(Finding.INPUT_RANGE))


def test_reduce_lr_lowers_optimizers_and_schedulers_of_a_real_trainer(tmp_path: Path) -> None:
    unit = REGISTRY[RemedyName.REDUCE_LR]
    trainer, net = make_trainer(tmp_path, []), nn.Linear(2, 2)
    opt = torch.optim.SGD([{"params": [net.weight], "lr": 0.4}, {"params": [net.bias], "lr": 0.2}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer.strategy.optimizers = [opt]
    trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(sched)]
    ctx = RemedyContext(trainer=trainer, module=net, scaler=None, device=torch.device("cpu"))
    details = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.1, lr_after=0.4))
    assert details == {"lr_before": [0.4, 0.2], "lr_after": [0.1, 0.05], "factor": 0.25, "back_to": 0.1}
    assert unit.describe(details) == "learning rates x0.25: 0.4 -> 0.1, 0.2 -> 0.05"
    opt.step()
    sched.step()  # the schedule keeps the lower level
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.05])


def test_reapply_all_puts_back_what_a_checkpoint_cannot_carry(tmp_path: Path) -> None:
    """A resumed fit: a new model, a new fp16 trainer and new guards; every applied remedy is asked."""
    first = _Net()
    trainer = make_trainer(tmp_path, [])
    guards = RecipeGuards()
    scaler = trainer.precision_plugin.scaler
    ctx = RemedyContext(trainer=trainer, module=first, scaler=scaler, device=torch.device("cpu"), guards=guards)
    policy = RemedyPolicy(frozenset(RemedyName))
    applied = []
    for diagnosis in (_diag(Finding.FORWARD_OVERFLOW, location="block"), _diag(Finding.CLIP_BEFORE_UNSCALE),
                      _diag(Finding.INPUT_RANGE)):
        _, record = policy.apply(ctx, diagnosis, policy.choose(diagnosis), step=diagnosis.step)
        applied.append(AppliedRemedy.from_dict(record.to_dict()))  # as the checkpoint gives them back
    assert [r.name for r in applied] == [RemedyName.FP32_ISLAND, RemedyName.UNSCALE_BEFORE_CLIP,
                                         RemedyName.BF16_FALLBACK]

    model, resumed, new_guards = _Net(), make_trainer(tmp_path, []), RecipeGuards()
    reapply_all(RemedyContext(trainer=resumed, module=model, scaler=None, device=torch.device("cpu"),
                              guards=new_guards), applied)
    assert getattr(model.block, ISLAND_ATTR, None) is not None and getattr(model.head, ISLAND_ATTR, None) is None
    assert new_guards.rescale_clipping
    assert resumed.precision_plugin.precision == "bf16-mixed"


def test_policy_passes_over_rungs_that_cannot_apply_and_says_why(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, [])
    ctx = RemedyContext(trainer=trainer, module=nn.Linear(1, 1), scaler=None, device=torch.device("cpu"))
    policy = RemedyPolicy(frozenset(DEFAULT_REMEDIES))
    diagnosis = _diag(Finding.GROWTH_OVERFLOW)
    treated, applied = policy.apply(ctx, diagnosis, policy.choose(diagnosis), step=11)
    assert treated.remedy == "bf16_fallback" and type(treated.remedy) is str  # plain JSON at the edge
    assert treated.evidence["remedies_failed"] == ["slow_growth: there is no GradScaler in this run",
                                                   "lower_init_scale: there is no GradScaler in this run"]
    assert applied == AppliedRemedy(RemedyName.BF16_FALLBACK, 11, "GROWTH_OVERFLOW", treated.evidence["remedy_details"])
    assert policy.rungs == {"GROWTH_OVERFLOW": (2, 10)}


def test_fp32_island_is_described_put_back_on_resume_and_removable() -> None:
    unit = REGISTRY[RemedyName.FP32_ISLAND]
    net = _Net()
    ctx = RemedyContext(trainer=None, module=net, scaler=None, device=torch.device("cpu"))
    details = unit.apply(ctx, _diag(Finding.FORWARD_OVERFLOW, location="block.0.weight"))
    assert unit.describe(details) == "block.0 runs in float32 with autocast off"
    unit.reapply(ctx, AppliedRemedy(unit.name, 1, "FORWARD_OVERFLOW", details))  # idempotent
    assert len(net.block[0]._forward_pre_hooks) == 1
    detach_island(net, "block.0")
    assert "forward" not in net.block[0].__dict__ and not hasattr(net.block[0], ISLAND_ATTR)
    with torch.autocast("cpu", dtype=torch.float16):
        assert net.block[0](torch.randn(2, 4)).dtype == torch.float16  # an ordinary autocast layer again


def test_a_second_reduce_lr_after_one_that_did_not_recover_compounds_with_it(tmp_path: Path) -> None:
    trainer, net = make_trainer(tmp_path, []), nn.Linear(2, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    trainer.strategy.optimizers = [opt]
    ctx = RemedyContext(trainer=trainer, module=net, scaler=None, device=torch.device("cpu"))
    unit = REGISTRY[RemedyName.REDUCE_LR]
    first = unit.apply(ctx, _diag(Finding.FP32_UNSTABLE))
    assert first["factor"] == 0.1 and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    opt.param_groups[0]["lr"] = 1.0  # the rollback before the next rung brings the snapshot's LR back
    tried = [{"remedy": "reduce_lr", "outcome": "not_recovered", "reason": "..."}]
    second = unit.apply(ctx, _diag(Finding.FP32_UNSTABLE, remedies_tried=tried))
    assert second["factor"] == pytest.approx(0.01) and opt.param_groups[0]["lr"] == pytest.approx(0.01)


# ----------------------------------------------------------------------------- reduce_lr's ceiling


class _TwoGroups(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 1)


def _ceiling_fit(tmp_path: Path, schedule: Any) -> tuple[pl.Trainer, _TwoGroups, torch.optim.Optimizer, Any]:
    """A real trainer holding a two-group SGD and a step scheduler, with the module attached to it."""
    trainer, module = make_trainer(tmp_path, []), _TwoGroups()
    opt = torch.optim.SGD([{"params": module.a.parameters(), "lr": 0.1},
                           {"params": module.b.parameters(), "lr": 0.01}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    opt.step()  # (no gradients: nothing moves) the order torch expects before a scheduler step
    trainer.strategy.optimizers = [opt]
    trainer.strategy.lr_scheduler_configs = [LRSchedulerConfig(sched, interval="step")]
    module.trainer = trainer
    return trainer, module, opt, sched


def _lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [g["lr"] for g in opt.param_groups]


def test_the_lr_ceiling_holds_each_group_under_its_cap_whatever_the_schedule_computes(tmp_path: Path) -> None:
    # a schedule that halves at step 1 (under the caps: run as written) and jumps 100x from step 2
    trainer, module, opt, sched = _ceiling_fit(tmp_path, lambda s: 100.0 if s >= 2 else 0.5 if s == 1 else 1.0)
    held = LrCeiling.install(module, [0.1, 0.01])
    assert LrCeiling.installed(module) is held and held.module is module
    module.lr_scheduler_step(sched, None)
    assert _lrs(opt) == pytest.approx([0.05, 0.005])  # under the caps, the schedule as written
    module.lr_scheduler_step(sched, None)
    assert _lrs(opt) == [0.1, 0.01] and sched.get_last_lr() == [0.1, 0.01]  # the jump, held (and reported held)
    assert sched.base_lrs == [0.1, 0.01]  # the schedule itself is untouched
    # a second install lowers the caps where lower, never raises them, and clamps at once: still one wrapper
    assert LrCeiling.install(module, [0.05, 0.02]) is held and held.caps == [0.05, 0.01]
    assert _lrs(opt) == [0.05, 0.01]
    assert not isinstance(held.original, LrCeiling)
    # a copy of the module (an EMA callback's) does not copy the trainer, and holds nothing
    copied = copy.deepcopy(module)
    assert LrCeiling.installed(copied).optimizers() == []


def test_the_lr_ceiling_stacks_with_hold_lr_on_skip_and_each_comes_out_on_its_own(tmp_path: Path) -> None:
    for first_out in (LrCeiling, HoldLrOnSkip):
        trainer, module, opt, sched = _ceiling_fit(tmp_path, lambda s: 100.0 if s >= 1 else 1.0)
        skipped = [True]
        HoldLrOnSkip.install(module, lambda: skipped[0], lambda: [sched])
        LrCeiling.install(module, [0.1, 0.01])
        module.lr_scheduler_step(sched, None)
        assert sched.last_epoch == 0  # the skipped step held the scheduler
        skipped[0] = False
        module.lr_scheduler_step(sched, None)
        assert sched.last_epoch == 1 and _lrs(opt) == [0.1, 0.01]  # stepped, to 100x, and held
        first_out.uninstall(module)
        other = HoldLrOnSkip if first_out is LrCeiling else LrCeiling
        assert first_out.installed(module) is None and other.installed(module) is not None
        other.uninstall(module)
        assert "lr_scheduler_step" not in module.__dict__  # the class's own hook again
        module.lr_scheduler_step(sched, None)
        assert _lrs(opt) == pytest.approx([10.0, 1.0])


def test_reduce_lr_after_a_rollback_to_before_the_rise_sets_a_ceiling_and_scales_nothing(tmp_path: Path) -> None:
    unit = REGISTRY[RemedyName.REDUCE_LR]
    trainer, module, opt, sched = _ceiling_fit(tmp_path, lambda s: 40.0 if s >= 1 else 1.0)
    ctx = RemedyContext(trainer=trainer, module=module, scaler=None, device=torch.device("cpu"),
                        lightning_module=module)
    details = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.1, lr_after=4.0))  # the LRs are those before
    assert details == {"lr_before": [0.1, 0.01], "lr_after": [0.1, 0.01], "factor": 1.0, "ceiling": [0.1, 0.01],
                       "back_to": 0.1}
    assert unit.describe(details) == "learning rates held at or under 0.1, 0.01 (the LRs before the rise)"
    module.lr_scheduler_step(sched, None)  # the schedule's 40x step
    assert _lrs(opt) == [0.1, 0.01] and sched.base_lrs == [0.1, 0.01]
    # a rung after it that did not recover: half what it set, and the ceiling with it
    tried = [{"remedy": "reduce_lr", "outcome": "not_recovered", "reason": "..."}]
    second = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.1, lr_after=4.0, remedies_tried=tried,
                                   lr_tried=[0.1, 0.01]))
    assert second["factor"] == 0.5 and second["ceiling"] == pytest.approx([0.05, 0.005])
    assert unit.describe(second) == "learning rates x0.5: 0.1 -> 0.05, 0.01 -> 0.005, then held at or under 0.05, 0.005"
    module.lr_scheduler_step(sched, None)
    assert _lrs(opt) == pytest.approx([0.05, 0.005])
    # a resume: a new module and trainer, the record as the checkpoint gives it back; the ceiling is put back
    record = AppliedRemedy.from_dict(json.loads(json.dumps(AppliedRemedy(unit.name, 30, "LR_SCHEDULE",
                                                                         second).to_dict())))
    resumed, module2, opt2, sched2 = _ceiling_fit(tmp_path, lambda s: 40.0 if s >= 1 else 1.0)
    reapply_all(replace(ctx, trainer=resumed, module=module2, lightning_module=module2), [record])
    module2.lr_scheduler_step(sched2, None)
    assert _lrs(opt2) == pytest.approx([0.05, 0.005])


def test_reduce_lr_still_past_the_rise_scales_back_to_before_it_and_holds_there(tmp_path: Path) -> None:
    unit = REGISTRY[RemedyName.REDUCE_LR]
    trainer, module, opt, sched = _ceiling_fit(tmp_path, lambda s: 1.0)
    for group in opt.param_groups:
        group["lr"] *= 40  # no rollback: the run is still at the risen LR
    ctx = RemedyContext(trainer=trainer, module=module, scaler=None, device=torch.device("cpu"),
                        lightning_module=module)
    details = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.1, lr_after=4.0))
    assert details["factor"] == 0.025 and details["ceiling"] == pytest.approx([0.1, 0.01])
    assert unit.describe(details) == ("learning rates x0.025: 4 -> 0.1, 0.4 -> 0.01, then held at or under 0.1, 0.01 "
                                      "(the LRs before the rise)")
    # without a module to hold a ceiling on (a Fabric loop sets its own learning rates): scaled only, as before
    plain = unit.apply(replace(ctx, lightning_module=None), _diag(Finding.LR_SCHEDULE, lr_before=0.05, lr_after=0.1))
    assert "ceiling" not in plain and plain["factor"] == 0.5
    # nor under manual optimization (the training step steps its schedulers itself, past the module's hook)
    module.automatic_optimization = False
    manual = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.05, lr_after=0.1))
    assert "ceiling" not in manual and manual["factor"] == 0.5
    # nor without a scheduler (whatever raised the LR would raise it again, past a ceiling set once)
    module.automatic_optimization = True
    trainer.strategy.lr_scheduler_configs = []
    unscheduled = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.05, lr_after=0.1))
    assert "ceiling" not in unscheduled and unscheduled["factor"] == 0.5


def test_reduce_lr_after_a_rollback_into_the_warmup_holds_the_lr_before_the_rise_not_the_restored_one(
        tmp_path: Path) -> None:
    """A rollback to early in a warmup restores LRs far below the one before the rise: they are not scaled (the
    re-run steps run the warmup as they first ran it), and the ceiling is the LR before the rise, each group its
    share of it, not the restored LRs (which froze the rest of the run at the warmup's first LR)."""
    unit = REGISTRY[RemedyName.REDUCE_LR]
    trainer, module, opt, sched = _ceiling_fit(tmp_path, lambda s: s + 1.0)  # a warmup, from 0.1 up
    ctx = RemedyContext(trainer=trainer, module=module, scaler=None, device=torch.device("cpu"),
                        lightning_module=module)
    assert _lrs(opt) == [0.1, 0.01]  # the restored LRs: the warmup's first
    details = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.5, lr_after=4.0))
    assert details["factor"] == 1.0 and details["lr_after"] == [0.1, 0.01]
    assert details["ceiling"] == pytest.approx([0.5, 0.05])
    assert unit.describe(details) == "learning rates held at or under 0.5, 0.05 (the LRs before the rise)"
    module.lr_scheduler_step(sched, None)  # the warmup's next step, 2x: under the ceiling, as it first ran
    assert _lrs(opt) == pytest.approx([0.2, 0.02])
    for _ in range(5):
        module.lr_scheduler_step(sched, None)
    assert _lrs(opt) == pytest.approx([0.5, 0.05])  # 7x computed, held at the LR before the rise
    # a rung after it that did not recover, after a rollback to the warmup's start again: half the ceiling held
    # (not half the restored LRs)
    sched.last_epoch = 0
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] * 1.0
    tried = [{"remedy": "reduce_lr", "outcome": "not_recovered", "reason": "..."}]
    second = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.5, lr_after=4.0, remedies_tried=tried,
                                   lr_tried=[0.1, 0.01]))
    assert second["factor"] == 1.0 and second["ceiling"] == pytest.approx([0.25, 0.025])
    assert second["compounded_on"] == pytest.approx([0.5, 0.05])  # the ceiling it halved, not the LRs restored
    assert unit.describe(second) == "learning rates held at or under 0.25, 0.025"
    for _ in range(4):
        module.lr_scheduler_step(sched, None)
    assert _lrs(opt) == pytest.approx([0.25, 0.025])


def test_reduce_lr_keeps_its_ceiling_between_a_hundredth_and_half_the_raised_lr_and_says_so(tmp_path: Path) -> None:
    unit = REGISTRY[RemedyName.REDUCE_LR]
    trainer, module, opt, sched = _ceiling_fit(tmp_path, lambda s: 1.0)
    ctx = RemedyContext(trainer=trainer, module=module, scaler=None, device=torch.device("cpu"),
                        lightning_module=module)
    # a rise of less than 2x (0.3 -> 0.4): at least halved from the raised LR, under the LR before the rise
    small = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.3, lr_after=0.4))
    assert small["factor"] == 1.0 and small["ceiling"] == pytest.approx([0.2, 0.02])
    assert unit.describe(small) == ("learning rates held at or under 0.2, 0.02 (at most half the LR the rise "
                                    "reached; the LR before it was 0.3)")
    LrCeiling.uninstall(module)
    # a rise of more than 100x (a warmup from near zero, 0.0001 -> 0.4): a hundredth of the raised LR, not the start
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] * 0.001  # restored early in the warmup
    large = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.0001, lr_after=0.4))
    assert large["factor"] == 1.0 and large["ceiling"] == pytest.approx([0.004, 0.0004])
    assert unit.describe(large) == ("learning rates held at or under 0.004, 0.0004 (a hundredth of the LR the rise "
                                    "reached, or less; the LR before it was 0.0001)")
    LrCeiling.uninstall(module)
    # a warmup from zero, restored at zero: each group's share comes from the scheduler's base rates
    for group in opt.param_groups:
        group["lr"] = 0.0
    zero = unit.apply(ctx, _diag(Finding.LR_SCHEDULE, lr_before=0.05, lr_after=0.4))
    assert zero["factor"] == 1.0 and zero["ceiling"] == pytest.approx([0.05, 0.005])


def test_reapply_all_keeps_a_resumed_runs_own_precision_and_says_in_one_line_what_it_did_not_put_back(
        tmp_path: Path) -> None:
    """A checkpoint of a run that lowered its scale, islanded a module and then fell back to bf16, resumed at
    32-true: nothing is switched or attached, and one line names what was not put back (the scale remedy is not
    named: the fallback had already taken the scaler out of the run)."""
    records = [AppliedRemedy(RemedyName.LOWER_INIT_SCALE, 3, "GRADIENT_OVERFLOW", {"scale_after": 1024.0}),
               AppliedRemedy(RemedyName.FP32_ISLAND, 5, "FORWARD_OVERFLOW", {"module": "block"}),
               AppliedRemedy(RemedyName.BF16_FALLBACK, 9, "INPUT_RANGE", {"precision_before": "16-mixed",
                                                                           "precision_after": "bf16-mixed"})]
    model, resumed = _Net(), make_trainer(tmp_path, [], "32-true")
    plugin = resumed.precision_plugin
    lines = reapply_all(RemedyContext(trainer=resumed, module=model, scaler=None, device=torch.device("cpu"),
                                      guards=RecipeGuards()), records)
    assert lines == ["AmpWatch: the checkpoint's fp32_island, bf16_fallback were not applied again: the resumed run "
                     "trains at 32-true, the precision it was built with."]
    assert resumed.precision_plugin is plugin and getattr(model.block, ISLAND_ATTR, None) is None
    # the scale remedy alone, resumed in bf16: named, since it was in effect when the checkpoint was written
    assert reapply_all(RemedyContext(trainer=make_trainer(tmp_path, [], "bf16-mixed"), module=_Net(), scaler=None,
                                     device=torch.device("cpu")), records[:1]) == [
        "AmpWatch: the checkpoint's lower_init_scale was not applied again: the resumed run trains at bf16-mixed, "
        "the precision it was built with."]
    # resumed at float16 where bfloat16 is not supported: the fallback cannot be put back, the rest still is
    fp16, model = make_trainer(tmp_path, []), _Net()
    lines = reapply_all(RemedyContext(trainer=fp16, module=model, scaler=fp16.precision_plugin.scaler,
                                      device=torch.device("meta"), guards=RecipeGuards()), records[1:] + records[1:2])
    assert lines == ["AmpWatch: the checkpoint's bf16_fallback was not applied again: bfloat16 autocast is not "
                     "supported on meta; the resumed run trains at 16-mixed."]
    assert fp16.precision_plugin.precision == "16-mixed" and getattr(model.block, ISLAND_ATTR, None) is not None


def test_the_treatment_of_a_run_is_what_its_config_asks_and_replay_episode_is_off_under_several_ranks() -> None:
    """The front builds the treatment from the watch's configuration (``Treatment.for_run``) and, once it knows the
    world size, the treatment decides ``replay_episode`` (``across_ranks``): under DDP a rerun of the episode outside
    the loop would not all-reduce its gradients, so it is turned off and the user reads why; one process, or a run
    that never asked for it, keeps it as it is and hears nothing."""
    from lightning_ampwatch import Thresholds
    from lightning_ampwatch.config import WatchConfig
    from lightning_ampwatch.remedies.treatment import Treatment

    config = WatchConfig(remediate=["slow_growth"], rollback=False, replay_episode=True,
                         thresholds=Thresholds(recovery_steps=5, fall_margin=0.3, track_tolerance=0.05))
    treatment = Treatment.for_run(config)
    assert (treatment.recovery_steps, treatment.rollback, treatment.fall_margin, treatment.track_tolerance) == (
        5, False, 0.3, 0.05)
    assert treatment.policy.allowed == frozenset({RemedyName.SLOW_GROWTH})
    assert treatment.across_ranks(1) is None and treatment.replay_episode
    assert treatment.across_ranks(2) == ("replay_episode is off under DDP (a rerun of the episode would not "
                                         "all-reduce its gradients); the episode's batches are skipped after a "
                                         "rollback.")
    assert not treatment.replay_episode
    assert treatment.across_ranks(2) is None  # said once: nothing is left to turn off
    assert Treatment.for_run(WatchConfig()).across_ranks(4) is None


def test_where_replays_ran_only_a_fix_a_replay_cured_is_on_the_ladder() -> None:
    """A forward fault whose replays cured with FP32 only (LR/10 failed, bf16 left out by the replay-step cap) gets no
    remedy, and the summary says why. The ladder used to fall back to the finding's rungs no replay measured to fail:
    a bf16 fallback, never replayed, went to a rounding fault (log of 1 - sigmoid) that bfloat16 has as well, and with
    no scaler left to skip its steps the NaN reached the weights of a run float16 had kept alive (a fresh run)."""
    from lightning_ampwatch.interventions import Intervention, InterventionReport, Tried
    from lightning_ampwatch.records import with_facts
    from lightning_ampwatch.reporters.unremedied import unremedied_reason
    from lightning_ampwatch.verdicts import TrajectoryResult

    steps = list(range(1, 9))

    def tried(kind: Intervention, label: str, fault_at: int | None) -> Tried:
        n = len(steps) if fault_at is None else steps.index(fault_at) + 1
        losses = [0.5] * n if fault_at is None else [0.5] * (n - 1) + [float("nan")]
        result = TrajectoryResult(precision="amp", from_step=0, steps=steps[:n], losses=losses,
                                  skipped=[False] * (n - 1) + [fault_at is not None], params_finite=True)
        return Tried(kind, label, result, len(steps), counted_from=5)

    report = InterventionReport(from_step=0, onset=5, lr_factor=0.1, window=(1, 8), repeated_from=None,
                                tried=(tried(Intervention.NOTHING, "nothing changed", 5),
                                       tried(Intervention.FP32, "FP32", None),
                                       tried(Intervention.LOWER_LR, "LR/10", 5)),
                                not_tried=(("bf16", "the replay-step cap of 24 per alarm is reached"),))
    diagnosis = with_facts(_diag(Finding.FORWARD_OVERFLOW, step=5, location="head"), interventions=report)
    assert report.cures() == [] and ladder_for(diagnosis) == ()
    assert RemedyPolicy(frozenset(RemedyName)).choose(diagnosis) is None
    assert unremedied_reason(diagnosis, [diagnosis], ["fp32_island", "bf16_fallback"]) == \
        "no fix cured it on the replays (bf16: not tried)"
    # the fault and its FP32 control used up the cap: no fix was tried, and the line does not say one failed
    capped = InterventionReport(from_step=0, onset=5, lr_factor=0.1, window=(1, 8), repeated_from=None,
                                tried=report.tried[:2],
                                not_tried=(("LR/10", "the replay-step cap of 16 per alarm is reached"),
                                           ("bf16", "the replay-step cap of 16 per alarm is reached")))
    diagnosis = with_facts(_diag(Finding.FORWARD_OVERFLOW, step=5, location="head"), interventions=capped)
    assert unremedied_reason(diagnosis, [diagnosis], ["fp32_island", "bf16_fallback"]) == \
        "no fix was tried on the replays (LR/10, bf16: not tried)"
    # without replays (no snapshot) the finding's table row stands, as documented
    assert ladder_for(_diag(Finding.FORWARD_OVERFLOW, location="head")) == ("fp32_island", "bf16_fallback")
