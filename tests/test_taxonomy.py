"""The vocabulary: Finding values, the Diagnosis record, its JSON form and the advice wording."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from lightning_ampwatch import AmpWatchError, Diagnosis, Finding
from lightning_ampwatch.taxonomy import GradientPattern, advise, advised_init_scale, format_pow2


def test_finding_value_equals_name_and_survives_json() -> None:
    for finding in Finding:
        assert finding.value == finding.name
        assert str(finding) == finding.name
        assert Finding(json.loads(json.dumps(finding))) is finding


def test_only_normal_scaling_is_not_an_alarm() -> None:
    quiet = [f for f in Finding if not f.is_alarm]
    assert quiet == [Finding.NORMAL_SCALING]
    assert Diagnosis(Finding.NORMAL_SCALING, 3).is_alarm is False
    assert Diagnosis(Finding.GRADIENT_OVERFLOW, 3).is_alarm is True


def test_every_finding_has_a_summary_and_advice() -> None:
    for finding in Finding:
        assert finding.summary
        assert advise(finding, {})


def test_diagnosis_is_frozen() -> None:
    diagnosis = Diagnosis(Finding.GRADIENT_OVERFLOW, 5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        diagnosis.step = 6  # type: ignore[misc]


def test_finding_given_as_string_becomes_the_enum() -> None:
    assert Diagnosis("LR_SCHEDULE", 1).finding is Finding.LR_SCHEDULE  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Diagnosis("NOT_A_FINDING", 1)  # type: ignore[arg-type]


def test_to_dict_from_dict_round_trip_through_json() -> None:
    original = Diagnosis(
        finding=Finding.GROWTH_OVERFLOW, step=42, location="encoder.0",
        evidence={"scale_history": [65536.0, 32768.0], "growth_steps": [3, 7, 11], "pattern": "growth_overflow"},
        advice="grow slower", remedy="slow_growth",
    )
    data = json.loads(json.dumps(original.to_dict()))
    assert data["finding"] == "GROWTH_OVERFLOW"
    assert Diagnosis.from_dict(data) == original
    assert Diagnosis.from_dict(json.loads(original.to_json())) == original


def test_from_dict_ignores_unknown_keys() -> None:
    data = {**Diagnosis(Finding.INPUT_RANGE, 2).to_dict(), "written_by": "a later version"}
    assert Diagnosis.from_dict(data) == Diagnosis(Finding.INPUT_RANGE, 2)


def test_non_finite_evidence_stays_valid_json() -> None:
    diagnosis = Diagnosis(Finding.FORWARD_OVERFLOW, 0, evidence={
        "loss": float("nan"), "scale": float("inf"), "history": [1.0, float("-inf")], "nested": {"x": float("nan")},
    })
    text = diagnosis.to_json()
    # strict JSON: no NaN / Infinity tokens anywhere
    parsed = json.loads(text, parse_constant=lambda token: pytest.fail(f"non-JSON token {token} in {text}"))
    ev = parsed["evidence"]
    assert ev["loss"] == "nan" and ev["scale"] == "inf" and ev["history"] == [1.0, "-inf"]
    assert ev["nested"] == {"x": "nan"}
    assert math.isnan(float(ev["loss"]))


def test_evidence_that_is_not_json_native_is_stringified() -> None:
    diagnosis = Diagnosis(Finding.DATA_NONFINITE, 0, evidence={"finding": Finding.NORMAL_SCALING, "pair": (1, 2),
                                                                 "obj": object})
    parsed = json.loads(diagnosis.to_json())["evidence"]
    assert parsed["finding"] == "NORMAL_SCALING"
    assert parsed["pair"] == [1, 2]
    assert isinstance(parsed["obj"], str)


def test_headline_names_finding_step_and_location() -> None:
    headline = Diagnosis(Finding.FORWARD_OVERFLOW, 17, location="attention.q").headline()
    assert headline.startswith("FORWARD_OVERFLOW at step 17 in attention.q: ")


@pytest.mark.parametrize("safe, text", [(1024.0, "init_scale=2**10"), (2.0**13, "init_scale=2**13"),
                                        (0.5, "init_scale=2**-1")])
def test_gradient_overflow_advice_names_the_safe_scale_as_a_power_of_two(safe: float, text: str) -> None:
    advice = advise(Finding.GRADIENT_OVERFLOW, {"pattern": "startup", "safe_scale": safe})
    assert text in advice
    assert "GradScaler(" in advice


def test_unscaled_overflow_advice_does_not_suggest_a_lower_scale() -> None:
    advice = advise(Finding.GRADIENT_OVERFLOW, {"pattern": "unscaled_overflow", "safe_scale": 1024.0})
    assert "init_scale" not in advice
    assert "bf16-mixed" in advice


def test_growth_advice_names_a_larger_interval_and_a_smaller_factor() -> None:
    advice = advise(Finding.GROWTH_OVERFLOW, {"growth_interval": 3, "growth_factor": 2.0, "safe_scale": 4096.0})
    assert "growth_interval=30" in advice
    assert "growth_factor=1.41" in advice
    assert "init_scale=2**12" in advice


# (an lr_increase read "the learning rate rose ... or lengthen the warmup": it is a jump in one step, and says so)
@pytest.mark.parametrize("event, words", [("warmup_end", "warmup"), ("lr_increase", "learning rate jumped in one step")])
def test_lr_advice_says_which_event_with_the_lr_before_and_after(event: str, words: str) -> None:
    advice = advise(Finding.LR_SCHEDULE, {"lr_event": event, "lr_before": 0.001, "lr_after": 0.04})
    assert words in advice
    assert "0.001 -> 0.04" in advice


def test_input_range_advice_quotes_the_magnitude_and_where() -> None:
    advice = advise(Finding.INPUT_RANGE, {"input_absmax": 123456.0, "input_where": "batch[0]"})
    assert "1.23e+05" in advice and "batch[0]" in advice and "65504" in advice


def test_data_advice_names_the_rows() -> None:
    advice = advise(Finding.DATA_NONFINITE, {"nonfinite_where": "batch[0] rows [8]"})
    assert "batch[0] rows [8]" in advice


def test_amp_watch_error_carries_the_diagnosis() -> None:
    diagnosis = Diagnosis(Finding.GRADIENT_OVERFLOW, 0)
    err = AmpWatchError("boom", diagnosis)
    assert isinstance(err, RuntimeError) and err.diagnosis is diagnosis


def test_gradient_pattern_values_are_the_evidence_strings() -> None:
    assert [p.value for p in GradientPattern] == ["startup", "burst", "collapse", "persistent", "unscaled_overflow",
                                                  "growth_overflow"]
    diagnosis = Diagnosis(Finding.GRADIENT_OVERFLOW, 0, evidence={"pattern": GradientPattern.COLLAPSE})
    assert diagnosis.evidence["pattern"] == "collapse" and type(diagnosis.evidence["pattern"]) is str
    assert json.loads(diagnosis.to_json())["evidence"]["pattern"] == "collapse"


@pytest.mark.parametrize("value, text", [(1024.0, "2**10"), (0.5, "2**-1"), (3.0, "3"), (float("inf"), "inf"),
                                         ("x", "x")])
def test_format_pow2(value: object, text: str) -> None:
    assert format_pow2(value) == text


def test_startup_advice_names_the_scale_it_replaces_without_calling_it_the_default() -> None:
    advice = advise(Finding.GRADIENT_OVERFLOW, {"pattern": "startup", "safe_scale": 1024.0, "init_scale": 2.0**18})
    assert "GradScaler(init_scale=2**10) instead of 2**18" in advice
    assert "default" not in advice


@pytest.mark.parametrize("evidence", [
    {"pattern": "collapse", "safe_scale": 2.0**16, "init_scale": 2.0**16},
    {"pattern": "burst", "safe_scale": 2.0**17, "init_scale": 2.0**16},  # the scale had grown past its start
    {"pattern": "collapse", "safe_scale": 2.0**10, "onset_scale": 2.0**10},
])
def test_gradient_advice_never_recommends_the_scale_already_in_use(evidence: dict[str, object]) -> None:
    advice = advise(Finding.GRADIENT_OVERFLOW, evidence)
    assert "init_scale=" not in advice
    assert "a lower starting scale would not have prevented them" in advice


def test_growth_advice_does_not_recommend_the_scale_it_started_at() -> None:
    advice = advise(Finding.GROWTH_OVERFLOW, {"growth_interval": 3, "safe_scale": 1024.0, "init_scale": 1024.0})
    assert "init_scale=" not in advice and "(2**10) holds" in advice


def test_unscaled_overflow_advice_is_a_code_fix_an_fp32_island_or_bf16_never_a_scaler_setting() -> None:
    advice = advise(Finding.GRADIENT_OVERFLOW, {"pattern": "unscaled_overflow", "safe_scale": 0.25,
                                                "init_scale": 2.0**16})
    assert "GradScaler" not in advice and "init_scale" not in advice and "growth" not in advice
    assert "log_softmax" in advice and "fp32 island" in advice and "bf16-mixed" in advice


def test_withdrawn_normal_scaling_says_so_in_headline_and_advice() -> None:
    withdrawn = Diagnosis(Finding.NORMAL_SCALING, 10, evidence={
        "skipped_steps": 1, "withdrawn": True, "withdrawn_by": "GROWTH_OVERFLOW", "withdrawn_at": 32},
        advice=advise(Finding.NORMAL_SCALING, {"withdrawn": True, "withdrawn_by": "GROWTH_OVERFLOW",
                                               "withdrawn_at": 32}))
    assert withdrawn.withdrawn and not withdrawn.is_alarm
    assert withdrawn.headline() == ("NORMAL_SCALING at step 10: withdrawn at step 32: a GROWTH_OVERFLOW episode "
                                    "began, so the skip may have been its first sign, not dynamic scaling doing "
                                    "its job")
    dated = dataclasses.replace(withdrawn, evidence={**withdrawn.evidence, "alarm_onset": 25})
    assert "a GROWTH_OVERFLOW episode began 15 steps after this skip, so the skip may have been" in dated.summary
    assert withdrawn.advice.startswith("The earlier 'normal scaling' call was premature")
    assert not Diagnosis(Finding.NORMAL_SCALING, 10).withdrawn


def test_divergence_first_narrows_the_fp32_unstable_summary_and_advice() -> None:
    ev = {"divergence": "loss 0.82 -> 30 over steps 31..34 before any overflow", "diverged_first": True}
    diagnosis = Diagnosis(Finding.FP32_UNSTABLE, 31, evidence=ev, advice=advise(Finding.FP32_UNSTABLE, ev))
    assert "at full precision too" not in diagnosis.headline()  # not measured: the loss climbed first
    assert "the loss diverged before any overflow" in diagnosis.headline()
    assert diagnosis.advice.startswith("The loss climbed (loss 0.82 -> 30 over steps 31..34 before any overflow)")
    plain = Diagnosis(Finding.FP32_UNSTABLE, 5)
    assert plain.summary == Finding.FP32_UNSTABLE.summary


def test_lr_advice_leads_with_the_climb_when_there_was_one() -> None:
    advice = advise(Finding.LR_SCHEDULE, {"lr_event": "lr_increase", "lr_before": 0.01, "lr_after": 0.5,
                                          "divergence": "loss 0.9 -> 31 over steps 30..33 before any overflow"})
    assert advice.startswith("The loss climbed (loss 0.9 -> 31 over steps 30..33 before any overflow). ")
    assert "the learning rate jumped in one step (0.01 -> 0.5)" in advice


@pytest.mark.parametrize("evidence, advised", [
    ({"safe_scale": 1024.0, "init_scale": 65536.0}, 1024.0),
    ({"safe_scale": 1024.0}, 1024.0),
    ({"safe_scale": 65536.0, "init_scale": 65536.0}, None),
    ({"safe_scale": 2048.0, "init_scale": 65536.0, "onset_scale": 1024.0}, 2048.0),  # below the larger in use
    ({"safe_scale": None, "init_scale": 65536.0}, None),
    ({"safe_scale": True}, None),
])
def test_advised_init_scale_is_only_ever_below_the_scale_in_use(evidence: dict[str, object],
                                                                advised: float | None) -> None:
    assert advised_init_scale(evidence) == advised


@pytest.mark.parametrize("where, check", [
    ("batch['pixel_values'] rows [2]", "torch.isfinite(batch['pixel_values']).all()"),  # a dict batch (HF style)
    ("micro_batch[1]['x'] rows [0, 3]; micro_batch[1]['y']", "torch.isfinite(batch['x']).all()"),  # accumulation
    ("batch[0] rows [8]", "torch.isfinite(batch[0]).all()"),
    (None, "torch.isfinite(batch).all()"),
])
def test_a_data_fault_is_checked_on_the_tensor_that_held_it(where: str | None, check: str) -> None:
    """The advice's check is code the user can paste: on a dict batch ``torch.isfinite(batch)`` raises, so the
    check names the tensor the NaN/inf was measured in, as the user's training_step names it."""
    advice = advise(Finding.DATA_NONFINITE, {"nonfinite_where": where} if where else {})
    assert check in advice, advice


def test_an_lr_jump_is_not_told_to_lengthen_a_warmup_it_does_not_have() -> None:
    """A rise in one step (a warm restart, a step schedule) gets the jump's fix; a warmup's end keeps the warmup's.
    Neither says float16 made it show sooner: where FP32 was replayed, it failed the same way."""
    jump = advise(Finding.LR_SCHEDULE, {"lr_event": "lr_increase", "lr_before": 0.0039, "lr_after": 0.2})
    assert "jumped in one step (0.0039 -> 0.2)" in jump and "warm restart" in jump, jump
    assert "warmup" not in jump.replace("warm restart", "") and "sooner" not in jump, jump
    warm = advise(Finding.LR_SCHEDULE, {"lr_event": "warmup_end", "lr_before": 0.01, "lr_after": 0.3})
    assert "warmup reached its peak (0.01 -> 0.3)" in warm and "lengthen the warmup" in warm, warm
    assert "sooner" not in warm, warm
