"""``ampwatch report PATH``: the episode table, ``--plot`` and ``--html`` from a real run's logs, and clear errors."""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import lightning.pytorch as pl
import pytest
from matplotlib.image import imread

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.cli import main
from lightning_ampwatch.scenarios import SCENARIOS, build_trainer


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real true-fp16 run whose learning rate jumps 40x at step 30, logged by a CSVLogger (a versioned dir)."""
    from lightning.pytorch.loggers import CSVLogger

    root = tmp_path_factory.mktemp("report")
    scenario = SCENARIOS["lr_schedule"]
    pl.seed_everything(0, verbose=False)
    trainer = build_trainer(scenario, [AmpWatch(verbose=False)], str(root), logger=CSVLogger(str(root)))
    trainer.fit(scenario.model(), scenario.dataloader())
    assert (root / "lightning_logs" / "version_0" / "ampwatch" / "timeline.jsonl").is_file()
    return root


def report(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", *argv])
    return code, out.getvalue(), err.getvalue()


def test_report_prints_the_episode_table(run_dir: Path) -> None:
    code, out, err = report(str(run_dir))
    assert code == 0, err
    assert "AmpWatch report: " + str(run_dir / "lightning_logs" / "version_0" / "ampwatch") in out
    assert "60 optimizer steps" in out and "1 alarm." in out
    for header in ("steps", "finding", "location", "advice", "remedy"):
        assert header in out
    row = next(line for line in out.splitlines() if "LR_SCHEDULE" in line)
    assert row.split("│")[1].strip().startswith("31-")  # the episode's span starts at its onset
    assert "The failure began right after the learning rate jumped in one step (0.02 -> 0.8)" in " ".join(
        part.strip() for line in out.splitlines() for part in line.split("│")[4:5])
    assert row.split("│")[5].strip() == "none"  # no remedy applied


@pytest.mark.parametrize("which", ["ampwatch dir", "version dir", "diagnoses.jsonl", "timeline.jsonl"])
def test_report_accepts_each_kind_of_path(run_dir: Path, which: str) -> None:
    version = run_dir / "lightning_logs" / "version_0"
    path = {"ampwatch dir": version / "ampwatch", "version dir": version,
            "diagnoses.jsonl": version / "ampwatch" / "diagnoses.jsonl",
            "timeline.jsonl": version / "ampwatch" / "timeline.jsonl"}[which]
    code, out, _ = report(str(path))
    assert code == 0
    assert "LR_SCHEDULE" in out and "60 optimizer steps" in out


def test_plot_renders_the_timeline(run_dir: Path, tmp_path: Path) -> None:
    png = tmp_path / "figs" / "timeline.png"
    code, out, err = report(str(run_dir), "--plot", str(png))
    assert code == 0, err
    assert f"Wrote {png}" in out
    image = imread(png)
    height, width = image.shape[:2]
    assert width >= 1000 and height >= 700
    rgb = image[..., :3]
    assert rgb.std() > 0.05, "the image is blank"
    # the skipped-step markers and the alarm line are red; the scale curve blue (matplotlib's tab colours)
    red = (rgb[..., 0] > 0.75) & (rgb[..., 1] < 0.3) & (rgb[..., 2] < 0.3)
    blue = (rgb[..., 2] > 0.6) & (rgb[..., 0] < 0.3)
    assert red.sum() > 200 and blue.sum() > 200


def test_html_embeds_the_plot_and_the_table(run_dir: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    code, _, err = report(str(run_dir), "--html", str(page))
    assert code == 0, err
    text = page.read_text(encoding="utf-8")
    assert '<img alt="AmpWatch timeline" src="data:image/png;base64,' in text
    assert '<td class="alarm">LR_SCHEDULE</td>' in text
    assert "0.02 -&gt; 0.8" in text  # advice escaped, not raw


def test_missing_path_is_named_and_fails(tmp_path: Path) -> None:
    code, out, err = report(str(tmp_path / "nope"))
    assert code == 2 and out == ""
    assert f"ampwatch report: {tmp_path / 'nope'}: no such file or directory" in err


def test_directory_without_logs_is_named_and_fails(tmp_path: Path) -> None:
    code, _, err = report(str(tmp_path))
    assert code == 2
    assert f"{tmp_path}: no AmpWatch logs here" in err


def test_malformed_event_log_names_file_and_line(run_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ampwatch"
    shutil.copytree(run_dir / "lightning_logs" / "version_0" / "ampwatch", broken)
    with (broken / "diagnoses.jsonl").open("a") as fh:
        fh.write('{"finding": "NOT_A_FINDING", "step": 3}\n')
    code, _, err = report(str(tmp_path))
    assert code == 2
    assert f"{broken / 'diagnoses.jsonl'}:2: not an AmpWatch diagnosis" in err


def test_malformed_timeline_names_file_and_line(run_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ampwatch"
    shutil.copytree(run_dir / "lightning_logs" / "version_0" / "ampwatch", broken)
    with (broken / "timeline.jsonl").open("a") as fh:
        fh.write("garbage\n")
    code, _, err = report(str(broken / "timeline.jsonl"))
    lines = (broken / "timeline.jsonl").read_text().count("\n")
    assert code == 2
    assert f"{broken / 'timeline.jsonl'}:{lines}: not an AmpWatch timeline row" in err


def test_binary_event_log_is_named(tmp_path: Path) -> None:
    path = tmp_path / "diagnoses.jsonl"
    path.write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = report(str(path))
    assert code == 2 and f"{path}: not an AmpWatch event log" in err


def test_plot_without_a_timeline_says_so(run_dir: Path, tmp_path: Path) -> None:
    only = tmp_path / "diagnoses.jsonl"
    shutil.copy(run_dir / "lightning_logs" / "version_0" / "ampwatch" / "diagnoses.jsonl", only)
    code, out, err = report(str(only), "--plot", str(tmp_path / "x.png"))
    assert code == 2
    assert "LR_SCHEDULE" in out  # the table still comes
    assert f"{tmp_path} has no timeline.jsonl to draw" in err
    assert not (tmp_path / "x.png").exists()


def test_healthy_full_precision_run_report(tmp_path: Path) -> None:
    """No scaler, no diagnosis: the report says so, and the plot has the loss (read every step) and the LR."""
    scenario = SCENARIOS["healthy"]
    pl.seed_everything(0, verbose=False)
    trainer = build_trainer(scenario, [AmpWatch(verbose=False)], str(tmp_path), max_steps=12, plugins=None,
                            precision="32-true")
    trainer.fit(scenario.model(), scenario.dataloader())
    code, out, _ = report(str(tmp_path), "--plot", str(tmp_path / "t.png"))
    assert code == 0
    assert "12 optimizer steps; no alarm: a healthy run." in out
    assert "No diagnoses were made." in out
    image = imread(tmp_path / "t.png")
    assert image[..., :3].std() > 0.05
    assert image.shape[0] < 700  # two panels (loss, learning rate): no loss-scale panel without a scaler


def test_directory_with_several_runs_shows_the_newest_and_says_so(run_dir: Path, tmp_path: Path) -> None:
    import os

    source = run_dir / "lightning_logs" / "version_0" / "ampwatch"
    older, newer = tmp_path / "version_0" / "ampwatch", tmp_path / "version_1" / "ampwatch"
    shutil.copytree(source, older)
    shutil.copytree(source, newer)
    for f in older.iterdir():
        os.utime(f, (1_000_000, 1_000_000))
    code, out, _ = report(str(tmp_path))
    assert code == 0
    assert f"AmpWatch report: {newer}" in out
    assert f"(1 other run(s) under {tmp_path}; showing the newest." in out


def test_plot_without_matplotlib_says_how_to_get_it(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """matplotlib is the [plot] extra: the plain install of the README's demo command does not have it."""
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... now raises ImportError
    assert main(["report", str(run_dir), "--plot", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert "drawing needs matplotlib" in err and "lightning-ampwatch[plot]" in err
    assert not (tmp_path / "t.png").exists()


# ---------------------------------------------------------------------------- damaged, hostile and huge logs


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    logs = tmp_path / "ampwatch"
    shutil.copytree(run_dir / "lightning_logs" / "version_0" / "ampwatch", logs)
    return logs


def test_a_cut_short_last_timeline_line_is_left_out_with_one_warning(run_dir: Path, tmp_path: Path) -> None:
    logs = copy_run(run_dir, tmp_path)
    timeline = logs / "timeline.jsonl"
    lines = timeline.read_text().count("\n")
    with timeline.open("a") as fh:
        fh.write('{"step":61,"sca')  # the process died (or the disk filled) mid-write
    code, out, err = report(str(logs), "--plot", str(tmp_path / "t.png"))
    assert code == 0, err
    assert err.count("warning") == 1
    assert f"ampwatch report: warning: {timeline}:{lines + 1}: the last line is cut short" in err
    assert "60 optimizer steps" in out and (tmp_path / "t.png").is_file()


def test_a_bad_line_in_the_middle_of_the_timeline_stays_an_error(run_dir: Path, tmp_path: Path) -> None:
    logs = copy_run(run_dir, tmp_path)
    timeline = logs / "timeline.jsonl"
    rows = timeline.read_text().splitlines()
    timeline.write_text("\n".join([rows[0], '{"step":1,"sca', *rows[1:]]))  # no newline at the end either
    code, _, err = report(str(logs))
    assert code == 2
    assert f"{timeline}:2: not an AmpWatch timeline row" in err


@pytest.mark.parametrize("field, value, why", [
    ("location", {"module": "attention"}, "'location' must be a string or null"),
    ("advice", 3, "'advice' must be a string, not 3"),
    ("evidence", [1, 2], "'evidence' must be an object"),
    ("step", "7", "'step' must be an integer"),
])
def test_a_field_of_the_wrong_type_names_file_and_line(tmp_path: Path, field: str, value: object, why: str) -> None:
    import json

    good = {"finding": "GRADIENT_OVERFLOW", "step": 0, "location": None, "evidence": {}, "advice": "a", "remedy": None}
    path = tmp_path / "diagnoses.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, field: value}) + "\n")
    code, _, err = report(str(path))
    assert code == 2
    assert f"{path}:2: not an AmpWatch diagnosis ({why}" in err
    assert "Traceback" not in err


def test_a_directory_named_like_the_event_log_is_a_clear_error(tmp_path: Path) -> None:
    odd = tmp_path / "run" / "ampwatch" / "diagnoses.jsonl"
    odd.mkdir(parents=True)
    code, _, err = report(str(tmp_path))  # found while searching below the path
    assert code == 2 and f"{tmp_path}: no AmpWatch logs here" in err
    code, _, err = report(str(odd))  # named outright
    assert code == 2 and f"{odd}: a directory, not the AmpWatch log file its name says" in err


def test_user_text_prints_as_written_in_the_table_and_is_escaped_in_html(tmp_path: Path) -> None:
    from lightning_ampwatch import Diagnosis, Finding

    hostile = Diagnosis(Finding.FORWARD_OVERFLOW, 3, location="heads.[bold red]x<b>",
                        evidence={"op": "return losses[idx] * 1024 <script>"}, advice="Use [italic]float32.")
    path = tmp_path / "ampwatch" / "diagnoses.jsonl"
    path.parent.mkdir()
    path.write_text(hostile.to_json() + "\n")
    (path.parent / "timeline.jsonl").write_text('{"event":"start","step":0,"format":1}\n{"step":3,"scale":2.0}\n')
    code, out, err = report(str(path), "--html", str(tmp_path / "r.html"))
    assert code == 0, err
    cells = " ".join(out.replace("│", " ").split())
    assert "heads.[bold red]x<b>" in cells and "Use [italic]float32." in cells
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "heads.[bold red]x&lt;b&gt;" in page and "return losses[idx] * 1024 &lt;script&gt;" in page
    assert "<script>" not in page and "x<b>" not in page


def test_html_shows_each_diagnosis_evidence_escaped(run_dir: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    code, _, err = report(str(run_dir), "--html", str(page))
    assert code == 0, err
    text = page.read_text(encoding="utf-8")
    assert "<th>evidence</th>" in text and '<table class="evidence">' in text
    assert "<td>lr_before</td><td>0.02</td>" in text and "<td>lr_after</td><td>0.8</td>" in text
    assert f"<title>AmpWatch report: {run_dir.name}/lightning_logs/version_0</title>" in text


def test_plot_title_names_the_run_not_the_version_folder(run_dir: Path, tmp_path: Path) -> None:
    from lightning_ampwatch.report import locate_run, run_title

    assert run_title(locate_run(run_dir)) == f"{run_dir.name}/lightning_logs/version_0"
    plain = copy_run(run_dir, tmp_path / "my_run")  # a run without a logger: <root>/ampwatch
    assert run_title(locate_run(plain)) == "my_run"


def test_a_huge_log_is_read_in_seconds_and_printed_in_a_screenful(tmp_path: Path) -> None:
    import json
    import time

    logs = tmp_path / "ampwatch"
    logs.mkdir()
    n_diagnoses, n_rows = 20_000, 200_000
    advice = "Lower the learning rate. " * 40  # a long value: shown cut short
    with (logs / "diagnoses.jsonl").open("w") as fh:
        for i in range(n_diagnoses):
            finding = "GRADIENT_OVERFLOW" if i % 2 else "NORMAL_SCALING"
            fh.write(json.dumps({"finding": finding, "step": i * 10, "location": f"layers.{i}",
                                 "evidence": {"skips": [1.0] * 20}, "advice": advice, "remedy": None}) + "\n")
    with (logs / "timeline.jsonl").open("w") as fh:
        fh.write('{"event":"start","step":0,"format":1,"precision":"fp16"}\n')
        for step in range(n_rows):
            fh.write(json.dumps({"step": step, "scale": 1024.0, "skipped": step % 10 == 1}) + "\n")
    start = time.perf_counter()
    code, out, err = report(str(logs), "--html", str(tmp_path / "r.html"))
    took = time.perf_counter() - start
    assert code == 0, err
    # a read quadratic in the rows would take hours here: the limit catches that, never a slow machine (5 s under load)
    assert took < 120, f"{took:.1f} s"
    assert len(out) < 60_000, f"{len(out)} characters printed"
    assert "10000 alarms." in out
    assert f"... {n_diagnoses - 50} more episodes, all in {logs / 'diagnoses.jsonl'}" in out
    assert advice not in out.replace("\n", "") and "..." in out
    assert (tmp_path / "r.html").stat().st_size < 2_000_000


def test_a_remedied_alarm_is_one_row_with_its_verified_outcome(tmp_path: Path) -> None:
    scenario = SCENARIOS["lr_schedule"]
    pl.seed_everything(0, verbose=False)
    trainer = build_trainer(scenario, [AmpWatch(verbose=False, remediate=["reduce_lr"])], str(tmp_path),
                            max_steps=60)
    trainer.fit(scenario.model(), scenario.dataloader())
    lines = (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()
    assert len([line for line in lines if '"LR_SCHEDULE"' in line]) == 2  # the remedy, then its outcome
    code, out, err = report(str(tmp_path), "--html", str(tmp_path / "r.html"))
    assert code == 0, err
    text = " ".join(out.replace("│", " ").split())
    assert text.count("LR_SCHEDULE") == 1 and "1 alarm" in text
    assert "fixed with reduce_lr, recovery" in text and "verified" in text  # the cell wraps over two lines
    assert "not verified" not in text
    assert "fixed with reduce_lr, recovery verified" in (tmp_path / "r.html").read_text(encoding="utf-8")
