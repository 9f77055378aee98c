"""What a user reads after a bad run (issue 33): a plot that draws only what was measured, a report that never hides
a lost record, errors that say what is wrong in plain words, and panels in plain words. Real runs of the demo
scenarios (true float16 on the CPU); the plot checked from the figure's artists, the rest as printed."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import numpy as np
import pytest
from rich.console import Console

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.cli import _say_recovery, main
from lightning_ampwatch.remedies.base import RemedyName
from lightning_ampwatch.report import load_run, locate_run, timeline_figure
from lightning_ampwatch.reporters import ALWAYS_SHOWN, EVIDENCE_LABELS, KEY_EVIDENCE, panel_rows
from lightning_ampwatch.scenarios import SCENARIOS, run_scenario

Run = tuple[AmpWatch, str, Path]  # the watch, what it printed, the run directory


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """``ampwatch demo SCENARIO --remediate`` as the CLI runs it (every remedy, twice the steps, the default compact
    panels), each scenario run once for the module."""
    runs: dict[str, Run] = {}

    def run(name: str) -> Run:
        if name not in runs:
            root = tmp_path_factory.mktemp(name)
            pl.seed_everything(0, verbose=False)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                watch = run_scenario(name, str(root), AmpWatch(remediate="all"),
                                     max_steps=SCENARIOS[name].max_steps * 2)
            runs[name] = (watch, out.getvalue(), root)
        return runs[name]

    return run


def report(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", *argv])
    return code, out.getvalue(), err.getvalue()


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


# ---------------------------------------------------------------------------- the timeline plot


def figure_of(root: Path, extra: Callable[[list[Any], Any], list[Any]] | None = None) -> tuple[Any, Any, list[Any]]:
    diagnoses, timeline = load_run(locate_run(root))
    shown = list(diagnoses.shown) if extra is None else extra(list(diagnoses.shown), timeline)
    fig = timeline_figure(timeline, shown)
    fig.draw_without_rendering()
    return fig, timeline, shown


def loss_axes(fig: Any) -> Any:
    return next(ax for ax in fig.axes if ax.get_ylabel().startswith("loss") and ax.get_ylabel() != "loss scale")


def test_the_loss_is_drawn_only_where_it_was_read(demo: Callable[[str], Run]) -> None:
    """A marker at each step whose loss was read, and no line across the steps between reads."""
    fig, timeline, _ = figure_of(demo("lr_schedule")[2])
    read = {s for s, v in zip(timeline.steps, timeline.losses) if v is not None and math.isfinite(v)}
    span = timeline.steps[-1] - timeline.steps[0] + 1
    assert 2 <= len(read) < span / 2, "the run reads its loss at every step: the test shows nothing"
    lines = [line for line in loss_axes(fig).get_lines() if str(line.get_label()).startswith("loss")]
    assert lines
    drawn: set[int] = set()
    for line in lines:
        assert line.get_marker() not in (None, "None", "", " "), "measured points are markers"
        x = np.asarray(line.get_xdata(), dtype=float)
        drawn |= {int(v) for v in x[np.isfinite(x)]}
        if line.get_linestyle() not in ("None", "", " "):
            for a, b in zip(x, x[1:]):
                if np.isfinite(a) and np.isfinite(b):
                    assert b - a == 1, f"a line is drawn from step {a:g} to step {b:g}, across steps not read"
    assert drawn == read


def test_the_loss_axis_says_how_often_the_loss_was_read(demo: Callable[[str], Run]) -> None:
    fig, timeline, _ = figure_of(demo("lr_schedule")[2])
    label = loss_axes(fig).get_ylabel()
    read = [s for s, v in zip(timeline.steps, timeline.losses) if v is not None]
    span = timeline.steps[-1] - timeline.steps[0] + 1
    every = re.search(r"\(read every (\d+) steps\)", label)
    at = re.search(r"\(read at (\d+) of (\d+) steps\)", label)
    assert every or at, label
    if every:
        assert {b - a for a, b in zip(read, read[1:])} == {int(every.group(1))}, label
    else:
        assert at is not None and (int(at.group(1)), int(at.group(2))) == (len(read), span), label


def test_no_legend_covers_a_curve(demo: Callable[[str], Run]) -> None:
    fig, _, _ = figure_of(demo("lr_schedule")[2])
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    assert len(legends) >= 3  # loss scale, loss, and the markers' kinds
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), \
                f"the legend {[t.get_text() for t in legend.get_texts()]} covers the panel {ax.get_ylabel()!r}"


def test_marker_labels_are_never_cut_off(demo: Callable[[str], Run]) -> None:
    """An alarm with a long location at the run's last step, beside a remedy at the same step and the run's own
    markers: every label whole, inside its panel and the figure, none over another."""

    def crowded(diagnoses: list[Any], timeline: Any) -> list[Any]:
        alarm = next(d for d in diagnoses if d.is_alarm)
        last = timeline.steps[-1]
        return [*diagnoses,
                replace(alarm, step=last, location="encoder.layers.11.self_attention.scaled_dot_product.softmax"),
                replace(alarm, step=last - 1, location="decoder.cross_attention")]

    fig, timeline, shown = figure_of(demo("lr_schedule")[2], crowded)
    renderer = fig.canvas.get_renderer()
    top = fig.axes[0]
    box = top.get_window_extent(renderer)
    labels = [t for t in top.texts if t.get_rotation() == 90]
    wanted = {f"{d.finding.value}{f' in {d.location}' if d.location else ''}" for d in shown}
    wanted |= {f"remedy: {e['name']}" for e in timeline.of_kind("remedy")}
    assert {t.get_text().replace(".\n", ".").replace("\n", " ") for t in labels} == wanted
    extents = [t.get_window_extent(renderer) for t in labels]
    for text, extent in zip(labels, extents):
        said = text.get_text().replace("\n", " ")
        assert fig.bbox.x0 <= extent.x0 and extent.x1 <= fig.bbox.x1, f"{said!r} runs off the figure"
        assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, f"{said!r} runs past its panel's side"
        assert box.y0 - 1 <= extent.y0 and extent.y1 <= box.y1 + 1, f"{said!r} runs past its panel's bottom"
    for i, a in enumerate(extents):
        for b in extents[i + 1:]:
            assert not a.overlaps(b), "two labels over each other"


# ---------------------------------------------------------------------------- a lost record


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run whose every step fails: 8 of 8 skipped, 8 non-finite losses, one FORWARD_OVERFLOW record."""
    root = tmp_path_factory.mktemp("bad")
    pl.seed_everything(0, verbose=False)
    run_scenario("forward_overflow", str(root), AmpWatch(verbose=False))
    assert len((root / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()) == 1
    return root / "ampwatch"


def damaged(bad_run: Path, tmp_path: Path, how: str) -> Path:
    logs = tmp_path / "run" / "ampwatch"
    shutil.copytree(bad_run, logs)
    event_log = logs / "diagnoses.jsonl"
    line = event_log.read_text()
    if how == "missing":
        event_log.unlink()
    elif how == "empty":
        event_log.write_text("")
    elif how == "damaged":
        event_log.write_text(line[:len(line) // 2])  # the run was killed while writing its only record
    elif how == "killed":  # killed before the timeline's diagnosis marker and end row were written, log lost
        event_log.unlink()
        timeline = logs / "timeline.jsonl"
        rows = [r for r in timeline.read_text().splitlines() if '"event":"diagnosis"' not in r
                and '"event":"end"' not in r]
        timeline.write_text("\n".join(rows) + "\n")
    return logs


@pytest.mark.parametrize("how, said", [
    ("missing", "diagnoses.jsonl is missing"),
    ("empty", "diagnoses.jsonl is empty"),
    ("damaged", "diagnoses.jsonl is damaged: its last line (1) is cut short and was left out"),
    ("killed", "diagnoses.jsonl is missing"),
])
def test_a_lost_record_is_never_called_no_diagnosis(bad_run: Path, tmp_path: Path, how: str, said: str) -> None:
    logs = damaged(bad_run, tmp_path, how)
    code, out, _ = report(str(logs), "--html", str(tmp_path / "r.html"))
    text = flat(out)
    assert code == 1, out
    assert "No diagnoses were made" not in text and "a healthy run" not in text
    assert said in text
    assert "8 of 8 steps skipped by the scaler (steps 0-7) and 8 non-finite losses (steps 0-7)" in text
    assert "The record of this run is lost" in text
    if how == "killed":
        assert "lost, or the run ended before AmpWatch judged them" in text
    else:  # the timeline's own marker names what the event log lost
        assert "It names 1 diagnosis that no record holds: FORWARD_OVERFLOW at step 0." in text
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "No diagnoses were made" not in page and "The record of this run is lost" in page


def test_the_intact_record_reports_as_before(bad_run: Path) -> None:
    code, out, _ = report(str(bad_run))
    assert code == 0 and "FORWARD_OVERFLOW" in out and "lost" not in out


# ---------------------------------------------------------------------------- a corrupted line


def test_a_corrupted_line_names_the_file_the_line_and_the_column(bad_run: Path, tmp_path: Path) -> None:
    logs = tmp_path / "ampwatch"
    shutil.copytree(bad_run, logs)
    event_log = logs / "diagnoses.jsonl"
    line = event_log.read_text()
    at = line.index('"attention"') + 4
    event_log.write_text(line[:at] + "\t" + line[at:])  # a raw tab inside a string: not JSON
    code, out, err = report(str(logs))
    assert code == 2 and out == ""
    assert f"{event_log}:1: " in err
    assert f"line 1 is not valid JSON: at column {at + 1}, a control character" in err
    assert "Invalid control character" not in err and "Traceback" not in err


# ---------------------------------------------------------------------------- remediate=


def test_a_bad_remediate_names_every_valid_value() -> None:
    with pytest.raises(ValueError) as raised:
        AmpWatch(remediate="bogus")
    said = str(raised.value)
    assert said.startswith("remediate='bogus' is not valid; ")
    for value in ("True", "False", "'all'", *(r.value for r in RemedyName)):
        assert value in said, f"{value} missing from: {said}"


# ---------------------------------------------------------------------------- the compact panel in plain words


def test_every_row_the_compact_panel_can_show_has_a_plain_label() -> None:
    for key in {k for keys in KEY_EVIDENCE.values() for k in keys} | set(ALWAYS_SHOWN):
        assert key in EVIDENCE_LABELS, f"{key} has no plain label"
    assert len(set(EVIDENCE_LABELS.values())) == len(EVIDENCE_LABELS), "two keys share a label"
    assert max(map(len, EVIDENCE_LABELS.values())) <= 32  # one line in the panel's label column


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_compact_panel_shows_no_internal_key(scenario: str, demo: Callable[[str], Run]) -> None:
    """The demo's panels, first and update: each row under its plain label, never under an event-log key."""
    watch, out, _ = demo(scenario)
    assert "╭─ AmpWatch:" in out
    keys = {k for d in watch.diagnoses for k in d.evidence}
    for d in watch.diagnoses:
        for key, _ in panel_rows(d):
            assert key in EVIDENCE_LABELS, f"{key} reaches the {d.finding.value} panel without a plain label"
            assert f"│ {EVIDENCE_LABELS[key]}  " in out, f"{EVIDENCE_LABELS[key]!r} not on the panel:\n{out}"
    for line in out.splitlines():
        first = re.match(r"^│ (\S+)\s{2,}\S", line)
        if first and first.group(1) in keys:
            key = first.group(1)
            assert EVIDENCE_LABELS.get(key) == key, f"the internal key {key} is on the panel:\n{line}"


def test_the_headroom_row_reads_as_powers_of_two(demo: Callable[[str], Run]) -> None:
    watch, out, _ = demo("forward_overflow")
    (alarm,) = [d for d in watch.diagnoses if d.is_alarm]
    headroom = alarm.evidence["fp16_headroom_log2"]
    module, doublings = next(iter(headroom.items()))
    assert re.search(rf"│ headroom below float16's max\s{{2,}}{re.escape(module)}: 2\*\*{doublings:g}\b", out), out
    assert "fp16_headroom_log2" not in out


# ---------------------------------------------------------------------------- the rollback line


def test_the_rollback_line_says_how_many_batches_it_skipped(demo: Callable[[str], Run]) -> None:
    watch, out, root = demo("lr_schedule")
    (alarm,) = [d for d in watch.diagnoses if d.is_alarm]
    sentence = alarm.evidence["rollback"]
    went = re.match(r"rolled back from step (\d+) to step (\d+) \(the in-memory snapshot", sentence)
    assert went is not None, sentence
    skipped = int(went.group(1)) - int(went.group(2))
    assert skipped > 1
    text = flat(out)
    assert (f"rollback {sentence}: {skipped} batches, never trained on (snapshot_every, the steps between "
            "snapshots, sets how many)") in text, text
    # the line `ampwatch demo lr_schedule --remediate` prints after the run says the same
    said = io.StringIO()
    _say_recovery(watch, Console(file=said, width=400))
    assert f"rollback: {sentence}: {skipped} batches, never trained on (snapshot_every, the steps" in \
        flat(said.getvalue())
    # the event log keeps the sentence as it was: scripts read it
    logged = [json.loads(line) for line in (root / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()]
    assert any(row["evidence"].get("rollback") == sentence for row in logged)


def test_the_reports_page_lists_each_panel_label() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "reports.md").read_text(encoding="utf-8")
    for key in {k for keys in KEY_EVIDENCE.values() for k in keys} | set(ALWAYS_SHOWN):
        assert f"| `{key}` | {EVIDENCE_LABELS[key]} |" in page, key


def test_a_rollback_to_a_checkpoint_file_says_what_sets_how_many_it_skipped() -> None:
    from lightning_ampwatch import Diagnosis, Finding
    from lightning_ampwatch.records import Rollback, RollbackKind, with_facts
    from lightning_ampwatch.reporters import rollback_line

    rollback = Rollback(RollbackKind.CHECKPOINT, now=40, to_step=10, path="ckpt/epoch=0.ckpt")
    alarm = with_facts(Diagnosis(Finding.GRADIENT_OVERFLOW, 38, evidence={"rollback": rollback.sentence()}),
                       rollback=rollback)
    line = rollback_line(rollback.sentence(), alarm)
    assert line == (f"{rollback.sentence()}: 30 batches, never trained on (the newest checkpoint file from before "
                    "the onset sets how many; snapshot_every keeps in-memory snapshots closer)")
    assert rollback_line(rollback.sentence()) == line  # read back from the event log, without the record
    retrained = rollback.after_retraining([0.5, 0.4])
    assert rollback_line(retrained.sentence(), with_facts(alarm, rollback=retrained)) == retrained.sentence()


def test_the_compact_panel_gives_one_answer_on_the_lower_lr_where_the_fixes_tried_are_shown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the lr_schedule demo: the interventions' "LR capped ... 0 skips" line decides; the older single lower-LR
    # replay's margin verdict ("inconclusive, nothing is concluded") stays in the event log only
    watch = AmpWatch(log_dir=str(tmp_path / "log"))
    run_scenario("lr_schedule", str(tmp_path), watch)
    out = capsys.readouterr().out
    [alarm] = [d for d in watch.diagnoses if d.finding is Finding.LR_SCHEDULE]
    assert "tried" in alarm.evidence and "lower_lr_reason" in alarm.evidence
    assert "fixes tried on replays" in out and "LR capped at 0.02" in out
    assert "same steps at a lower LR" not in out
    assert "lower_lr_reason" in dict(panel_rows(alarm, full=True))  # verbose="full" keeps it
