"""Remedies and the policy table, on real objects (a real GradScaler, real modules), without a Trainer."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_ampwatch import Diagnosis, Finding
from lightning_ampwatch.remedies import (
    DEFAULT_REMEDIES,
    ISLAND_ATTR,
    REGISTRY,
    RemedyContext,
    RemedyError,
    RemedyName,
    RemedyPolicy,
    attach_island,
    detach_island,
    ladder_for,
    parse_remediate,
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
    for finding in (Finding.DATA_NONFINITE, Finding.FP32_UNSTABLE, Finding.NORMAL_SCALING):
        assert ladder_for(_diag(finding)) == ()


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
