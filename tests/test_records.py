"""The typed records: each decision's field, and the sentence users read made from it."""

from __future__ import annotations

import math

import pytest

from lightning_ampwatch import Diagnosis, Finding
from lightning_ampwatch.records import (
    ControlVerdict,
    Facts,
    Outcome,
    Rollback,
    RollbackKind,
    TrajectoryKind,
    TrajectoryVerdict,
    facts_of,
    with_facts,
)
from lightning_ampwatch.verdicts import control_result, judge_recovery


def control(finding: Finding, loss: float | None, grads: bool | None = True, batch_nonfinite: bool = False,
            level: float | None = 1.0) -> tuple[Finding, ControlVerdict]:
    result = control_result(finding, control_loss=loss, control_grads_finite=grads, batch_nonfinite=batch_nonfinite,
                            loss_level=level)
    return result.finding, result.verdict


def test_each_control_conclusion_has_its_verdict() -> None:
    assert control(Finding.FORWARD_OVERFLOW, None) == (Finding.FORWARD_OVERFLOW, ControlVerdict.NOT_RUN)
    assert control(Finding.FORWARD_OVERFLOW, 2.0) == (Finding.FORWARD_OVERFLOW, ControlVerdict.AMP_FAULT)
    assert control(Finding.FORWARD_OVERFLOW, 5e3) == (Finding.FP32_UNSTABLE, ControlVerdict.DIVERGING)
    assert control(Finding.GRADIENT_OVERFLOW, math.nan) == (Finding.FP32_UNSTABLE, ControlVerdict.NOT_AMP)
    assert control(Finding.GRADIENT_OVERFLOW, 1.0, False, True) == (Finding.DATA_NONFINITE, ControlVerdict.DATA)
    assert control(Finding.LR_SCHEDULE, math.nan) == (Finding.LR_SCHEDULE, ControlVerdict.FAILED)
    assert control(Finding.LR_SCHEDULE, 1.0) == (Finding.LR_SCHEDULE, ControlVerdict.FINITE)


def test_the_diverging_control_gives_the_diverging_advice_from_its_verdict_not_its_words() -> None:
    from lightning_ampwatch.taxonomy import advise

    ev = {"loss_level": 0.5, "fp32_control_loss": 2000.0, "control_verdict": "whatever the words say"}
    assert "training is diverging" in advise(Finding.FP32_UNSTABLE, ev, control_diverging=True)
    assert "training is diverging" not in advise(Finding.FP32_UNSTABLE, ev)


@pytest.mark.parametrize("rollback, sentence", [
    (Rollback(RollbackKind.OFF, 9), "off: applied in place"),
    (Rollback(RollbackKind.NONE, 9, why="snapshots are off and no checkpoint file from before it was found, so "
                                        "the remedy is applied in place"),
     "none: snapshots are off and no checkpoint file from before it was found, so the remedy is applied in place"),
    (Rollback(RollbackKind.SNAPSHOT, 12, to_step=5, snapshot_step=4),
     "rolled back from step 12 to step 5 (the in-memory snapshot taken after step 4); the batches of steps 5..11 "
     "are skipped"),
    (Rollback(RollbackKind.CHECKPOINT, 12, to_step=6, path="ckpt/x.ckpt"),
     "rolled back from step 12 to step 6 (the checkpoint file ckpt/x.ckpt); the batches of steps 6..11 are skipped"),
    (Rollback(RollbackKind.SNAPSHOT, 8, to_step=5, snapshot_step=4).after_retraining([0.5, None, 0.25]),
     "rolled back from step 8 to step 5 (the in-memory snapshot taken after step 4); the batches of steps 5..7 were "
     "trained on again with the remedy (losses 0.5, -, 0.25)"),
])
def test_a_rollback_says_what_it_did(rollback: Rollback, sentence: str) -> None:
    assert rollback.sentence() == sentence
    assert rollback.resumed_at == (rollback.to_step if rollback.kind in (RollbackKind.SNAPSHOT,
                                                                          RollbackKind.CHECKPOINT) else None)


def test_an_unverified_outcome_is_published_by_its_name() -> None:
    # API.md: Diagnosis.outcome is "not_verified" (None is for no remedy, or one still watched)
    assert [o.published for o in Outcome] == ["recovered", "not_recovered", "not_verified", "relapsed"]
    unverified = judge_recovery([1.0, 1.1], steps=8, skipped=0, reference=None, reference_from="nothing")
    assert unverified.outcome is Outcome.NOT_VERIFIED and unverified.unverified is not None
    assert judge_recovery([1.0, 1.1], steps=8, skipped=0, reference=1.0, reference_from="x").outcome == "recovered"


def test_facts_travel_with_the_diagnosis_and_never_reach_its_json() -> None:
    d = Diagnosis(Finding.GRADIENT_OVERFLOW, 3, evidence={"scale": 2.0})
    assert facts_of(d) == Facts() and not facts_of(d).amp_confirmed
    verdict = TrajectoryVerdict(TrajectoryKind.AMP_CONFIRMED, "an AMP fault", {}, (1.0, 1.2))
    marked = with_facts(d, trajectory=verdict)
    assert facts_of(marked).amp_confirmed and marked == d  # the facts do not make another diagnosis
    assert "facts" not in marked.to_dict() and Diagnosis.from_dict(marked.to_dict()) == d
