"""The console panel: a diagnosis as a rich panel when it is made, and a short update panel for a later fact about
it (a remedy's outcome, the next rung, a withdrawal). Every string is a ``Text``, never markup.
"""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from lightning_ampwatch.reporters.rows import (
    SUPERSEDED,
    applied_text,
    format_value,
    panel_rows,
    plain_row,
    reason_of,
)
from lightning_ampwatch.summary import judged, remedy_outcome
from lightning_ampwatch.taxonomy import Diagnosis


def _evidence_table(rows: Sequence[tuple[str, object]], full: bool = True,
                    diagnosis: Diagnosis | None = None) -> Table:
    """The rows with their keys (``full``), or in plain words (:func:`plain_row`)."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim", no_wrap=not full)  # a plain label stays on one line (none is over 32 characters)
    table.add_column()
    for key, value in rows:
        label, text = (str(key), format_value(reason_of(value))) if full else plain_row(str(key), value, diagnosis)
        table.add_row(Text(label), Text(text))
    return table


def _title(diagnosis: Diagnosis, tail: str = "") -> Text:
    where = f" in {diagnosis.location}" if diagnosis.location else ""
    # a diagnosis another rank reached alone, which rank zero prints: the rank it comes from (distributed.Relay)
    rank = diagnosis.evidence.get("reported_from_rank")
    where += f" on rank {rank}" if isinstance(rank, int) and not isinstance(rank, bool) else ""
    return Text(f"AmpWatch: {diagnosis.finding.value} at step {diagnosis.step}{where}{tail}")


def _outcome_colour(diagnosis: Diagnosis) -> str:
    """Green for a verified recovery, red for none, yellow for an outcome that could not be judged."""
    return {"recovered": "green", "not_recovered": "red"}.get(diagnosis.outcome or "", "yellow")


def _outcome_line(diagnosis: Diagnosis) -> Text:
    return Text(f"Outcome: {remedy_outcome(diagnosis)}", style=_outcome_colour(diagnosis))


def diagnosis_panel(diagnosis: Diagnosis, verbose: bool | str = True, more_at: str | None = None) -> Panel:
    """A rich panel: headline, the one-line meaning, the evidence rows this finding rests on, the fix, the remedy
    and its outcome. ``verbose="full"`` shows every evidence row (but the superseded ``batch_control_verdict``);
    otherwise a dim last line counts the rows left out and says where they are (``more_at``). Every string is a
    ``Text``, never markup: a module name like ``[bold]x`` or a code line with ``losses[idx]`` prints as written."""
    full = verbose == "full"
    rows = panel_rows(diagnosis, full)
    parts: list[Any] = [Text(diagnosis.summary, style="bold")]
    if rows:
        parts.append(_evidence_table(rows, full, diagnosis))
    parts.append(Text("Fix: " + diagnosis.advice))
    if diagnosis.remedy:
        parts.append(Text(f"Applied: {applied_text(diagnosis.remedy, diagnosis.evidence)}", style="green"))
    if judged(diagnosis):
        parts.append(_outcome_line(diagnosis))
    left_out = sum(1 for k in diagnosis.evidence if k not in SUPERSEDED) - len(rows)
    if not full and left_out > 0:
        where = f"ampwatch report {more_at} --full" if more_at else "Diagnosis.evidence"
        parts.append(Text(f"{left_out} more row{'s' if left_out != 1 else ''}: {where}, "
                          'or AmpWatch(verbose="full")', style="dim"))
    return Panel(Group(*parts), title=_title(diagnosis), title_align="left",
                 border_style="red" if diagnosis.is_alarm else "blue", expand=False)




def update_panel(before: Diagnosis, after: Diagnosis, full: bool = False) -> Panel:
    """A later fact about a diagnosis already printed (a remedy's outcome, the next rung, a withdrawal): one short
    panel that refers to the first, with only what changed (its rows in plain words, or with ``full`` by key)."""
    parts: list[Any] = []
    if after.remedy != before.remedy and after.remedy:
        parts.append(Text(f"Applied: {applied_text(after.remedy, after.evidence)}"
                          + (f" (after {before.remedy})" if before.remedy else ""), style="green"))
    # a recovery not verified is all in its Outcome line: its reason, not a row saying the same beside it
    unsaid = ("remedy_details",) if after.outcome not in (None, "not_verified") else ("remedy_details", "recovery")
    changed = [(k, v) for k, v in after.evidence.items()
               if k not in SUPERSEDED and before.evidence.get(k) != v and k not in unsaid]
    if changed:
        parts.append(_evidence_table(changed, full, after))
    if after.advice != before.advice:
        parts.append(Text("Fix: " + after.advice))
    if judged(after):
        parts.append(_outcome_line(after))
    if not parts:
        parts.append(Text("updated (see the event log)", style="dim"))
    colour = (_outcome_colour(after) if judged(after) else "red") if after.is_alarm else "blue"
    return Panel(Group(*parts), title=_title(after, " (update)"), title_align="left",
                 border_style=colour, expand=False)


def print_diagnosis(diagnosis: Diagnosis, console: Console | None = None, verbose: bool | str = True,
                    more_at: str | None = None) -> None:
    (console or Console(highlight=False)).print(diagnosis_panel(diagnosis, verbose, more_at))
