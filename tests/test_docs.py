"""The README and the docs site as a newcomer meets them: the quick start runs as written, the two fresh-machine
commands are the ones CI runs, the site builds with warnings as errors, and the reference says what the code does.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.cli import main
from lightning_ampwatch.reporters import ALWAYS_SHOWN, KEY_EVIDENCE
from _limits import HANG_S

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore", COLUMNS="100")


def quick_start() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None, "the Quick start has no python block"
    return match.group(1)


def test_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    code = quick_start()
    assert 'MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))' in code  # real fp16 on a CPU
    script = tmp_path / "quick_start.py"
    script.write_text(code, encoding="utf-8")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert "AmpWatch" in out and "32 optimizer steps" in out, out[-3000:]  # 512 rows / 32 a batch, 2 epochs
    assert (tmp_path / "lightning_logs" / "version_0" / "ampwatch" / "timeline.jsonl").is_file()


def test_readme_keeps_the_two_fresh_machine_commands() -> None:
    readme = README.read_text(encoding="utf-8")
    demo = ('python3 -m venv .venv && . .venv/bin/activate && pip install -q torch==2.13.0 && pip install -q -e . '
            '&& ampwatch demo')
    assert f"```bash\n{demo}\n```" in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in readme  # CI runs exactly the README's test command
    assert len(readme.splitlines()) <= 230  # read in five minutes


def test_readme_links_only_pages_that_exist() -> None:
    readme = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).is_file(), target


def test_docs_build_strict(tmp_path: Path) -> None:
    """mkdocs with mkdocstrings, warnings as errors: a broken link, an anchor gone, a page left out of the nav or
    a docstring the API reference cannot render fails here."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    for word in ("Watch a mixed-precision run", "Attributes", "diagnoses", "applied", "Raises", "AmpWatchError",
                 "verbose", "remediate"):
        assert word in api, word
    assert (site / "findings" / "index.html").is_file()


def test_ampwatch_docstring_has_the_early_stopping_shape() -> None:
    doc = inspect.cleandoc(AmpWatch.__doc__ or "")
    for section in ("Args:", "Attributes:", "Raises:", "Example:"):
        assert f"\n{section}\n" in doc, section
    args = doc[doc.index("Args:"):doc.index("Attributes:")]
    for name in inspect.signature(AmpWatch.__init__).parameters:
        if name != "self":
            assert f"\n    {name}: " in args, f"{name} is not documented"
    attributes = doc[doc.index("Attributes:"):doc.index("Raises:")]
    assert "\n    diagnoses: " in attributes and "\n    applied: " in attributes
    assert not re.search(r"(?<!`)``(?!`)", doc)  # LightningCLI prints the Args as written: no RST markup


def test_control_replay_doc_says_what_the_code_does() -> None:
    """control_replay=False also turns the trajectory control (and its snapshots) off: the docs must say so."""
    from lightning_ampwatch.scenarios import run_scenario
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        watch = run_scenario("growth_overflow", tmp, AmpWatch(verbose=False, control_replay=False))
    alarm = next(d for d in watch.diagnoses if d.is_alarm)
    assert "trajectory_window" not in alarm.evidence and "trajectory_snapshot_step" not in alarm.evidence
    assert "turns off the FP32 trajectory control" in (AmpWatch.__doc__ or "")


def test_findings_page_lists_the_panel_rows() -> None:
    page = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    for finding, keys in KEY_EVIDENCE.items():
        row = next((line for line in page.splitlines() if line.startswith(f"| `{finding.value}` | `")), None)
        assert row is not None, finding
        assert row == f"| `{finding.value}` | {', '.join(f'`{k}`' for k in keys)} |", row
    for key in ALWAYS_SHOWN:
        assert f"`{key}`" in page


def test_demo_list_keeps_each_description_in_its_column(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--list"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    column = lines[0].index("A loss summed")
    for line in lines:
        if line.startswith(" "):
            assert len(line) - len(line.lstrip()) == column, line  # a wrapped description stays indented
    assert any(line.startswith(" ") for line in lines)


def test_cli_help_has_no_rst_markup(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["demo", "--help"], ["report", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "``" not in capsys.readouterr().out


@pytest.mark.parametrize("scenario, finding", [("forward_overflow", "FORWARD_OVERFLOW"),
                                               ("gradient_overflow", "GRADIENT_OVERFLOW")])
def test_remediation_page_shows_the_step_zero_demos_as_printed(
        scenario: str, finding: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The page's blocks for the step-0 remedies are the demo's own lines after the run, whole and in order."""
    page = (ROOT / "docs" / "remediation.md").read_text(encoding="utf-8")
    match = re.search(rf"```\n(Remedy for {finding} at step 0.*?)```", page, flags=re.S)
    assert match is not None, f"no block of the {scenario} demo on the page"
    block = match.group(1)
    assert main(["demo", scenario, "--remediate", "--root-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    start = printed.index(f"Remedy for {finding} at step 0")
    said = printed[start:printed.index("Event log:", start)]
    assert said == block, f"the page:\n{block}\nthe demo:\n{said}"
