"""The event log, ``<log_dir>/ampwatch/diagnoses.jsonl``: the source of truth of what a run was told. The console and
the loggers never show anything it lacks, and ``ampwatch report`` reads it back.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lightning_ampwatch.taxonomy import Diagnosis

EVENT_LOG_NAME = "diagnoses.jsonl"


class EventLog:
    """``<log_dir>/ampwatch/diagnoses.jsonl``: one JSON object per line, appended and flushed at once."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(log_dir) / "ampwatch"
        self.path = self.dir / EVENT_LOG_NAME

    def append(self, diagnosis: Diagnosis) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(diagnosis.to_json() + "\n")



def ensure_writable(directory: Path) -> None:
    """Create ``directory`` and write a scratch file in it (the only check that holds for root, too); raises
    ``OSError`` when either fails."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
        pass
