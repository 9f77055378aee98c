"""Diagnose by intervention (issue 30), on models written the way users write them (tests/_user_models.py), in true
float16 on the CPU with a real GradScaler. The truth they are held to was measured without AmpWatch
(``python tests/_user_models.py``): see each test."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

import _user_models as um
from lightning_ampwatch import AmpWatch, Finding, Thresholds
from lightning_ampwatch.scenarios import run_scenario


def _fit(tmp_path: Path, name: str, watch: Any, steps: int, **model_kwargs: Any) -> um.Tape:
    make, data = um.MODELS[name]
    pl.seed_everything(0, verbose=False)
    tape = um.Tape()
    um.trainer([watch, tape], str(tmp_path), steps=steps).fit(make(**model_kwargs), data())
    return tape


def _alarms(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.is_alarm]


# ---------------------------------------------------------------------------------------------------------------
# The LM whose attention computes exp() of unscaled q @ k.T, after a 10-step warmup.
# Truth (fp32 vs fp16, 128 steps): FP32 3.70 -> 0.001; fp16 skips from step 9 and goes NaN from step 16, with the
# warmup and without it (NaN from 14); at the peak LR / 10 it still overflows, only later (NaN from step 99).
# ---------------------------------------------------------------------------------------------------------------


def test_an_overflow_after_a_warmup_is_the_attentions_with_the_lr_rise_as_a_co_factor(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, "lm", watch, steps=17)
    [d] = _alarms(watch)
    ev = d.evidence
    # before: "LR_SCHEDULE at 9 ... Lower the peak learning rate or lengthen the warmup", beside "control finite"
    assert d.finding is Finding.FORWARD_OVERFLOW
    assert re.fullmatch(r"blocks\.[01]\.attn", d.location or "")
    assert ev["cofactors"] and "learning rate rose" in ev["cofactors"][0]
    assert "co-factor" in ev["control_verdict"] and "keeps shrinking" in ev["control_verdict"]
    # one line per intervention tried, each with what it did
    tried = ev["tried"]
    assert tried.startswith("tried from step ")
    assert "fp32 island on 2 ExpSelfAttention modules (blocks.0.attn, blocks.1.attn): 0 skips" in tried
    assert "FP32: 0 skips" in tried and "LR/10: 0 skips" in tried and "(only delays it" in tried
    cured = ev["interventions"]["cured_by"]
    assert cured[0] == "fp32_island" and "lower_lr" not in cured  # a lower LR only delays it: no cure
    assert "Lower the peak learning rate" not in d.advice


def test_remediate_true_puts_every_attention_block_in_float32_and_the_run_trains_on(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True)
    tape = _fit(tmp_path, "lm", watch, steps=30)
    [d] = _alarms(watch)
    # before: nothing was applied (LR_SCHEDULE's only rung, reduce_lr, is not in remediate=True) and the run died
    assert d.remedy == "fp32_island"
    assert d.evidence["remedy_details"]["modules"] == ["blocks.0.attn", "blocks.1.attn"]
    applied_at = watch.applied[0].step
    assert all(math.isfinite(v) for v in tape.losses[applied_at:])
    assert not [s for s in tape.skips() if s >= applied_at]
    assert tape.losses[-1] < 0.6 * tape.losses[0]
    assert not [x for x in _alarms(watch) if x is not d]  # the next block does not overflow the same way


# ---------------------------------------------------------------------------------------------------------------
# The regression with a summed MSE in float32 and targets up to 1.8e4.
# Truth (fp16, 128 steps): 23 skips from the start (0..22), then the scaler sits at 2**-7 and never skips again.
# ---------------------------------------------------------------------------------------------------------------


def test_the_safe_scale_is_measured_over_the_window_and_holds_for_the_next_ten_steps(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _fit(tmp_path / "watched", "regression", watch, steps=26)
    [d] = _alarms(watch)
    ev = d.evidence
    # before: INPUT_RANGE on "values up to 1.49e+04 in batch[1]": the targets, which only a float32 loss sees
    assert d.finding is Finding.GRADIENT_OVERFLOW
    assert "batch[1]" in ev["input_not_in_reduced_precision"]
    assert "batch[1]" not in ev["reduced_precision_inputs"]
    safe = ev["safe_scale"]
    assert "the largest loss scale that replayed steps" in ev["safe_scale_from"]
    assert f"GradScaler(init_scale={_pow2(safe)})" in d.advice
    assert "no scaler setting can help" not in d.advice
    # the scale the replays found holds in a real run: 10 steps from the start at it, none skipped
    pl.seed_everything(0, verbose=False)
    tape = um.Tape()
    plugin = um.fp16_plugin(init_scale=safe)
    pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path / "fresh"),
               plugins=[plugin], callbacks=[tape]).fit(um.SummedMse(), um.regression_targets())
    assert tape.scales == [safe] * 10, tape.scales
    # and it is the largest that does: twice it skipped in the replays
    assert [safe * 2, False] in ev["interventions"]["scales_tried"]


def test_the_lower_scale_remedy_sets_the_measured_scale_and_the_run_stops_skipping(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, remediate=True)
    tape = _fit(tmp_path, "regression", watch, steps=24)
    [d] = _alarms(watch)
    assert d.remedy == "lower_init_scale"
    applied_at = watch.applied[0].step
    assert d.evidence["remedy_details"]["scale_after"] == d.evidence["safe_scale"]
    assert not [s for s in tape.skips() if applied_at <= s < applied_at + 10]  # it holds for the next 10 steps
    assert d.outcome == "recovered", d.evidence.get("recovery")


def test_the_replay_step_cap_bounds_an_alarm_and_says_what_it_left_out(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, thresholds=Thresholds(replay_steps=20))
    _fit(tmp_path, "lm", watch, steps=17)
    [d] = _alarms(watch)
    info = d.evidence["interventions"]
    assert info["replayed_steps"] <= 20 and info["replay_step_cap"] == 20
    assert any("replay-step cap of 20" in why for why in info["not_tried"].values())


def _pow2(value: float) -> str:
    return f"2**{int(math.log2(value))}"


def test_a_lower_lr_that_only_delays_the_overflow_is_taken_back_as_relapsed_when_it_returns(tmp_path: Path) -> None:
    """remediate=["reduce_lr"]: the replays measured that a lower LR trains clean over the window but only delays
    the attention's overflow (the island and bf16 cure it, and are not allowed). The LR ceiling holds it off for a
    while; when the same fault comes back, at any later step, the recovery is taken back."""
    from lightning_ampwatch.summary import remedy_outcome

    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], log_dir=str(tmp_path / "logs"))
    _fit(tmp_path, "lm", watch, steps=64)
    first, *later = _alarms(watch)
    assert first.finding is Finding.FORWARD_OVERFLOW and first.remedy == "reduce_lr"
    assert later and later[0].finding is Finding.FORWARD_OVERFLOW and later[0].step > first.step + 8
    # re-opened: the record, the summary line and the event log say "relapsed", never "verified" beside it
    assert first.outcome == "relapsed"
    recovery = first.evidence["recovery"]
    assert recovery["relapsed_at"] == later[0].step and "taken back" in recovery["reason"]
    said = remedy_outcome(first)
    assert said.startswith("reduce_lr applied, relapsed") and "verified" not in said
    import json
    logged = [json.loads(line) for line in (tmp_path / "logs" / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()]
    latest = [e for e in logged if e.get("finding") == "FORWARD_OVERFLOW" and e.get("step") == first.step][-1]
    assert latest["outcome"] == "relapsed"


# ---------------------------------------------------------------------------------------------------------------
# BackboneFinetuning unfreezes a backbone at step 40 as a new param group at an LR of 1.0 (the head's: 1e-3).
# Truth (60 steps): FP32's loss goes 5.18 -> 659 -> 1263 at steps 40-42 (244x); fp16's 5.18 -> 628 (121x), with
# skips from step 41 on.
# ---------------------------------------------------------------------------------------------------------------


def test_a_param_group_added_at_a_far_higher_lr_is_looked_at_before_the_scaler(tmp_path: Path) -> None:
    make, data = um.MODELS["finetune"]
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    um.trainer([watch, um.backbone_finetuning()], str(tmp_path), steps=48).fit(make(), data())
    first = _alarms(watch)[0]
    # before: GRADIENT_OVERFLOW at 41 in head.weight, and LR_SCHEDULE only at 45
    assert first.finding is Finding.LR_SCHEDULE and first.step == 41
    ev = first.evidence
    assert ev["lr_event"] == "param_group_added" and ev["lr_after"] == 1.0 and ev["lr_before"] == pytest.approx(1e-3)
    assert "a param group was added at a far higher learning rate" in first.advice
    assert "an AMP fault" not in ev["control_verdict"]
    # the snapshot before it holds one param group fewer: no replay from it can stand for the run, and none is made
    assert "gained a param group" in ev["trajectory_control"]


def test_a_compiled_block_is_replayed_islanded_and_named_by_the_users_path(tmp_path: Path) -> None:
    """torch.compile'd blocks (the eager backend: inductor compiles too slowly for a test here). Before: the replay's
    hooks broke the compiled graph, the replay was called an internal error and the overflow got no location, or
    was placed in ``blocks.1._orig_mod``."""
    import json

    class CompiledBlocks(um.TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.compile(b, backend="eager") for b in self.blocks])

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=True)
    tape = um.Tape()
    model = CompiledBlocks()
    um.trainer([watch, tape], str(tmp_path), steps=24).fit(model, um.lm_data())
    [d] = _alarms(watch)
    assert d.finding is Finding.FORWARD_OVERFLOW and d.location == "blocks.1.attn"
    assert d.remedy == "fp32_island" and d.evidence["remedy_details"]["modules"] == ["blocks.0.attn", "blocks.1.attn"]
    assert "_orig_mod" not in json.dumps(d.to_dict(), default=str)
    assert type(model.blocks[0]).__name__ == "OptimizedModule"  # put back after the replays
    applied_at = watch.applied[0].step
    assert all(math.isfinite(v) for v in tape.losses[applied_at:])


# ---------------------------------------------------------------------------------------------------------------
# Targets up to 1.5e5 that the float16 output must reach. Truth (40 steps): FP32 56.3 -> 0.113; fp16 inf from step 2
# on, 38 of 40 steps skipped.
# ---------------------------------------------------------------------------------------------------------------


def test_a_run_broken_from_its_second_step_is_verified_against_what_its_cure_reached(tmp_path: Path) -> None:
    """No healthy level exists before the episode (step 2). Before: "recovery not verified". Now the episode's
    replays, run through a few steps past the onset, give a reference that trained down decisively."""
    watch = AmpWatch(verbose=False, remediate=["bf16_fallback"])
    tape = _fit(tmp_path, "big_targets", watch, steps=24)
    [d] = _alarms(watch)
    assert d.finding is Finding.FORWARD_OVERFLOW and d.remedy == "bf16_fallback"
    assert d.evidence["interventions"]["cured_by"][:2] == ["fp32_island", "bf16"]
    assert d.outcome == "recovered"
    recovery = d.evidence["recovery"]
    assert "fell decisively" in recovery["loss_before_from"] and recovery["loss_ratio"] <= 2.0
    applied_at = watch.applied[0].step
    assert all(math.isfinite(v) for v in tape.losses[applied_at:])


def test_where_fp32_fails_too_no_precision_fix_spends_the_replay_cap(tmp_path: Path) -> None:
    # the lr_schedule demo: an LR raised 40x at step 30 diverges in FP32 too; only the lower LR can cure it, so the
    # island, the loss-scale search and bf16 are not replayed (they used to spend the cap on a scale search)
    watch = AmpWatch(verbose=False, log_dir=str(tmp_path / "log"))
    run_scenario("lr_schedule", str(tmp_path), watch)
    [alarm] = [d for d in watch.diagnoses if d.finding is Finding.LR_SCHEDULE]
    tried = alarm.evidence["tried"]
    assert "LR capped at 0.02 (before the rise): 0 skips" in tried
    assert "fp32 island, lower loss scale, bf16: not tried (FP32 training fails over the same steps" in tried
    assert "2**" not in tried and "replay-step cap" not in tried
