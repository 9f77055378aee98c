"""What ``tests/test_demo_event_logs.py`` holds and ``tests/golden/regen.py`` rewrites: the ``ampwatch demo`` scenarios'
event logs (``diagnoses.jsonl``) and what the demo prints (the panels, the summary, the recovery lines).

One function runs a case for both, so the goldens are written exactly as the test reads them.

What legitimately varies from run to run, and how it is held still (nothing is rewritten after the run):
- **Paths.** The demo runs in a fresh directory with the relative ``--root-dir demo``: every path it prints or
  logs is ``demo/...``, whatever the temporary directory is (an absolute path would also change where rich wraps a
  panel's lines). No key of ``diagnoses.jsonl`` holds a path in these scenarios (their locations are module names).
- **Wall-clock times.** No key of ``diagnoses.jsonl`` holds a time or a duration. Two choices are made from a
  clock: the snapshot interval (``steps.cadence.SnapshotCadence``, after the first three snapshots of
  ``snapshot_every="auto"``) and the log step's interval (``steps.cadence.LogCadence``, only from step 300 on: no
  demo runs that long). The snapshot interval would move the rollback's snapshot with the machine's load, so it is
  pinned to the interval asked for (``snapshot_interval`` answers ``every``, as it does on a fast machine); its
  sentence ("A snapshot takes ... ms") is then never said.
- **Width.** The console is 80 columns (``COLUMNS=80``), as a captured console is by default.
- **Threads.** One intra-op thread, as in ``conftest.py`` (float sums may round differently with more).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parent / "golden"
ROOT = "demo"  # the --root-dir, relative to the run's own directory


@dataclass(frozen=True)
class Case:
    scenario: str
    remediate: bool

    @property
    def name(self) -> str:
        return self.scenario + ("-remediate" if self.remediate else "")

    @property
    def log_file(self) -> Path:
        return GOLDEN / f"{self.name}.diagnoses.jsonl"

    @property
    def out_file(self) -> Path:
        return GOLDEN / f"{self.name}.out.txt"


#: Every scenario, with ``--remediate`` (the whole episode: alarm, investigation, decision, remedy, rollback, outcome,
#: publication and its update) and without (publication without a remedy). None is left out: on one CPU thread each
#: takes under a second (0.05-0.75 s measured, 16 cases in 11 s with pytest's start-up, on a loaded 2-core machine).
REMEDIATED = ("gradient_overflow", "scale_collapse", "growth_overflow", "lr_schedule", "nan_data", "input_range",
              "forward_overflow", "fp32_unstable", "diverging_lr", "healthy")
PLAIN = REMEDIATED
CASES = tuple(Case(s, True) for s in REMEDIATED) + tuple(Case(s, False) for s in PLAIN)


def run_case(case: Case, workdir: Path) -> tuple[int, str, str]:
    """Run ``ampwatch demo`` for ``case`` in ``workdir``: its exit status, what it printed, and its event log."""
    from lightning_ampwatch.steps import cadence
    from lightning_ampwatch.cli import main

    torch.set_num_threads(1)
    asked = cadence.snapshot_interval
    cadence.snapshot_interval = lambda copy_s, step_s, every, *args, **kwargs: every  # type: ignore[assignment]
    here, columns = os.getcwd(), os.environ.get("COLUMNS")
    out = io.StringIO()
    try:
        os.chdir(workdir)
        os.environ["COLUMNS"] = "80"
        args = ["demo", case.scenario, "--root-dir", ROOT] + (["--remediate"] if case.remediate else [])
        with contextlib.redirect_stdout(out):
            rc = main(args)
    finally:
        os.chdir(here)
        cadence.snapshot_interval = asked  # type: ignore[assignment]
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    log = workdir / ROOT / "ampwatch" / "diagnoses.jsonl"
    return rc, out.getvalue(), log.read_text(encoding="utf-8") if log.is_file() else ""
