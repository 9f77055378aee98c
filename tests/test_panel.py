"""The console panel as a user reads it: for each finding, the handful of evidence rows it rests on, the fix, and
an outcome that refers back to the first panel instead of repeating it. Real trainings (the demo scenarios and
the recipe examples), the console output parsed as printed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.reporters import ALWAYS_SHOWN, EVIDENCE_LABELS, KEY_EVIDENCE
from lightning_ampwatch.scenarios import run_scenario

ROW = re.compile(r"^│ ([a-z][a-z0-9_]*)\s{2,}\S")
TITLE = re.compile(r"^╭─ AmpWatch: (\w+) at step (\d+)")
#: The compact panel shows each row under its plain label (verbose="full" under its key): read back as the key
KEY_OF_LABEL = {label: key for key, label in EVIDENCE_LABELS.items()}


def row_key(line: str) -> str | None:
    """The evidence key of a panel line that is an evidence row, shown under its plain label or its key."""
    body = line[2:] if line.startswith("│ ") else ""
    for label in sorted(KEY_OF_LABEL, key=len, reverse=True):
        if body.startswith(label) and re.match(r"\s{2,}\S", body[len(label):]):
            return KEY_OF_LABEL[label]
    match = ROW.match(line)
    return match.group(1) if match else None


def panels(out: str) -> list[tuple[str, list[str], str]]:
    """Each panel printed: its title line, the evidence keys of its rows (in order), and its whole text."""
    found: list[tuple[str, list[str], str]] = []
    lines: list[str] | None = None
    for line in out.splitlines():
        if line.startswith("╭─ AmpWatch:"):
            lines = [line]
        elif lines is not None:
            lines.append(line)
            if line.startswith("╰"):
                keys = [k for k in map(row_key, lines) if k]
                found.append((lines[0], keys, "\n".join(lines)))
                lines = None
    return found


def first_panel(out: str, finding: Finding) -> tuple[list[str], str]:
    for title, keys, text in panels(out):
        match = TITLE.match(title)
        if match and match.group(1) == finding.value and "(update)" not in title:
            return keys, text
    raise AssertionError(f"no {finding.value} panel in:\n{out}")


# scenario -> (finding, rows the user must see, rows that must not be there)
SCENARIO_ROWS = {
    "lr_schedule": (Finding.LR_SCHEDULE, ["lr_event", "lr_before", "lr_after", "lr_change_step", "control_verdict"],
                    ["safe_scale", "fp16_headroom_log2", "batch_idx", "replay_grads_finite"]),
    "gradient_overflow": (Finding.GRADIENT_OVERFLOW, ["pattern", "skipped_in_row", "scale_history", "safe_scale",
                                                      "control_verdict"], ["batch_idx", "fp16_headroom_log2"]),
    "nan_data": (Finding.DATA_NONFINITE, ["nonfinite_where", "control_verdict"], ["safe_scale", "scale_history"]),
    "forward_overflow": (Finding.FORWARD_OVERFLOW, ["replay_first_nonfinite_module", "fp32_control_loss",
                                                    "control_verdict"], ["safe_scale", "scale_history"]),
    "growth_overflow": (Finding.GROWTH_OVERFLOW, ["growth_steps", "skip_rate", "growth_interval", "growth_factor",
                                                  "control_verdict"], ["batch_control_verdict", "safe_scale"]),
    "input_range": (Finding.INPUT_RANGE, ["input_absmax", "input_where"], ["scale_history"]),
    "diverging_lr": (Finding.FP32_UNSTABLE, ["control_verdict", "fp32_control_loss"], ["safe_scale"]),
    "healthy": (Finding.NORMAL_SCALING, ["skipped_steps", "steps", "scale"], ["pattern"]),
}


@pytest.mark.parametrize("scenario", list(SCENARIO_ROWS))
def test_panel_shows_the_rows_its_finding_rests_on(scenario: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    finding, wanted, unwanted = SCENARIO_ROWS[scenario]
    watch = run_scenario(scenario, str(tmp_path), AmpWatch())
    out = capsys.readouterr().out
    keys, text = first_panel(out, finding)
    diagnosis = next(d for d in watch.diagnoses if d.finding is finding)
    for key in wanted:
        assert key in keys, f"{key} missing from the {finding.value} panel:\n{text}"
    for key in unwanted:
        assert key not in keys, f"{key} should not be on the {finding.value} panel:\n{text}"
    assert "batch_control_verdict" not in text  # superseded by control_verdict: never beside it
    assert set(keys) <= set(KEY_EVIDENCE[finding]) | set(ALWAYS_SHOWN)
    assert len(keys) <= 8, text  # a handful, not thirty
    assert "Fix: " in text
    left_out = len([k for k in diagnosis.evidence if k != "batch_control_verdict"]) - len(keys)
    if left_out:
        flat = " ".join(text.replace("│", " ").split())
        assert f"{left_out} more row" in flat and f"ampwatch report {tmp_path} --full" in flat
        assert 'AmpWatch(verbose="full")' in flat


def _example(name: str) -> object:
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("example, model, finding, wanted", [
    ("recipe_loss_outside_autocast", "LossWithoutAutocast", Finding.LOSS_OUTSIDE_AUTOCAST,
     ["loss_op", "loss_dtype", "call_site", "code"]),
    ("recipe_clip_before_unscale", "ManualClipping", Finding.CLIP_BEFORE_UNSCALE,
     ["call_site", "scale", "clip_limit", "limit_in_real_units"]),
])
def test_recipe_panel_shows_the_line_at_fault(example: str, model: str, finding: Finding, wanted: list[str],
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = _example(example)
    pl.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 4, (256,)))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, default_root_dir=str(tmp_path),
                         plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
                         callbacks=[AmpWatch()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(getattr(module, model)(), DataLoader(data, batch_size=32))
    keys, text = first_panel(capsys.readouterr().out, finding)
    for key in wanted:
        assert key in keys, f"{key} missing from the {finding.value} panel:\n{text}"


def test_remedied_alarm_prints_its_full_evidence_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """verbose="full": every evidence row on the first panel; the outcome comes as a short update, not a copy."""
    watch = run_scenario("lr_schedule", str(tmp_path), AmpWatch(remediate="all", verbose="full"), max_steps=120)
    out = capsys.readouterr().out
    (alarm,) = [d for d in watch.diagnoses if d.is_alarm]
    assert alarm.outcome == "recovered"
    shown = [(title, keys, text) for title, keys, text in panels(out) if "LR_SCHEDULE" in title]
    assert len(shown) == 2, out
    (first_title, first_keys, first_text), (update_title, update_keys, update_text) = shown
    assert "(update)" not in first_title and "(update)" in update_title
    evidence = [k for k in alarm.evidence if k != "batch_control_verdict"]
    for key in evidence:
        if key != "recovery":  # the recovery is what the update adds
            assert key in first_keys, f"{key} missing from the full panel"
    every_key = re.findall(r"^│ ([a-z][a-z0-9_]*)\s{2,}", out, flags=re.M)
    for key in evidence:
        assert every_key.count(key) == 1, f"{key} printed {every_key.count(key)} times"
    assert update_keys == ["recovery"]
    assert "Outcome: fixed with reduce_lr, recovery verified" in update_text
    assert "Fix:" not in update_text and len(update_text.splitlines()) <= 6


def test_verbose_is_validated() -> None:
    assert AmpWatch(verbose="full").verbose == "full"
    for bad in ("loud", "FULL", 1, None):
        with pytest.raises(ValueError, match="True or False, or \"full\""):
            AmpWatch(verbose=bad)  # type: ignore[arg-type]


def test_applied_line_says_what_the_remedy_changed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The Applied line names the remedy and, from what it did to this run, what it changed: the module it put in
    float32, the learning rates before and after."""
    watch = run_scenario("forward_overflow", str(tmp_path / "island"), AmpWatch(remediate=True))
    out = capsys.readouterr().out
    island = next(d for d in watch.diagnoses if d.remedy == "fp32_island")
    assert f"Applied: fp32_island: {island.location} runs in float32 with autocast off" in out, out
    watch = run_scenario("lr_schedule", str(tmp_path / "lr"), AmpWatch(remediate="all"), max_steps=120)
    out = re.sub(r"(\s*│\s*)+", " ", capsys.readouterr().out)  # the panel's wrapped lines joined
    applied = next(a for a in watch.applied if a.name == "reduce_lr")
    # a rollback to before the rise brought the LR back: it is held there (a ceiling), not scaled
    ceiling = applied.details["ceiling"][0]
    assert f"Applied: reduce_lr: learning rates held at or under {ceiling:g} (the LR before the rise)" in out, out


def test_the_command_the_hint_names_shows_the_rows_left_out(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The panel's last line names a command for the rows it leaves out; that command prints every one of them."""
    from lightning_ampwatch.cli import main

    watch = run_scenario("lr_schedule", str(tmp_path), AmpWatch())
    out = capsys.readouterr().out
    (alarm,) = [d for d in watch.diagnoses if d.is_alarm]
    flat = " ".join(out.replace("│", " ").split())
    hint = re.search(r"\d+ more rows?: ampwatch report (\S+) --full", flat)
    assert hint is not None, out
    assert main(["report", hint.group(1), "--full"]) == 0
    report = capsys.readouterr().out
    keys = re.findall(r"^│ ([a-z][a-z0-9_]*)\s{2,}", report, flags=re.M)
    shown_in_run = set(first_panel(out, Finding.LR_SCHEDULE)[0])
    left_out = [k for k in alarm.evidence if k != "batch_control_verdict" and k not in shown_in_run]
    assert left_out, "the panel left nothing out: the test shows nothing"
    for key in left_out:
        assert key in keys, f"{key} not in the report's full panel:\n{report}"


def test_a_remedy_whose_recovery_cannot_be_verified_says_so_in_its_update(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fault from the first step has no healthy level to judge a remedy against: the update panel ends with an
    Outcome line saying the recovery was not verified and why, never a silent panel or a "fixed". (Without
    snapshots: with them, FP32 and the cured replay over the episode's window, through a few steps past the onset,
    now fall decisively and verify this very run.)"""
    watch = run_scenario("forward_overflow", str(tmp_path), AmpWatch(remediate=True, snapshot_every=0), max_steps=40)
    out = capsys.readouterr().out
    island = next(d for d in watch.diagnoses if d.remedy == "fp32_island")
    assert island.outcome == "not_verified" and island.evidence["recovery"]["reason"].startswith("there is no healthy")
    updates = [text for title, _, text in panels(out) if "FORWARD_OVERFLOW" in title and "(update)" in title]
    assert updates, out
    flat = " ".join(updates[-1].replace("│", " ").split())
    assert "Outcome: fp32_island applied; recovery not verified: there is no healthy reference" in flat, flat
    assert "fixed with" not in flat and flat.count("there is no healthy reference") == 1, flat
