"""A fault that recurs without a remedy: raw sensor features (columns in the thousands) where a glitching sensor
writes 1e5 into one row of every 9th batch, AdamW after a 5-step warmup (tests/_user_models.py ``raw_features``), in
true float16 on the CPU with a real GradScaler.

Truth, measured without AmpWatch (30 steps): FP32 trains clean, 1.18 -> 0.24. Under float16 the scaler lowers its
first scale at steps 0-2 (finite losses: finding its level), the steps 3-7 are clean, and the losses of steps 8, 17
and 26, the glitched batches, are inf (the first Linear's input cast overflows), each skipped; the run otherwise
trains as FP32 does (0.26 at step 29)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest

import _user_models as um
from lightning_ampwatch import AmpWatch, Finding


def _fit(tmp_path: Path, watch: AmpWatch, steps: int = 30) -> None:
    make, data = um.MODELS["raw_features"]
    pl.seed_everything(0, verbose=False)
    um.trainer([watch], str(tmp_path), steps=steps).fit(make(steps=steps), data())


def test_a_glitched_batch_after_the_warmup_is_input_range_at_its_own_step(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, log_dir=str(tmp_path))
    _fit(tmp_path, watch, steps=12)
    [alarm] = [d for d in watch.diagnoses if d.is_alarm]
    # before: dated at step 0 (the scaler's start-up skips chained to it) and named LR_SCHEDULE then
    # FORWARD_OVERFLOW by the warmup's timing, "whose values keep growing with training"
    assert alarm.finding is Finding.INPUT_RANGE and alarm.step == 8 and alarm.location == "net.0"
    ev = alarm.evidence
    assert ev["input_absmax"] == pytest.approx(1e5)
    assert "stopped at the fault at step 8" in ev["tried"]  # the replay stops at the glitch, not a start-up skip
    assert ev["cofactors"] and "learning rate rose" in ev["cofactors"][0]  # the warmup, beside it
    assert "growing with training" not in json.dumps(ev)


def test_a_recurring_fault_is_replayed_once_and_printed_once(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch(log_dir=str(tmp_path))
    _fit(tmp_path, watch)
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert [(d.finding, d.step, d.location) for d in alarms] == [(Finding.INPUT_RANGE, s, "net.0") for s in (8, 17, 26)]
    first, *again = alarms
    assert first.evidence["tried"].startswith("tried from step ")
    for d in again:  # not replayed again: the same finding in the same place, confirmed, no remedy since
        assert "tried" not in d.evidence
        assert d.evidence["trajectory_control"].startswith(
            "not run again: the replays of the alarm at step 8 named this finding")
    # the event log keeps every record; the console shows one panel and a line for each recurrence
    logged = [json.loads(line) for line in (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()]
    assert [(r["finding"], r["step"]) for r in logged if r["finding"] == "INPUT_RANGE"] == \
        [("INPUT_RANGE", s) for s in (8, 17, 26)]
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("AmpWatch: INPUT_RANGE at step") == 1
    assert "AmpWatch: INPUT_RANGE again at step 17 in net.0 (the 2nd time this run; see the panel at step 8;" in out
    assert "INPUT_RANGE again at step 26 in net.0 (the 3rd time this run;" in out


# ---------------------------------------------------------------------------------------------------------------
# An HF-style encoder whose padding mask adds (1 - mask) * -1e9 in the scores' dtype (tests/_user_models.py
# ``pad_mask``), a 6-step warmup. Truth, measured without AmpWatch (60 steps): FP32 finite throughout; float16 NaN
# at steps 10, 21, 32, 43, 54 exactly (the batches holding an empty text: -1e9 is -inf in float16, and a row of
# -inf has a NaN softmax), each skipped, and no other skip.
# ---------------------------------------------------------------------------------------------------------------


def test_a_fault_the_replays_renamed_is_not_replayed_at_its_recurrences(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch(log_dir=str(tmp_path))
    make, data = um.MODELS["pad_mask"]
    pl.seed_everything(0, verbose=False)
    um.trainer([watch], str(tmp_path), steps=60).fit(make(), data())
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    # the first comes right after the warmup: timed as LR_SCHEDULE, the replays name it (LR/10 brings it back)
    assert [(d.finding, d.step) for d in alarms] == [(Finding.FORWARD_OVERFLOW, s) for s in (10, 21, 32, 43, 54)]
    assert {d.location for d in alarms} == {"attn.0"}
    assert "does not prevent" in alarms[0].evidence["control_verdict"]
    # its replays named FORWARD_OVERFLOW in attn.0: the recurrences, named so, are not replayed (before: the first
    # rename kept step 21 replayed, and the console printed a second panel at step 32)
    for d in alarms[1:]:
        assert d.evidence["trajectory_control"].startswith("not run again: the replays of the alarm at step 10")
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("AmpWatch: FORWARD_OVERFLOW at step") == 1
    assert [f"again at step {s} in attn.0 (the {n} time" in out for s, n in ((21, "2nd"), (32, "3rd"), (43, "4th"),
                                                                              (54, "5th"))] == [True] * 4


# ---------------------------------------------------------------------------------------------------------------
# Multi-label tagging with BCE written by hand (tests/_user_models.py ``hand_bce``), AdamW after a 5-step warmup.
# Truth, measured without AmpWatch (80 steps): FP32 finite, 0.78 -> 0.41. Float16 NaN at 21 steps from step 20 on
# (20, 22, 33, 34, 37, ...: the sigmoid rounds to 1, log(1 - p) is -inf), each skipped by the scaler, which keeps the
# weights clean: the run ends at 0.43.
# ---------------------------------------------------------------------------------------------------------------


def test_a_recurrence_is_remedied_only_by_what_the_replays_measured_and_the_run_float16_kept_alive_lives(
        tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True, log_dir=str(tmp_path))
    make, data = um.MODELS["hand_bce"]
    pl.seed_everything(0, verbose=False)
    tape, model = um.Tape(), make()
    um.trainer([watch, tape], str(tmp_path), steps=80).fit(model, data())
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert [(d.finding, d.location) for d in alarms][:2] == [(Finding.FORWARD_OVERFLOW, "HandBce.training_step")] * 2
    # the replays at step 20: FP32 and LR/10 cure it, no precision fix was measured to; remediate=True leaves out
    # reduce_lr, so no remedy, at the alarm or at any recurrence (before: bf16_fallback, never replayed, was applied
    # at a later alarm; bfloat16 rounds the sigmoid to 1 as well, and with no scaler the NaN reached the weights)
    assert alarms[0].evidence["interventions"]["cured_by"] == ["lower_lr"]
    assert watch.applied == [] and all(d.remedy is None for d in alarms)
    assert alarms[1].evidence["trajectory_control"].startswith("not run again: the replays of the alarm at step 20")
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    assert math.isfinite(tape.losses[-1]) and tape.losses[-1] < 0.6 * tape.losses[0]


def test_the_island_that_cured_the_replays_is_judged_against_fp32_after_as_many_steps(tmp_path: Path) -> None:
    # remediate=True: the replays from the snapshot after step 0 (steps 1-16) measured fp32_island curing the glitch,
    # and the remedy rolls back to that snapshot. The remedied run is judged on its first 8 steps from there. Before:
    # against where the 16-step FP32 window ended (0.28), 'not recovered' at 0.77, then bf16_fallback with a second
    # rollback, 'not recovered' again; FP32's own first 8 steps from that state average 0.84
    watch = AmpWatch(remediate=True, verbose=False, log_dir=str(tmp_path))
    _fit(tmp_path, watch, steps=24)
    [alarm] = [d for d in watch.diagnoses if d.is_alarm and d.outcome is not None]
    assert alarm.finding is Finding.INPUT_RANGE and alarm.remedy == "fp32_island"
    recovery = alarm.evidence["recovery"]
    assert alarm.outcome == "recovered", recovery["reason"]
    assert recovery["loss_before_from"].startswith("what FP32 reached over its first 8 steps from the same snapshot")
    assert recovery["loss_before"] > 2 * alarm.evidence["trajectory_fp32_losses"][-1]  # not the window's end
    assert [a.name.value for a in watch.applied] == ["fp32_island"]  # no escalation to bf16
