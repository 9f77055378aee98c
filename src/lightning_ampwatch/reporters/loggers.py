"""The text each logger that takes text is sent for a diagnosis (TensorBoard, MLflow, W&B): one writer per logger
kind. Loggers not listed get the ``ampwatch/*`` metrics only; the event log has the text.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from lightning_ampwatch.reporters.rows import applied_text, format_value
from lightning_ampwatch.summary import judged, remedy_outcome
from lightning_ampwatch.taxonomy import Diagnosis


def diagnosis_markdown(diagnosis: Diagnosis) -> str:
    """The text form sent to loggers that take text."""
    lines = [f"**{diagnosis.finding.value}** at step {diagnosis.step}"
             + (f" in `{diagnosis.location}`" if diagnosis.location else ""),
             "", diagnosis.summary, "", "| evidence | value |", "|---|---|"]
    lines += [f"| {k} | {format_value(v)} |" for k, v in diagnosis.evidence.items()]
    lines += ["", f"Fix: {diagnosis.advice}"]
    if diagnosis.remedy:
        lines.append(f"Applied: {applied_text(diagnosis.remedy, diagnosis.evidence)}")
    if judged(diagnosis):
        lines.append(f"Outcome: {remedy_outcome(diagnosis)}")
    return "\n".join(lines)




# One writer per logger kind that takes text; loggers not listed get metrics only (the jsonl has the text).
TextWriter = Callable[[Any, Diagnosis], None]


def _tensorboard(logger: Any, diagnosis: Diagnosis) -> None:
    logger.experiment.add_text("ampwatch/diagnosis", diagnosis_markdown(diagnosis), global_step=diagnosis.step)


def _mlflow(logger: Any, diagnosis: Diagnosis) -> None:
    logger.experiment.log_text(logger.run_id, diagnosis_markdown(diagnosis),
                               f"ampwatch/step{diagnosis.step:08d}_{diagnosis.finding.value}.md")


WANDB_COLUMNS = ["step", "finding", "location", "advice", "remedy", "outcome"]
_wandb_rows: "weakref.WeakKeyDictionary[Any, list[list[Any]]]" = weakref.WeakKeyDictionary()


def _wandb(logger: Any, diagnosis: Diagnosis) -> None:
    """W&B tables are immutable: each diagnosis logs the whole table so far, so the latest version has them all."""
    rows = _wandb_rows.setdefault(logger, [])
    rows.append([diagnosis.step, diagnosis.finding.value, diagnosis.location or "", diagnosis.advice,
                 diagnosis.remedy or "", diagnosis.outcome or ""])
    logger.log_text(key="ampwatch/diagnoses", columns=WANDB_COLUMNS, data=[list(r) for r in rows],
                    step=diagnosis.step)


TEXT_WRITERS: dict[str, TextWriter] = {
    "TensorBoardLogger": _tensorboard,
    "MLFlowLogger": _mlflow,
    "WandbLogger": _wandb,
}


def text_writer(logger: Any) -> TextWriter | None:
    """The writer for this logger's class or the nearest base class that has one."""
    for cls in type(logger).__mro__:
        writer = TEXT_WRITERS.get(cls.__name__)
        if writer is not None:
            return writer
    return None
