"""Turning diagnoses into what people read: the JSON event log, the console panel, logger text.

The event log is the source of truth: the console and the loggers never show anything it lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

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

    @staticmethod
    def read(path: str | os.PathLike[str]) -> list[Diagnosis]:
        """Parse an event log; names the line that is not valid."""
        out: list[Diagnosis] = []
        with Path(path).open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    out.append(Diagnosis.from_dict(json.loads(line)))
                except (ValueError, TypeError, KeyError) as err:
                    raise ValueError(f"{path}:{lineno}: not an AmpWatch diagnosis ({err})") from err
        return out


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and len(value) > 8:
        return "[" + ", ".join(_fmt(v) for v in value[:3]) + ", ..., " + ", ".join(_fmt(v) for v in value[-3:]) + "]"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def diagnosis_panel(diagnosis: Diagnosis) -> Panel:
    """A rich panel: headline, evidence table, advice, remedy."""
    evidence = Table.grid(padding=(0, 2))
    evidence.add_column(style="dim")
    evidence.add_column()
    for key, value in diagnosis.evidence.items():
        evidence.add_row(key, _fmt(value))
    parts: list[Any] = [Text(diagnosis.finding.summary, style="bold"), evidence, Text("Fix: " + diagnosis.advice)]
    if diagnosis.remedy:
        parts.append(Text(f"Applied: {diagnosis.remedy}", style="green"))
    style = "red" if diagnosis.is_alarm else "blue"
    where = f" in {diagnosis.location}" if diagnosis.location else ""
    title = f"AmpWatch: {diagnosis.finding.value} at step {diagnosis.step}{where}"
    return Panel(Group(*parts), title=title, title_align="left", border_style=style, expand=False)


def print_diagnosis(diagnosis: Diagnosis, console: Console | None = None) -> None:
    (console or Console(highlight=False)).print(diagnosis_panel(diagnosis))


def diagnosis_markdown(diagnosis: Diagnosis) -> str:
    """The text form sent to loggers that take text."""
    lines = [f"**{diagnosis.finding.value}** at step {diagnosis.step}"
             + (f" in `{diagnosis.location}`" if diagnosis.location else ""),
             "", diagnosis.finding.summary, "", "| evidence | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in diagnosis.evidence.items()]
    lines += ["", f"Fix: {diagnosis.advice}"]
    if diagnosis.remedy:
        lines.append(f"Applied: {diagnosis.remedy}")
    return "\n".join(lines)


# One writer per logger kind that takes text; loggers not listed get metrics only (the jsonl has the text).
TextWriter = Callable[[Any, Diagnosis], None]


def _tensorboard(logger: Any, diagnosis: Diagnosis) -> None:
    logger.experiment.add_text("ampwatch/diagnosis", diagnosis_markdown(diagnosis), global_step=diagnosis.step)


def _mlflow(logger: Any, diagnosis: Diagnosis) -> None:
    logger.experiment.log_text(logger.run_id, diagnosis_markdown(diagnosis),
                               f"ampwatch/step{diagnosis.step:08d}_{diagnosis.finding.value}.md")


def _wandb(logger: Any, diagnosis: Diagnosis) -> None:
    logger.log_text(key="ampwatch/diagnoses", columns=["step", "finding", "location", "advice", "remedy"],
                    data=[[diagnosis.step, diagnosis.finding.value, diagnosis.location or "", diagnosis.advice,
                           diagnosis.remedy or ""]], step=None)


TEXT_WRITERS: dict[str, TextWriter] = {
    "TensorBoardLogger": _tensorboard,
    "MLFlowLogger": _mlflow,
    "WandbLogger": _wandb,
}


def write_text(loggers: Iterable[Any], diagnosis: Diagnosis) -> None:
    for logger in loggers:
        for cls in type(logger).__mro__:
            writer = TEXT_WRITERS.get(cls.__name__)
            if writer is not None:
                writer(logger, diagnosis)
                break
