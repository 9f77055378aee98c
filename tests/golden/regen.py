"""Rewrite the goldens of tests/test_demo_event_logs.py: ``python tests/golden/regen.py [scenario[-remediate] ...]``.

Run it from the repository root with the sources on the path (``PYTHONPATH=src``), only when a change to the event
log or to what the demo prints is intended; then read ``git diff tests/golden`` and commit the goldens with the change
that made them, saying why they moved.
"""

from __future__ import annotations

import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared _demo_logs

from _demo_logs import CASES, run_case  # noqa: E402


def main(names: list[str]) -> int:
    for name in ("lightning.pytorch", "lightning.fabric"):  # as conftest.py: Lightning's chatter is not the demo's
        logging.getLogger(name).setLevel(logging.WARNING)
    unknown = set(names) - {c.name for c in CASES}
    if unknown:
        print(f"regen.py: unknown case(s) {sorted(unknown)}; the cases are: {', '.join(c.name for c in CASES)}")
        return 2
    for case in CASES:
        if names and case.name not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            rc, out, log = run_case(case, Path(tmp))
        if rc != 0:
            print(f"regen.py: {case.name}: the demo exited with {rc}; goldens not written")
            return 1
        case.log_file.write_text(log, encoding="utf-8")
        case.out_file.write_text(out, encoding="utf-8")
        print(f"wrote {case.log_file.name} ({len(log.splitlines())} events) and {case.out_file.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
