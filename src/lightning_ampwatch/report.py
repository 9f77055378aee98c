"""``ampwatch report``: a run's logs read back from disk and shown as a table, a plot and an HTML page.

The files are streamed, never read whole, and what is shown is bounded: a run with a hundred thousand
diagnoses reads in seconds and prints a screenful.
"""

from __future__ import annotations

import base64
import heapq
import html
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

# the figure is drawn in plot.py (timeline_figure is named here too: `ampwatch report`'s reader, drawing, page)
from lightning_ampwatch.plot import render_plot, timeline_figure  # noqa: F401
from lightning_ampwatch.reporters import EVENT_LOG_NAME, format_value, panel_rows
from lightning_ampwatch.summary import RECOVERY_GAP, Episode, counts_line, episodes, remedy_outcome, timeline_stats
from lightning_ampwatch.taxonomy import Diagnosis, Finding
from lightning_ampwatch.timeline import TIMELINE_NAME, TimelineData, jsonl_rows, read_timeline

MAX_EPISODES = 50  # rows in the report's table; the others are counted, and all are in the event log
MAX_TEXT = 400  # characters of one shown value (a location, an advice, an evidence value)

# The types each field of a diagnosis line may hold, and the same in words; a line that breaks one is named.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "finding": ((str,), "a string"), "step": ((int,), "an integer"),
    "location": ((str, type(None)), "a string or null"), "evidence": ((dict,), "an object"),
    "advice": ((str,), "a string"), "remedy": ((str, type(None)), "a string or null"),
    "outcome": ((str, type(None)), "a string or null"),
}


def _clip(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _finding(row: Any) -> Finding:
    """Check one event-log line's fields and types (cheap, every line); the ``Diagnosis`` itself is built only
    for the lines shown. A wrong field raises ``ValueError`` naming it, its value and what it must be."""
    if not isinstance(row, dict):
        raise ValueError(f"each line must be a JSON object, not {type(row).__name__}")
    for key in ("finding", "step"):
        if key not in row:
            raise ValueError(f"{key!r} is missing")
    for key, (types, wanted) in _FIELD_TYPES.items():
        if key in row and (not isinstance(row[key], types) or isinstance(row[key], bool)):
            raise ValueError(f"{key!r} must be {wanted}, not {_clip(repr(row[key]), 60)}")
    return Finding(row["finding"])


@dataclass
class LoggedDiagnoses:
    """An event log as the report shows it: the earliest ``MAX_EPISODES`` diagnoses in full, the rest counted."""

    shown: list[Diagnosis] = field(default_factory=list)
    total: int = 0
    alarm_steps: list[int] = field(default_factory=list)  # every alarm's step: the episode spans end at the next
    keys: set[tuple[str, int]] = field(default_factory=set)  # every record's (finding, step)
    cut_line: int | None = None  # the number of a last line cut short and left out (the run died writing it)

    @property
    def alarms(self) -> int:
        return len(self.alarm_steps)

    @property
    def hidden(self) -> int:
        return self.total - len(self.shown)


def read_diagnoses(path: str | os.PathLike[str], keep: int = MAX_EPISODES) -> LoggedDiagnoses:
    """Stream an event log; a bad line raises ``ValueError`` naming the file and the line."""
    path = Path(path)
    out = LoggedDiagnoses()
    earliest: list[tuple[int, int, Diagnosis]] = []  # a max-heap (negated) of the ``keep`` earliest by step
    seen: set[tuple[Finding, int]] = set()
    cut: list[int] = []
    for lineno, row in jsonl_rows(path, "an AmpWatch diagnosis", "an AmpWatch event log", cut):
        try:
            finding = _finding(row)
            key = (finding, row["step"])
            if key in seen:  # a later fact about a record already read (a remedy's outcome, the next rung, a
                _replace(earliest, key, Diagnosis.from_dict(row))  # withdrawal): it takes the record's place
                continue
            seen.add(key)
            out.keys.add((finding.value, row["step"]))
            out.total += 1
            if finding.is_alarm:
                out.alarm_steps.append(row["step"])
            rank = (-row["step"], -lineno)
            if len(earliest) < keep:
                heapq.heappush(earliest, (*rank, Diagnosis.from_dict(row)))
            elif rank > earliest[0][:2]:
                heapq.heapreplace(earliest, (*rank, Diagnosis.from_dict(row)))
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{path}:{lineno}: not an AmpWatch diagnosis ({err})") from err
    out.shown = [d for _, _, d in sorted(earliest, reverse=True)]
    out.alarm_steps.sort()
    out.cut_line = cut[0] if cut else None
    return out


def _replace(heap: list[tuple[int, int, Diagnosis]], key: tuple[Finding, int], updated: Diagnosis) -> None:
    for i, (step, lineno, d) in enumerate(heap):
        if (d.finding, d.step) == key:
            heap[i] = (step, lineno, updated)  # same order keys: the heap stays a heap
            return


# ---------------------------------------------------------------------------- `ampwatch report`


@dataclass
class RunFiles:
    """The AmpWatch files of one run, found from whatever path the user named."""

    source: Path
    diagnoses: Path | None = None
    timeline: Path | None = None
    others: list[Path] = field(default_factory=list)  # further ampwatch directories under ``source``, not shown

    @property
    def directory(self) -> Path:
        return (self.diagnoses or self.timeline or self.source).parent


def _ampwatch_files(directory: Path) -> tuple[Path | None, Path | None]:
    diagnoses, timeline = directory / EVENT_LOG_NAME, directory / TIMELINE_NAME
    return (diagnoses if diagnoses.is_file() else None), (timeline if timeline.is_file() else None)


def locate_run(path: str | os.PathLike[str]) -> RunFiles:
    """Resolve a run directory, a log directory, an ``ampwatch`` directory or one of its two files.

    Raises ``FileNotFoundError`` naming the path when there is nothing to read; of several runs under a
    directory the most recently written one is taken (the others are listed in ``RunFiles.others``).
    """
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such file or directory")
    if source.is_dir() and source.name in (EVENT_LOG_NAME, TIMELINE_NAME):
        raise IsADirectoryError(f"{source}: a directory, not the AmpWatch log file its name says; name the run "
                                "directory or the ampwatch directory that holds the logs")
    if source.is_file():
        if source.name == TIMELINE_NAME:
            diagnoses, _ = _ampwatch_files(source.parent)
            return RunFiles(source, diagnoses=diagnoses, timeline=source)
        _, timeline = _ampwatch_files(source.parent) if source.name == EVENT_LOG_NAME else (None, None)
        return RunFiles(source, diagnoses=source, timeline=timeline)
    for directory in (source, source / "ampwatch"):
        diagnoses, timeline = _ampwatch_files(directory)
        if diagnoses or timeline:
            return RunFiles(source, diagnoses=diagnoses, timeline=timeline)
    found = sorted({p.parent for name in (EVENT_LOG_NAME, TIMELINE_NAME) for p in source.rglob(f"ampwatch/{name}")
                    if p.is_file()},
                   key=lambda d: max(f.stat().st_mtime for f in d.iterdir() if f.is_file()), reverse=True)
    if not found:
        raise FileNotFoundError(f"{source}: no AmpWatch logs here (looked for ampwatch/{EVENT_LOG_NAME} and "
                                f"ampwatch/{TIMELINE_NAME} in it and below it)")
    diagnoses, timeline = _ampwatch_files(found[0])
    return RunFiles(source, diagnoses=diagnoses, timeline=timeline, others=found[1:])


def load_run(files: RunFiles) -> tuple[LoggedDiagnoses, TimelineData | None]:
    """Read both files; a malformed one raises ``ValueError`` naming the file (and the line)."""
    diagnoses = read_diagnoses(files.diagnoses) if files.diagnoses is not None else LoggedDiagnoses()
    timeline = read_timeline(files.timeline) if files.timeline is not None else None
    return diagnoses, timeline


def run_title(files: RunFiles) -> str:
    """The run's own name: ``<run>/lightning_logs/version_0`` for a logger's versioned directory (a bare
    ``version_0`` names nothing), else the directory that holds ``ampwatch/``."""
    log_dir = files.directory.parent if files.directory.name == "ampwatch" else files.directory
    if re.fullmatch(r"version_\d+", log_dir.name):
        return "/".join(log_dir.parts[-3:])
    return log_dir.name or str(log_dir)


def _steps_said(steps: Sequence[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


@dataclass(frozen=True)
class RecordGap:
    """The event log does not account for the run: the timeline holds non-finite or skipped steps, or names
    diagnoses, that no record in ``diagnoses.jsonl`` explains, because the file is missing, empty or damaged."""

    state: str  # "missing", "empty" or "damaged"
    why: str  # the file's state in words
    shows: str  # what the timeline shows
    unrecorded: tuple[tuple[str, int], ...] = ()  # diagnoses the timeline names that the event log lacks

    def sentences(self) -> list[str]:
        """What the report says in place of its table (or under it)."""
        lines = [f"The record of this run is lost: {self.why}.", f"The timeline shows {self.shows}."]
        if self.unrecorded:
            named = ", ".join(f"{finding} at step {step}" for finding, step in self.unrecorded[:5])
            more = f" and {len(self.unrecorded) - 5} more" if len(self.unrecorded) > 5 else ""
            lines.append(f"It names {len(self.unrecorded)} diagnos{'es' if len(self.unrecorded) != 1 else 'is'} "
                         f"that no record holds: {named}{more}.")
        elif self.state == "missing":
            lines.append("No record explains them (lost, or the run ended before AmpWatch judged them).")
        lines.append("This report cannot say what went wrong, nor that the run was healthy; the run's console "
                     "output (AmpWatch's panels and summary) may still hold the diagnoses.")
        return lines


def _event_log_state(files: RunFiles, diagnoses: LoggedDiagnoses) -> tuple[str, str]:
    if files.diagnoses is None:
        return "missing", f"{EVENT_LOG_NAME} is missing from {files.directory}"
    if diagnoses.cut_line is not None:
        return "damaged", (f"{files.diagnoses} is damaged: its last line ({diagnoses.cut_line}) is cut short and was "
                           "left out")
    if not diagnoses.total:
        return "empty", f"{files.diagnoses} is empty"
    return "ok", ""


def _trouble(timeline: TimelineData | None) -> tuple[str, bool]:
    """What the timeline shows, in words, and whether it holds trouble that AmpWatch had time to record: a
    non-finite loss, or a skipped step with at least ``RECOVERY_GAP`` steps after it (the watch has called every
    such skip by then, normal or not)."""
    if timeline is None or not timeline.steps:
        return "nothing: there is no timeline beside the event log", False
    skipped = [s for s, k in zip(timeline.steps, timeline.skipped) if k]
    nonfinite = [s for s, f in zip(timeline.steps, timeline.loss_finite) if f is False]
    stats = timeline_stats(timeline)
    parts = []
    if skipped:
        n = stats.skipped if stats is not None else len(skipped)
        parts.append(f"{n} of {stats.steps if stats else len(timeline)} steps skipped by the scaler "
                     f"({_steps_said(skipped)})")
    if nonfinite:
        n = stats.nonfinite if stats is not None else len(nonfinite)
        parts.append(f"{n} non-finite loss{'es' if n != 1 else ''} ({_steps_said(nonfinite)})")
    if not parts:
        return f"{counts_line(stats) if stats else 'its steps'}, with no skipped step and no non-finite loss", False
    judged = bool(nonfinite) or timeline.steps[-1] - skipped[0] >= RECOVERY_GAP
    return " and ".join(parts), judged


def record_gap(files: RunFiles, diagnoses: LoggedDiagnoses, timeline: TimelineData | None) -> RecordGap | None:
    """Where the event log does not account for what the timeline shows; None where it does.

    The record is lost when the timeline names diagnoses the event log lacks (the watch writes a marker to the
    timeline for each one); when no record could be read from an event log that is there (emptied, or its only
    line cut short); or when there is no event log and a timeline cut short (a killed run) holds trouble the watch
    would have recorded. A complete timeline that names no diagnosis is the watch's own word that it made none."""
    state, why = _event_log_state(files, diagnoses)
    shows, judged = _trouble(timeline)
    named = set() if timeline is None else {(str(e.get("finding")), e["step"]) for e in timeline.of_kind("diagnosis")}
    unrecorded = tuple(sorted(named - diagnoses.keys, key=lambda k: (k[1], k[0])))
    if unrecorded:
        if state == "ok":
            state, why = "damaged", (f"{files.diagnoses} is damaged: it lacks {len(unrecorded)} of the "
                                     f"{len(named)} diagnoses the timeline names")
        return RecordGap(state, why, shows, unrecorded)
    if diagnoses.total:
        return None
    if state in ("empty", "damaged"):
        return RecordGap(state, why, shows)
    if timeline is not None and judged and not timeline.complete:
        return RecordGap(state, why, shows)
    return None


def report_episodes(diagnoses: LoggedDiagnoses, timeline: TimelineData | None) -> list[Episode]:
    """The shown diagnoses as episodes; their spans end at the next alarm, shown or not."""
    return episodes(diagnoses.shown, timeline, alarm_steps=diagnoses.alarm_steps)


def more_line(diagnoses: LoggedDiagnoses, files: RunFiles) -> str:
    """The line under a capped table: how many episodes it leaves out and where they all are."""
    return f"... {diagnoses.hidden} more episode{'s' if diagnoses.hidden != 1 else ''}, all in {files.diagnoses}"


def episodes_table(rows: Sequence[Episode]) -> Table:
    """One row per diagnosis: steps, finding, location, advice, remedy."""
    table = Table(show_lines=True, header_style="bold", expand=False)
    table.add_column("steps", no_wrap=True)
    table.add_column("finding", no_wrap=True)
    table.add_column("location", overflow="fold", max_width=28)
    table.add_column("advice", ratio=1, min_width=24, overflow="fold")  # a long code fix wraps, never cut
    table.add_column("remedy", overflow="fold")
    for row in rows:
        d = row.diagnosis
        steps = Text(row.steps)
        if row.anomalous is not None and d.is_alarm:
            steps.append(f"\n{row.anomalous} bad step{'s' if row.anomalous != 1 else ''}", style="dim")
        remedy = (Text(_clip(remedy_outcome(d)), style="green" if d.outcome == "recovered" else "yellow") if d.remedy
                  else Text("none" if d.is_alarm else "-", style="dim"))
        table.add_row(steps, Text(d.finding.value, style="bold red" if d.is_alarm else "blue"),
                      Text(_clip(d.location or "-")), Text(_clip(d.advice)), remedy)
    return table


def report_lines(files: RunFiles, diagnoses: LoggedDiagnoses, timeline: TimelineData | None) -> list[str]:
    """The plain-text header of a report: which run, and what happened in it."""
    lines = [f"AmpWatch report: {files.directory}"]
    if files.others:
        lines.append(f"  ({len(files.others)} other run(s) under {files.source}; showing the newest. "
                     "Name one of their ampwatch directories to see it.)")
    if timeline is not None and timeline.earlier_runs:
        lines.append(f"  ({timeline.earlier_runs} earlier run(s) in {timeline.path.name}; showing the last.)")
    stats = timeline_stats(timeline)
    alarms = diagnoses.alarms
    counts = counts_line(stats) if stats is not None else "no timeline beside the event log"
    fallback = next((e for e in timeline.of_kind("remedy") if e.get("name") == "bf16_fallback"), None) \
        if timeline is not None else None
    if fallback is not None:
        counts += f", bf16 from step {fallback['step']} on (bf16_fallback dropped the scaler)"
    gap = record_gap(files, diagnoses, timeline)
    if alarms:
        verdict = f"{alarms} alarm{'s' if alarms != 1 else ''}"
        if gap is not None:
            verdict += f", and the record is incomplete ({gap.state} {EVENT_LOG_NAME})"
    elif gap is not None:
        verdict = f"no record explains it: {EVENT_LOG_NAME} is {gap.state}"
    elif stats is not None and stats.steps == 0:
        verdict = "no optimizer step: nothing was judged"
    elif stats is not None and stats.nonfinite:
        verdict = "no alarm in the event log"  # yet non-finite losses were counted: not called healthy
    else:
        verdict = "no alarm: a healthy run"
    lines.append(f"  {counts}; {verdict}.")
    return lines


def print_report(files: RunFiles, diagnoses: LoggedDiagnoses, timeline: TimelineData | None,
                 console: Console, full: bool = False) -> None:
    """The header and the episode table; with ``full``, then each shown diagnosis as the console's panel with every
    evidence row (``AmpWatch(verbose="full")``'s panel), in step order."""
    for line in report_lines(files, diagnoses, timeline):
        console.print(line, markup=False, highlight=False)
    gap = record_gap(files, diagnoses, timeline)
    if diagnoses.total:
        console.print(episodes_table(report_episodes(diagnoses, timeline)))
        if diagnoses.hidden:
            # one line, never wrapped: the path in it stays whole, to copy (a long temporary directory passed 120)
            console.print(more_line(diagnoses, files), markup=False, highlight=False, soft_wrap=True)
        if full:
            from lightning_ampwatch.reporters import diagnosis_panel

            for d in sorted(diagnoses.shown, key=lambda d: d.step):
                console.print(diagnosis_panel(d, verbose="full"))
    elif gap is None:
        console.print(f"  {no_diagnosis_line(timeline)}", markup=False, highlight=False)
    if gap is not None:
        for line in gap.sentences():
            console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)  # never break a path


def no_diagnosis_line(timeline: TimelineData | None) -> str:
    """The line in place of an empty table, where the event log accounts for the run (see :func:`record_gap`):
    "No diagnoses were made." only where the timeline holds no non-finite loss."""
    stats = timeline_stats(timeline)
    if stats is not None and stats.nonfinite:
        return (f"No diagnosis was made (the timeline, complete to the fit's end, names none), yet it holds "
                f"{stats.nonfinite} non-finite loss{'es' if stats.nonfinite != 1 else ''}: something went wrong "
                "that the scaler does not see (an empty batch's mean, a NaN the gradients do not reach).")
    return "No diagnoses were made."


def _evidence_html(d: Diagnosis) -> str:
    """The rows this finding rests on first (the console panel's, and a remedy's recovery), then the others under
    a fold."""
    if not d.evidence:
        return "-"

    def rows(items: Sequence[tuple[str, object]]) -> str:
        return "".join(f"<tr><td>{html.escape(_clip(str(k)))}</td><td>{html.escape(_clip(format_value(v)))}</td></tr>"
                       for k, v in items)

    key = panel_rows(d) + [(k, d.evidence[k]) for k in ("recovery", "remedies_tried") if k in d.evidence]
    shown = {k for k, _ in key}
    rest = [(k, v) for k, v in d.evidence.items() if k not in shown]
    out = f'<table class="evidence">{rows(key)}</table>' if key else ""
    if rest:
        out += (f"<details><summary>the other evidence ({len(rest)} row{'s' if len(rest) != 1 else ''})</summary>"
                f'<table class="evidence">{rows(rest)}</table></details>')
    return out


def render_html(out: str | os.PathLike[str], files: RunFiles, diagnoses: LoggedDiagnoses,
                timeline: TimelineData | None) -> None:
    """One self-contained page, at most 1280 px wide: the report header, the plot (embedded) and the episode
    table, each episode with the evidence its finding rests on first and the rest folded."""
    title = html.escape(run_title(files))
    parts = ["<!doctype html>", '<html><head><meta charset="utf-8">'
             f"<title>AmpWatch report: {title}</title><style>",
             "body{font-family:sans-serif;max-width:1240px;margin:1em auto;padding:0 1em;color:#222}",
             "table.episodes{border-collapse:collapse;table-layout:fixed;width:100%}"
             ".episodes>tbody>tr>td,.episodes>tbody>tr>th{border:1px solid #ccc;padding:.4em .5em;"
             "vertical-align:top;text-align:left;overflow-wrap:anywhere}"
             ".alarm{color:#b00;font-weight:bold}.normal{color:#35c}img{max-width:100%}"
             ".evidence{border-collapse:collapse;font-size:88%;width:100%}"
             ".evidence td{padding:0;overflow-wrap:anywhere;vertical-align:top}"
             ".evidence td:first-child{color:#555;padding:0 .6em 0 0;white-space:nowrap}summary{cursor:pointer;color:#555;font-size:88%}"
             ".dim{color:#666}.lost{color:#b00}",
             "</style></head><body>", f"<h1>AmpWatch report: {title}</h1>"]
    header = report_lines(files, diagnoses, timeline)
    parts.append(f'<p class="dim">{html.escape(str(files.directory))}</p>')  # the title already names the run
    parts += [f"<p>{html.escape(line.strip())}</p>" for line in header[1:]]
    if timeline is not None and timeline.steps:
        buffer = io.BytesIO()
        render_plot(timeline, diagnoses.shown, buffer, title=f"AmpWatch timeline: {run_title(files)}", fmt="png")
        encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
        parts.append(f'<p><img alt="AmpWatch timeline" src="data:image/png;base64,{encoded}"></p>')
    if diagnoses.total:
        parts.append('<table class="episodes"><colgroup><col style="width:7%"><col style="width:13%">'
                     '<col style="width:11%"><col style="width:35%"><col style="width:20%"><col style="width:14%">'
                     "</colgroup><tr><th>steps</th><th>finding</th><th>location</th><th>evidence</th><th>advice</th>"
                     "<th>remedy</th></tr>")
        for row in report_episodes(diagnoses, timeline):
            d = row.diagnosis
            remedy = remedy_outcome(d) if d.remedy else ("none" if d.is_alarm else "-")
            parts.append(f"<tr><td>{html.escape(row.steps)}</td>"
                         f"<td class=\"{'alarm' if d.is_alarm else 'normal'}\">{d.finding.value}</td>"
                         f"<td>{html.escape(_clip(d.location or '-'))}</td><td>{_evidence_html(d)}</td>"
                         f"<td>{html.escape(d.advice)}</td><td>{html.escape(_clip(remedy))}</td></tr>")
        parts.append("</table>")
        if diagnoses.hidden:
            parts.append(f"<p>{html.escape(more_line(diagnoses, files))}</p>")
    gap = record_gap(files, diagnoses, timeline)
    if gap is not None:
        parts += [f'<p class="lost">{html.escape(line)}</p>' for line in gap.sentences()]
    elif not diagnoses.total:
        parts.append(f"<p>{html.escape(no_diagnosis_line(timeline))}</p>")
    parts.append("</body></html>")
    Path(out).write_text("\n".join(parts) + "\n", encoding="utf-8")
