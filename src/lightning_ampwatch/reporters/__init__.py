"""Every place a diagnosis, a metric or the summary goes: one module per sink, behind :class:`Reporters`.

- :mod:`.event_log`: ``diagnoses.jsonl``, the source of truth (the console and the loggers never show what it lacks);
- :mod:`.rows`: the evidence rows users read, what each is called and how its value is written (the console panel,
  the logger text and ``ampwatch report`` all take their rows from here);
- :mod:`.panel`: the console's rich panel and its update panel;
- :mod:`.loggers`: the text sent to the loggers that take text (TensorBoard, MLflow, W&B);
- :mod:`.unremedied`: why an alarm got no remedy, in the summary's words;
- :mod:`.sinks`: :class:`Reporters`, which calls each sink, each failing alone, and the ``ampwatch/*`` metrics.

Every name is importable from ``lightning_ampwatch.reporters`` itself, as it was when this was one module.
"""

from lightning_ampwatch.reporters.event_log import EVENT_LOG_NAME, EventLog, ensure_writable
from lightning_ampwatch.reporters.loggers import TEXT_WRITERS, WANDB_COLUMNS, TextWriter, diagnosis_markdown, text_writer
from lightning_ampwatch.reporters.panel import diagnosis_panel, print_diagnosis, update_panel
from lightning_ampwatch.reporters.rows import (
    ALWAYS_SHOWN,
    EVIDENCE_LABELS,
    KEY_EVIDENCE,
    SUPERSEDED,
    SUPERSEDED_BY_TRIED,
    applied_text,
    format_value,
    panel_rows,
    plain_row,
    rollback_line,
)
from lightning_ampwatch.reporters.sinks import LOG_WINDOWS, RankSums, Reporters
from lightning_ampwatch.reporters.unremedied import unremedied_reason

__all__ = [
    "ALWAYS_SHOWN", "EVENT_LOG_NAME", "EVIDENCE_LABELS", "KEY_EVIDENCE", "LOG_WINDOWS", "SUPERSEDED",
    "SUPERSEDED_BY_TRIED", "TEXT_WRITERS", "WANDB_COLUMNS", "EventLog", "RankSums", "Reporters", "TextWriter",
    "applied_text", "diagnosis_markdown", "diagnosis_panel", "ensure_writable", "format_value", "panel_rows",
    "plain_row", "print_diagnosis", "rollback_line", "text_writer", "unremedied_reason", "update_panel",
]
