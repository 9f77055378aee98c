"""A fit resumed in the middle of an episode (issue 29's fresh runs): the LM of ``_user_models`` (hand-written
attention, exp() of unscaled scores, a 10-step warmup) trained 12 steps, checkpointed, and resumed by a new Trainer
with a new AmpWatch.

Truth, measured on this model with AmpWatch in one uninterrupted fit: the attention overflows float16 from step 9
(the warmup's end), the scaler skipping steps 9, 14 and 16, and ``fp32_island`` cures it. The first fit ends at
step 11, before any alarm. The resumed fit raises the alarm, but its snapshot ring starts at the resume (step 11),
after the onset. Before the fix the replays did not run ("no snapshot from before step 8"), the timing rule named
LR_SCHEDULE, no remedy was applied, and every later loss was NaN (the scale fell to 2**-10). Now the replays run
from the resume's snapshot over the episode's later faults, and the measured cure is applied.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_ampwatch import AmpWatch, Finding
from _user_models import Tape, TinyLM, lm_data, trainer


def _fit(root: Path, steps: int, ckpt: Path | None = None) -> tuple[AmpWatch, Tape, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    watch, tape = AmpWatch(remediate=True, verbose=False, log_dir=str(root)), Tape()
    run = trainer([watch, tape], str(root), steps=steps)
    run.fit(TinyLM(), lm_data(), ckpt_path=None if ckpt is None else str(ckpt))
    return watch, tape, run


def test_a_fit_resumed_mid_episode_replays_from_the_resume_and_applies_the_measured_cure(tmp_path: Path) -> None:
    first, _, run = _fit(tmp_path / "first", 12)
    assert not [d for d in first.diagnoses if d.is_alarm]  # the episode is still open when the first fit ends
    run.save_checkpoint(tmp_path / "k.ckpt")
    second, tape, _ = _fit(tmp_path / "second", 30, tmp_path / "k.ckpt")
    [alarm] = [d for d in second.diagnoses if d.is_alarm and d.outcome is not None]
    ev = alarm.evidence
    assert alarm.finding is Finding.FORWARD_OVERFLOW and alarm.location == "blocks.1.attn"
    assert ev["trajectory_from"].startswith("the snapshot after step 11, taken after the onset at step 9")
    assert "LR/10: not tried (the replays start from the snapshot after step 11, past the onset" in ev["tried"]
    assert ev["cofactors"] == ["the learning rate rose before the onset (0.0006 -> 0.0018 at step 8)"]
    assert alarm.remedy == "fp32_island" and alarm.outcome == "recovered"
    assert all(math.isfinite(v) for v in tape.losses[-8:])  # before the fix: NaN from here to the end


def test_a_snapshot_after_the_onset_stands_in_only_as_far_as_it_can() -> None:
    from types import SimpleNamespace as At

    from lightning_ampwatch.trajectory.judge import after_onset

    held = [At(step=11), At(step=20)]
    # every step from the onset to the snapshot skipped: the state the onset's step ran on
    snapshot, why = after_onset(held, onset=9, alarm_step=16, skipped={9, 10, 11, 13})
    assert snapshot.step == 11 and "the scaler skipped every step from the onset to it" in why
    # a step between went through: only the episode's later faults are in its window
    snapshot, why = after_onset(held, onset=9, alarm_step=16, skipped={9, 13, 16})
    assert snapshot.step == 11 and "over the episode's later faults (steps 13, 16)" in why
    assert after_onset(held, onset=9, alarm_step=16, skipped={9}) is None  # no fault after it: nothing to replay
    assert after_onset([At(step=16)], onset=9, alarm_step=16, skipped={9, 16}) is None  # not before the alarm


def test_a_fit_that_ends_while_a_skip_is_being_judged_is_not_called_healthy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the first 12 steps alone: the attention's first overflow skips step 9, and the fit ends 2 clean steps later,
    # before a skip is judged (the scaler finding its level, or the first sign of a fault). It used to end with
    # "nothing to report. Healthy run."
    pl.seed_everything(0, verbose=False)
    trainer([AmpWatch(log_dir=str(tmp_path))], str(tmp_path), steps=12).fit(TinyLM(), lm_data())
    out = " ".join(capsys.readouterr().out.split())
    assert ("12 optimizer steps, 1 skipped by the scaler (8%), loss scale 2**15 at the end; no alarm, but the fit "
            "ended while the skip at step 9 was still being judged, so it is not called healthy.") in out
    assert "Healthy run" not in out


def test_a_remedy_still_watched_when_the_fit_ended_is_judged_by_the_fit_resumed_after_it(tmp_path: Path) -> None:
    # the glitching-sensor regression: fp32_island is applied at step 9 (rolled back to step 1) and the fit ends 3
    # steps later, "not verified: the run ended". A checkpoint written after that fit used to hold no watch, so the
    # resumed fit kept "not verified" while it trained on with the island; now it judges the remedy
    import _user_models as um

    make, data = um.MODELS["raw_features"]

    def fit(root: Path, steps: int, ckpt: Path | None = None) -> tuple[AmpWatch, pl.Trainer]:
        pl.seed_everything(0, verbose=False)
        watch = AmpWatch(remediate=True, verbose=False, log_dir=str(root))
        run = trainer([watch], str(root), steps=steps)
        run.fit(make(steps=40), data(), ckpt_path=None if ckpt is None else str(ckpt))
        return watch, run

    first, run = fit(tmp_path / "first", 12)
    [alarm] = [d for d in first.diagnoses if d.is_alarm]
    assert (alarm.remedy, alarm.outcome) == ("fp32_island", "not_verified")
    assert alarm.evidence["recovery"]["reason"].startswith("the run ended 3 optimizer steps after the remedy")
    run.save_checkpoint(tmp_path / "after.ckpt")
    second, _ = fit(tmp_path / "second", 24, tmp_path / "after.ckpt")
    [alarm] = [d for d in second.diagnoses if d.is_alarm]
    assert (alarm.finding, alarm.step, alarm.remedy, alarm.outcome) == (Finding.INPUT_RANGE, 8, "fp32_island",
                                                                        "recovered")
