"""``ampwatch demo``: what a user sees when they run the README's first command, and its --remediate variant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_ampwatch.cli import main
from lightning_ampwatch.scenarios import SCENARIOS


def test_demo_list_names_every_scenario_and_its_finding(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    for name, scenario in SCENARIOS.items():
        assert name in out and scenario.expected in out


def test_demo_shows_the_diagnosis_and_writes_the_event_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "forward_overflow", "--root-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "AmpWatch: FORWARD_OVERFLOW at step 0 in attention" in out
    assert "Diagnoses: FORWARD_OVERFLOW (as expected); 1 alarm(s)." in out
    [line] = (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()
    assert json.loads(line)["location"] == "attention"


def test_demo_remediate_applies_the_remedy_and_says_what_it_could_verify(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "forward_overflow", "--remediate", "--root-dir", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "Applied: fp32_island" in out
    # the fault is at step 0, before any healthy level: the remedied run is held step by step to FP32 training from
    # the same state on the same batches (issue 30), so a run that starts broken can be verified
    assert "Remedy for FORWARD_OVERFLOW at step 0: fixed with fp32_island, recovery verified" in out
    assert "tracks FP32 training from the same state" in out
    assert "no healthy reference" not in out
    # the run is twice the scenario's length, to show the recovery: the demo's own line and the summary agree
    assert "Precision: fp16 on the CPU, 16 optimizer steps, logs in" in out
    assert "AmpWatch summary: 16 optimizer steps" in out


def test_demo_with_an_unwritable_root_dir_fails_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where a directory should be")
    assert main(["demo", "forward_overflow", "--root-dir", str(blocker / "run")]) == 2
    captured = capsys.readouterr()
    assert f"ampwatch demo: cannot write the logs to {blocker / 'run' / 'ampwatch'}" in captured.err
    assert "Event log:" not in captured.out and "FORWARD_OVERFLOW" not in captured.out


def test_demo_prints_a_root_dir_with_brackets_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "[bold]runs"
    assert main(["demo", "nan_data", "--root-dir", str(root)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"logs in {root}" in out
    assert f"Event log: {root / 'ampwatch' / 'diagnoses.jsonl'}" in out


def test_demo_rejects_an_unknown_scenario(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "no_such_thing"]) == 2
    assert "Unknown scenario 'no_such_thing'" in capsys.readouterr().out


def test_demo_remediate_shows_the_rollback_and_the_verified_outcome(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "lr_schedule", "--remediate", "--root-dir", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Remedy for LR_SCHEDULE at step 31: fixed with reduce_lr, recovery verified." in out
    assert "rollback: rolled back from step 37 to step 21 (the in-memory snapshot taken after step 20)" in out
    assert "recovery: 8 steps after it: 0 skipped" in out
    assert "LR_SCHEDULE in head.weight (fixed with reduce_lr, recovery verified)" in out  # the summary agrees
