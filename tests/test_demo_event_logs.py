"""The ``ampwatch demo`` scenarios' event logs (``diagnoses.jsonl``), byte for byte, and what the demo prints (panels,
summary, recovery lines), held against goldens in tests/golden/.

The safety net of internal changes (issue 29): moving the episode's code from one class to another must not change
one byte a user reads. What varies from run to run, and how it is held still, is said in tests/_demo_logs.py (paths
relative to the run's directory; the snapshot interval's clock-driven choice pinned; no key holds a time). Which
scenarios run is said there too (``REMEDIATED``, ``PLAIN``: every one, both ways).
"""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from _demo_logs import CASES, Case, run_case

REGEN = "PYTHONPATH=src python tests/golden/regen.py"


def _differs(what: str, case: Case, golden: Path, got: str) -> str:
    want = golden.read_text(encoding="utf-8") if golden.is_file() else ""
    if got == want:
        return ""
    diff = "".join(list(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(golden), "this run",
                                             n=1))[:40])
    return (f"{what} of `ampwatch demo {case.scenario}{' --remediate' if case.remediate else ''}` differs from "
            f"{golden.name}.\nIf the change is intended, regenerate with `{REGEN} {case.name}` (or no argument for "
            f"every case), read `git diff tests/golden` and commit the goldens with the change.\n{diff}")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_demo_event_log_and_output_are_unchanged(case: Case, tmp_path: Path) -> None:
    rc, out, log = run_case(case, tmp_path)
    assert rc == 0, f"the demo exited with {rc}:\n{out}"
    assert log, "the demo wrote no diagnoses.jsonl"
    problems = [p for p in (_differs("The event log", case, case.log_file, log),
                            _differs("What the demo prints", case, case.out_file, out)) if p]
    assert not problems, "\n\n".join(problems)
