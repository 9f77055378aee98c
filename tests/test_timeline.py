"""The per-step timeline: bounded for long runs, buffered (written only at log steps and fit end), readable back,
and the end-of-fit console summary built from the same run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_ampwatch import AmpWatch, Diagnosis, Finding
from lightning_ampwatch.scenarios import SCENARIOS, build_trainer
from lightning_ampwatch.summary import RunStats, summary_lines
from lightning_ampwatch.timeline import TIMELINE_NAME, Timeline, read_timeline

from conftest import FileSizes


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------------------- the recorder, on synthetic steps


def test_long_run_stays_small_and_keeps_every_anomalous_step(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_NAME
    timeline = Timeline(path, precision="fp16", healthy_rows_per_level=64, max_buffered_rows=10**9)
    anomalous = set(range(1000, 200_000, 997)) | {150_000, 150_001, 150_002}
    scale = 2.0**16
    for step in range(200_000):
        skipped = step in anomalous
        timeline.record_step(step, skipped=skipped, scale=scale, loss=1.0 if skipped else None,
                             loss_finite=True if skipped else None, lrs=(1e-3,))
        if skipped:
            scale /= 2
        elif step % 5000 == 4999:
            scale *= 2  # a growth now and then
    assert not path.exists(), "rows must stay in memory until a flush"
    timeline.flush()

    written = rows(path)
    steps = [r for r in written if "event" not in r]
    kept = {r["step"] for r in steps}
    assert anomalous <= kept, "an anomalous step was dropped"
    assert {r["step"] for r in steps if r.get("skipped")} == anomalous
    healthy = len(steps) - len(anomalous)
    # 64 rows per level, log2(200000 / 64) ~ 12 levels, plus the rows beside each anomaly and each growth
    assert healthy < 64 * 13 + 3 * len(anomalous) + 2 * 40, f"{healthy} healthy rows kept for 200k steps"
    assert len(steps) < 200_000 / 50
    assert written[0] == {"event": "start", "step": 0, "format": 1, "precision": "fp16"}
    # the plot can draw where each episode began and ended: the clean steps beside it are there
    assert {1000 - 1, 1000 + 1} <= kept
    # LRs are written once while they do not change
    assert sum(1 for r in steps if "lrs" in r) == 1


def test_buffer_flushes_by_itself_when_log_steps_never_come(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_NAME
    timeline = Timeline(path, max_buffered_rows=10)
    for step in range(8):
        timeline.record_step(step, skipped=True, scale=1.0)
    assert not path.exists()  # the start event and eight steps: nine rows buffered
    timeline.record_step(8, skipped=True, scale=1.0)
    assert len(rows(path)) == 10


def test_loss_read_at_a_log_step_keeps_that_row(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_NAME
    timeline = Timeline(path, healthy_rows_per_level=1)  # stride doubles at once: most healthy rows are dropped
    reads: list[int] = []
    for step in range(40):
        timeline.record_step(step, skipped=False, scale=8.0, lrs=(0.1,))
    timeline.flush(read_last_loss=lambda: reads.append(1) or 0.25)
    timeline.flush(read_last_loss=lambda: reads.append(1) or 0.5)  # nothing new: no second read
    assert reads == [1]
    last = rows(path)[-1]
    assert last == {"step": 39, "scale": 8.0, "loss": 0.25, "loss_finite": True}


def test_events_and_non_finite_losses_round_trip(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_NAME
    timeline = Timeline(path, precision="fp16")
    timeline.record_step(0, skipped=False, scale=4.0, lrs=(0.1, 0.01))
    timeline.record_step(1, skipped=True, scale=4.0, loss=math.nan, loss_finite=False, lrs=(0.1, 0.01))
    timeline.record_diagnosis(Diagnosis(Finding.FORWARD_OVERFLOW, 1, location="encoder.0"))
    timeline.record_remedy(1, "fp32_island")
    timeline.record_step(2, skipped=False, scale=2.0, lrs=(0.2, 0.02))
    timeline.record_end(steps=3, skipped=1, nonfinite=1, scale=2.0)
    timeline.flush()
    assert '"loss":"nan"' in path.read_text()  # strict JSON: no bare NaN
    data = read_timeline(path)
    assert data.steps == [0, 1, 2]
    assert data.skipped == [False, True, False]
    assert data.loss_finite == [None, False, None]
    assert math.isnan(data.losses[1])
    assert data.lrs == [(0.1, 0.01), (0.1, 0.01), (0.2, 0.02)]
    assert data.precision == "fp16"
    assert data.of_kind("diagnosis") == [{"event": "diagnosis", "step": 1, "finding": "FORWARD_OVERFLOW",
                                          "location": "encoder.0", "seen_at": 1}]
    assert data.of_kind("remedy") == [{"event": "remedy", "step": 1, "name": "fp32_island"}]
    assert data.of_kind("end")[0]["steps"] == 3


def test_a_reused_directory_reads_as_its_last_run_and_a_resume_as_one(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_NAME
    for start, stop in ((0, 5), (0, 3), (3, 6)):  # a run, a fresh run in the same directory, its resume
        timeline = Timeline(path)
        for step in range(start, stop):
            timeline.record_step(step, skipped=False, scale=1.0)
        timeline.flush()
    data = read_timeline(path)
    assert data.steps == [0, 1, 2, 3, 4, 5]
    assert data.earlier_runs == 1


@pytest.mark.parametrize("line, why", [
    ("{not json", "line 3 is not valid JSON: at column 2, a key in double quotes was expected here"),
    ('{"scale": 2.0}', "integer 'step'"),
    ('{"step": 3, "loss": [1]}', "not a number"),
])
def test_malformed_timeline_names_the_file_and_line(tmp_path: Path, line: str, why: str) -> None:
    path = tmp_path / TIMELINE_NAME
    path.write_text('{"event":"start","step":0,"format":1}\n{"step":0,"scale":2.0}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"{TIMELINE_NAME}:3: not an AmpWatch timeline row .*{why}"):
        read_timeline(path)


def test_binary_file_is_rejected_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_NAME
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    with pytest.raises(ValueError, match=rf"{TIMELINE_NAME}: not an AmpWatch timeline \(not UTF-8"):
        read_timeline(path)


def test_a_timeline_without_a_path_records_nothing() -> None:
    timeline = Timeline(None)  # every rank but zero
    timeline.record_step(0, skipped=True, scale=1.0)
    timeline.record_remedy(0, "lower_init_scale")
    timeline.flush(read_last_loss=lambda: pytest.fail("rank > 0 must not read the loss"))
    assert not timeline.enabled and timeline.rows_kept == 0


# ---------------------------------------------------------------------------- in a real fp16 run


@pytest.fixture(scope="module")
def lr_schedule_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[AmpWatch, Path, FileSizes, str]:
    """The learning rate jumps 40x at step 30 and fp16 overflows after it: 60 real steps, logs every 10."""
    import contextlib
    import io

    root = tmp_path_factory.mktemp("lr_schedule")
    watch = AmpWatch()
    sizes = FileSizes(root / "ampwatch" / TIMELINE_NAME)
    scenario = SCENARIOS["lr_schedule"]
    pl.seed_everything(0, verbose=False)
    trainer = build_trainer(scenario, [watch, sizes], str(root))
    console = io.StringIO()
    with contextlib.redirect_stdout(console):
        trainer.fit(scenario.model(), scenario.dataloader())
    return watch, root, sizes, console.getvalue()


def test_real_run_timeline_matches_what_the_watch_saw(lr_schedule_run: tuple[AmpWatch, Path, FileSizes, str]) -> None:
    watch, root, _, _ = lr_schedule_run
    data = read_timeline(root / "ampwatch" / TIMELINE_NAME)
    assert watch.machine is not None
    assert data.steps == sorted(set(data.steps)) and data.steps[0] == 0
    at = {step: i for i, step in enumerate(data.steps)}  # healthy stretches are sampled; these steps are kept:
    assert sum(data.skipped) == watch.machine.skipped_total > 0  # every anomalous step
    assert sum(1 for f in data.loss_finite if f is False) == watch.machine.nonfinite_total
    assert 30 in at and data.lrs[at[30]] == pytest.approx((0.8,))  # the 40x jump (an LR move is kept) ...
    assert data.lrs[at[30] - 1] == (0.02,)  # ... after the LR before it
    scales = [s for s in data.scales if s is not None]
    assert scales[0] == 2.0**16 and scales[-1] < 1  # the collapse after the jump
    first_skip = data.steps[data.skipped.index(True)]
    assert first_skip - 1 in at and first_skip + 1 in at  # the steps around an anomaly are kept
    assert data.scales[at[first_skip + 1]] == data.scales[at[first_skip]] / 2  # each skip halves the scale
    read = [s for s, loss in zip(data.steps, data.losses) if loss is not None and not data.skipped[at[s]]]
    assert read and all(s % 10 == 9 for s in read), f"healthy losses are read at log steps only, got {read}"
    assert [e["finding"] for e in data.of_kind("diagnosis")] == [d.finding.value for d in watch.diagnoses]
    end = data.of_kind("end")[-1]
    assert (end["steps"], end["skipped"]) == (60, watch.machine.skipped_total)


def test_real_run_writes_the_timeline_only_at_log_steps_and_fit_end(
        lr_schedule_run: tuple[AmpWatch, Path, FileSizes, str]) -> None:
    _, root, sizes, _ = lr_schedule_run
    grew_at = [step for (step, size), (_, before) in zip(sizes.sizes[1:], sizes.sizes) if size != before]
    if sizes.sizes[0][1]:
        grew_at.insert(0, sizes.sizes[0][0])
    assert grew_at == [10, 20, 30, 40, 50, 60], f"the file changed after steps {grew_at}"
    assert (root / "ampwatch" / TIMELINE_NAME).stat().st_size > sizes.sizes[-1][1]  # and once more at fit end


def test_end_of_fit_summary_says_what_happened(lr_schedule_run: tuple[AmpWatch, Path, FileSizes, str]) -> None:
    watch, root, _, printed = lr_schedule_run
    summary = printed[printed.index("AmpWatch summary"):].splitlines()
    assert watch.machine is not None
    assert summary[0].startswith(f"AmpWatch summary: 60 optimizer steps, {watch.machine.skipped_total} skipped by "
                                 "the scaler")
    assert "1 alarm." in summary[0]
    assert summary[1].split()[:3] == ["step", "31", "LR_SCHEDULE"]
    assert "not fixed" in summary[1]
    assert f"ampwatch report {root} --plot timeline.png" in summary[2]


def test_healthy_run_summary_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scenario = SCENARIOS["healthy"]
    pl.seed_everything(0, verbose=False)
    trainer = build_trainer(scenario, [AmpWatch()], str(tmp_path), max_steps=12, plugins=None,
                            precision="32-true")
    trainer.fit(scenario.model(), scenario.dataloader())
    out = [line for line in capsys.readouterr().out.splitlines() if "AmpWatch" in line]
    assert out == ["AmpWatch: 12 optimizer steps; nothing to report. Healthy run."]


def test_summary_lines_for_normal_scaling_and_a_fixed_alarm() -> None:
    normal = [Diagnosis(Finding.NORMAL_SCALING, 28)]
    assert summary_lines(normal, RunStats(60, skipped=3, scale=2.0**14)) == [
        "AmpWatch: 60 optimizer steps, 3 skipped by the scaler (5%), loss scale 2**14 at the end; the skips were "
        "the scaler finding its level. Healthy run."]
    fixed = [Diagnosis(Finding.GRADIENT_OVERFLOW, 0, remedy="lower_init_scale", outcome="recovered"),
             Diagnosis(Finding.FORWARD_OVERFLOW, 30, remedy="bf16_fallback", outcome="not_recovered",
                       evidence={"recovery": {"reason": "the NaNs are gone, but the loss is 390x the loss level "
                                                        "before the episode (351 against 0.9)"}}),
             Diagnosis(Finding.GROWTH_OVERFLOW, 50, remedy="slow_growth"),
             Diagnosis(Finding.INPUT_RANGE, 55, remedy="bf16_fallback",
                       evidence={"recovery": {"reason": "a GROWTH_OVERFLOW alarm at step 57 was treated before this "
                                                        "remedy could be judged"}})]
    lines = summary_lines(fixed, RunStats(60, skipped=6, scale=2.0**10), log_dir="/runs/a")
    assert lines[1] == "  step      0  GRADIENT_OVERFLOW (fixed with lower_init_scale, recovery verified)"
    assert lines[2] == ("  step     30  FORWARD_OVERFLOW (bf16_fallback applied, not fixed: the NaNs are gone, but the "
                        "loss is 390x the loss level before the episode (351 against 0.9))")
    assert lines[3] == "  step     50  GROWTH_OVERFLOW (slow_growth applied; recovery not verified (the run ended first))"
    assert lines[4] == ("  step     55  INPUT_RANGE (bf16_fallback applied; recovery not verified: a GROWTH_OVERFLOW "
                        "alarm at step 57 was treated before this remedy could be judged)")
    assert lines[5].endswith("ampwatch report /runs/a --plot timeline.png")


def test_a_fault_that_recurs_every_few_batches_is_one_row_and_a_count_in_the_summary() -> None:
    glitch = [Diagnosis(Finding.INPUT_RANGE, s, location="net.0") for s in range(8, 400, 9)]  # 44 alarms
    other = Diagnosis(Finding.FORWARD_OVERFLOW, 100, location="attn", remedy="fp32_island", outcome="recovered")
    lines = summary_lines([*glitch, other], RunStats(400, skipped=45, scale=2.0**-29))
    assert lines[0].endswith("; 45 alarms.")
    # the rows in step order: the run broken by another finding's row is two runs; two alike in a row stay two rows
    assert lines[1:] == [
        "  step      8  INPUT_RANGE in net.0 (not fixed: see the advice above)",
        "               and 10 more alike, at steps 17, 26, 35, 44, 53, ..., 98",
        "  step    100  FORWARD_OVERFLOW in attn (fixed with fp32_island, recovery verified)",
        "  step    107  INPUT_RANGE in net.0 (not fixed: see the advice above)",
        "               and 32 more alike, at steps 116, 125, 134, 143, 152, ..., 395"]
    pair = summary_lines(glitch[:2], RunStats(20, skipped=2))
    assert pair[1:] == ["  step      8  INPUT_RANGE in net.0 (not fixed: see the advice above)",
                        "  step     17  INPUT_RANGE in net.0 (not fixed: see the advice above)"]


def test_a_cut_short_last_line_is_left_out_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / TIMELINE_NAME
    path.write_text('{"event":"start","step":0,"format":1}\n{"step":0,"scale":2.0}\n{"step":1,"sc')
    with pytest.warns(RuntimeWarning, match=rf"{TIMELINE_NAME}:3: the last line is cut short"):
        data = read_timeline(path)
    assert data.steps == [0]
    path.write_text('{"event":"start","step":0,"format":1}\n{"step":0,"sc\n{"step":1,"scale":2.0}')
    with pytest.raises(ValueError, match=rf"{TIMELINE_NAME}:2: not an AmpWatch timeline row"):
        read_timeline(path)  # a bad line with a line after it is damage, not an interrupted write
