"""The typed measurements decisions read (``diagnosis.measured``): made with the diagnosis from the evidence it is
published with, made again whenever it is made again with other evidence, and the same once read back from JSON
(another rank's record, a checkpoint's)."""

from __future__ import annotations

import json
from dataclasses import replace

from lightning_ampwatch import Diagnosis, Finding
from lightning_ampwatch.measured import DivergencePattern, GradientPattern, LrEvent, LrRise, Measured, Tried
from lightning_ampwatch.remedies.policy import ladder_for
from lightning_ampwatch.remedies.base import RemedyName
from lightning_ampwatch.taxonomy import advise


def lr_alarm() -> Diagnosis:
    return Diagnosis(Finding.LR_SCHEDULE, 12, evidence={
        "lr_event": LrEvent.LR_INCREASE, "lr_before": 0.001, "lr_after": 0.1, "lr_change_step": 9,
        "remedies_tried": [{"remedy": "reduce_lr", "outcome": "not_recovered", "reason": "it climbed again"}],
        "lr_tried": [0.05, 0.005], "fault_ranks": [1], "reported_from_rank": 1})


def test_the_record_holds_each_measurement_typed() -> None:
    m = lr_alarm().measured
    assert m.lr == LrRise(LrEvent.LR_INCREASE, 0.001, 0.1, 9) and m.lr.rose == (0.001, 0.1)
    assert m.remedies_tried == (Tried("reduce_lr", "not_recovered", "it climbed again"),) and m.earlier_lr_rungs == 1
    assert m.lr_tried == (0.05, 0.005) and m.fault_ranks == (1,) and m.reported_from_rank == 1
    assert m.pattern is None and m.safe_scale is None and not m.safe_scale_sought and not m.weights_lost


def test_a_record_read_back_from_the_event_log_has_the_same_measurements() -> None:
    for d in (lr_alarm(), Diagnosis(Finding.GRADIENT_OVERFLOW, 3, evidence={
            "pattern": GradientPattern.COLLAPSE, "safe_scale": 1024.0, "scale": 8.0, "onset_scale": 65536.0,
            "init_scale": 65536.0,
            "nonfinite_where": "batch[0]", "first_nonfinite_step": 4})):
        back = Diagnosis.from_dict(json.loads(d.to_json()))
        assert back.measured == d.measured
    assert back.measured.pattern is GradientPattern.COLLAPSE and back.measured.safe_scale == 1024.0
    assert back.measured.nonfinite_batch and back.measured.first_nonfinite_step == 4
    assert back.measured.init_scale == back.measured.onset_scale == 65536.0 and back.measured.scale == 8.0
    # the advice is said from the same record: the safe scale, below the scale in use
    assert "GradScaler(init_scale=2**10) instead of 2**16" in advise(Finding.GRADIENT_OVERFLOW, back.evidence)


def test_the_record_follows_the_evidence_it_is_made_again_with() -> None:
    d = Diagnosis(Finding.GRADIENT_OVERFLOW, 3, evidence={"pattern": "startup", "safe_scale": None})
    assert d.measured.pattern is GradientPattern.STARTUP and d.measured.safe_scale_sought
    again = replace(d, evidence={**d.evidence, "pattern": "unscaled_overflow"})
    assert again.measured.pattern is GradientPattern.UNSCALED_OVERFLOW and d.measured.pattern is GradientPattern.STARTUP
    # and the decision that reads it: no lower initial scale for gradients that overflow unscaled
    assert RemedyName.LOWER_INIT_SCALE in ladder_for(d)
    assert RemedyName.LOWER_INIT_SCALE not in ladder_for(again)


def test_a_finite_divergence_and_the_weights_lost_are_read_as_fields() -> None:
    climb = Diagnosis(Finding.FP32_UNSTABLE, 40, evidence={"pattern": DivergencePattern.FINITE_DIVERGENCE})
    assert climb.measured.finite_divergence and climb.measured.pattern is DivergencePattern.FINITE_DIVERGENCE
    data = Diagnosis(Finding.DATA_NONFINITE, 5, evidence={"nonfinite_where": "batch[0]"})
    lost = replace(data, evidence={**data.evidence, "weights_lost": "the weights now hold non-finite values"})
    assert ladder_for(data) == () and ladder_for(lost) != ()  # nothing to undo where the scaler skipped the step
    assert not data.measured.weights_lost and lost.measured.weights_lost


def test_values_that_are_not_measurements_are_not_read_as_such() -> None:
    m = Measured.read_back({"pattern": "no such pattern", "safe_scale": "inf", "lr_before": True,
                            "lr_change_step": "9", "remedies_tried": "none"})
    assert m.pattern is None and m.safe_scale is None and m.safe_scale_sought
    assert m.lr == LrRise(None, None, None, None) and m.lr.rose is None and m.remedies_tried is None


def test_a_tried_remedy_is_published_as_the_entry_it_is_read_back_from() -> None:
    entry = {"remedy": "lower_init_scale", "outcome": "not_recovered", "reason": "it skipped again"}
    assert Measured.read_back({"remedies_tried": [entry]}).remedies_tried[0].entry() == entry


def test_an_lr_rise_is_published_as_the_entries_it_is_read_back_from_and_said_from_the_record() -> None:
    rise = LrRise(LrEvent.WARMUP_END, 0.0006, 0.0018, 8)
    d = Diagnosis(Finding.LR_SCHEDULE, 10, evidence=rise.entries())
    assert d.evidence == {"lr_event": "warmup_end", "lr_before": 0.0006, "lr_after": 0.0018, "lr_change_step": 8}
    assert d.measured.lr == rise and rise.words() == "0.0006 -> 0.0018 at step 8"
    assert LrRise(LrEvent.LR_INCREASE, 0.1, 0.01, 3).words() is None  # a fall is no rise
    assert "right after warmup reached its peak (0.0006 -> 0.0018)" in advise(Finding.LR_SCHEDULE, d.evidence)
