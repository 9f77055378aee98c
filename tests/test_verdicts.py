"""The verdict helpers alone (what the FP32 control says), and the purity of the core modules."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

import lightning_ampwatch
from lightning_ampwatch import Finding
from lightning_ampwatch.verdicts import AMP_BLAMING, CONTROL_LEVEL_RATIO, ControlVerdict, LevelOrigin, control_result


def judge(finding: Finding, control_loss: float | None, grads_finite: bool | None = True,
          batch_nonfinite: bool = False, loss_level: float | None = 1.0,
          level_origin: LevelOrigin = LevelOrigin.HEALTHY) -> tuple[Finding, str]:
    """:func:`control_result` (what the investigation uses) as (the finding it leaves standing, why)."""
    result = control_result(finding, control_loss=control_loss, control_grads_finite=grads_finite,
                            batch_nonfinite=batch_nonfinite, loss_level=loss_level, level_origin=level_origin)
    assert result.control_loss is control_loss
    return result.finding, result.reason


def test_data_nonfinite_with_a_finite_control_is_an_amp_fault_only_where_the_amp_replay_failed() -> None:
    """The batch's NaN/inf did not reach the float32 loss: where the run's precision went non-finite on the same
    batch, that is the fault; where it did not either, the data finding stands with the control as evidence."""
    def data(amp_nonfinite: bool, control_loss: float = 2.0) -> tuple[Finding, str]:
        r = control_result(Finding.DATA_NONFINITE, control_loss=control_loss, control_grads_finite=True,
                           batch_nonfinite=True, loss_level=1.0, amp_nonfinite=amp_nonfinite)
        return r.finding, r.verdict
    assert data(True) == (Finding.FORWARD_OVERFLOW, ControlVerdict.AMP_FAULT)
    assert data(False) == (Finding.DATA_NONFINITE, ControlVerdict.FINITE)
    assert data(True, math.nan) == (Finding.DATA_NONFINITE, ControlVerdict.FAILED)  # fails in float32 too: the data


def test_no_control_leaves_the_finding() -> None:
    assert judge(Finding.FORWARD_OVERFLOW, None) == (Finding.FORWARD_OVERFLOW, "control not run")


@pytest.mark.parametrize("finding", sorted(AMP_BLAMING))
def test_a_finite_control_near_the_level_confirms_an_amp_finding(finding: Finding) -> None:
    assert judge(finding, 2.0) == (finding, "control finite: an AMP fault")


@pytest.mark.parametrize("loss, grads", [(math.nan, True), (math.inf, None), (1.0, False)])
def test_a_failed_control_clears_amp(loss: float, grads: bool | None) -> None:
    assert judge(Finding.GRADIENT_OVERFLOW, loss, grads)[0] is Finding.FP32_UNSTABLE
    assert judge(Finding.GRADIENT_OVERFLOW, loss, grads, batch_nonfinite=True)[0] is Finding.DATA_NONFINITE


def test_a_finite_control_far_above_the_level_reads_as_divergence() -> None:
    finding, why = judge(Finding.FORWARD_OVERFLOW, 2 * CONTROL_LEVEL_RATIO * 0.5, loss_level=0.5)
    assert finding is Finding.FP32_UNSTABLE and why.startswith("control finite but 2e+03x the run's loss level")
    assert judge(Finding.FORWARD_OVERFLOW, 2 * CONTROL_LEVEL_RATIO, loss_level=None)[0] is Finding.FORWARD_OVERFLOW


def test_a_level_that_is_the_first_loss_is_named_so_in_the_verdict() -> None:
    finding, why = judge(Finding.FORWARD_OVERFLOW, 2 * CONTROL_LEVEL_RATIO * 0.5, loss_level=0.5,
                         level_origin=LevelOrigin.FIRST_LOSS)
    assert finding is Finding.FP32_UNSTABLE
    assert why.startswith("control finite but 2e+03x the run's first loss (there is no healthy level yet)")


@pytest.mark.parametrize("loss, grads, batch_nonfinite, verdict", [
    (None, None, False, ControlVerdict.NOT_RUN), (2.0, True, False, ControlVerdict.AMP_FAULT),
    (math.nan, True, False, ControlVerdict.NOT_AMP), (math.nan, True, True, ControlVerdict.DATA),
    (2e3, True, False, ControlVerdict.DIVERGING)])
def test_each_outcome_has_its_typed_verdict(loss: float | None, grads: bool | None, batch_nonfinite: bool,
                                            verdict: ControlVerdict) -> None:
    result = control_result(Finding.GRADIENT_OVERFLOW, control_loss=loss, control_grads_finite=grads,
                            batch_nonfinite=batch_nonfinite, loss_level=1.0)
    assert result.verdict is verdict


@pytest.mark.parametrize("finding", [Finding.LR_SCHEDULE, Finding.DATA_NONFINITE, Finding.FP32_UNSTABLE])
def test_findings_that_do_not_blame_amp_keep_their_name(finding: Finding) -> None:
    assert judge(finding, math.nan) == (finding, "control failed too")
    assert judge(finding, 1.0) == (finding, "control finite")


@pytest.mark.parametrize("module", ["machine/__init__.py", "machine/machine.py", "machine/state.py",
                                    "machine/reference.py", "machine/lr_history.py", "machine/vocabulary.py",
                                    "machine/tally.py", "machine/overflow.py", "machine/optimizers.py",
                                    "machine/episode_tracker.py", "taxonomy.py", "advice.py", "verdicts.py",
                                    "measured.py"])
def test_the_core_imports_neither_torch_nor_lightning(module: str) -> None:
    """The classifier and its vocabulary stay pure Python: only the standard library and the core itself."""
    tree = ast.parse((Path(lightning_ampwatch.__file__).parent / module).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    allowed = {"lightning_ampwatch.taxonomy", "lightning_ampwatch.machine", "lightning_ampwatch.machine.machine",
               "lightning_ampwatch.machine.state", "lightning_ampwatch.machine.reference",
               "lightning_ampwatch.machine.lr_history", "lightning_ampwatch.machine.vocabulary",
               "lightning_ampwatch.machine.tally", "lightning_ampwatch.machine.overflow",
               "lightning_ampwatch.machine.optimizers", "lightning_ampwatch.machine.episode_tracker",
               "lightning_ampwatch.measured",  # the typed measurements and their vocabulary (pure, imports nothing)
               "lightning_ampwatch.advice"}  # each finding's fix in words (pure: measured and the standard library)
    outside = {name for name in imported if name.split(".")[0] in {"torch", "lightning", "pytorch_lightning"}
               or (name.startswith("lightning_ampwatch") and name not in allowed)}
    assert outside == set()
