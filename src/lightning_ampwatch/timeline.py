"""The per-step series behind ``ampwatch report --plot``: scale, skips, loss, learning rates, events.

Kept apart from the callback (which only feeds it host-side numbers it already has) so that recording stays a
few Python operations per step and the file format has one owner. Rows are buffered in memory and appended to
``<log_dir>/ampwatch/timeline.jsonl`` when the callback flushes (log steps, fit end), never per step.

Long runs stay small: every anomalous step is kept, and so are the steps around it, scale changes, big LR
moves and the log steps whose loss was read; the healthy stretches in between are sampled at a stride that
doubles each time ``healthy_rows_per_level`` rows have been taken at the current stride, so the file grows with
the logarithm of the run length (a few hundred healthy rows for a million steps at the default).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from lightning_ampwatch.taxonomy import Diagnosis

TIMELINE_NAME = "timeline.jsonl"
FORMAT_VERSION = 1

#: ``json.dumps(row, separators=(",", ":"))`` without a new encoder per row (rows are written at every log step)
_to_json = json.JSONEncoder(separators=(",", ":")).encode


#: The timeline's descriptor: appended to (created if absent), bytes as they are (no newline translation)
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)


def _loss_json(loss: float) -> float | str:
    """Strict JSON has no NaN/inf: non-finite losses are written as the strings ``"nan"``, ``"inf"``."""
    return loss if math.isfinite(loss) else str(loss)


class Timeline:
    """Records one row per optimizer step (bounded, see the module docstring) and appends them on ``flush``.

    ``path=None`` makes a timeline that records nothing (every rank but zero), so the callback never branches.
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, precision: str | None = None,
                 healthy_rows_per_level: int = 16, max_anomalous_rows: int = 100_000,
                 max_buffered_rows: int = 4096, lr_change: float = 1.25) -> None:
        if healthy_rows_per_level < 1 or max_anomalous_rows < 1 or max_buffered_rows < 1 or lr_change <= 1:
            raise ValueError("Timeline limits must be positive and lr_change > 1, got "
                             f"healthy_rows_per_level={healthy_rows_per_level}, max_anomalous_rows="
                             f"{max_anomalous_rows}, max_buffered_rows={max_buffered_rows}, lr_change={lr_change}")
        self.path = None if path is None else Path(path)
        self.precision = precision
        self.healthy_rows_per_level = healthy_rows_per_level
        self.max_anomalous_rows = max_anomalous_rows
        self.max_buffered_rows = max_buffered_rows
        self.lr_change = lr_change
        self.stride = 1
        self.rows_kept = 0
        self.anomalous_kept = 0
        self._taken_at_stride = 0
        self._buffer: list[dict[str, Any]] = []
        self._held: dict[str, Any] | None = None  # the latest healthy row not kept: kept if an anomaly follows
        self._held_args: tuple[int, float | None, tuple[float, ...]] | None = None  # the same, not yet a row
        self._last_kept: dict[str, Any] | None = None
        self._last_lrs: tuple[float, ...] | None = None  # the LRs as last written (rows omit unchanged LRs)
        self._last_row: dict[str, Any] | None = None  # the latest step's row, until it is written
        self._last_step: int | None = None
        self._previous_anomalous = False
        self._started = False
        self._thinning_noted = False
        self._file: int | None = None  # the file's descriptor, once opened

    @property
    def enabled(self) -> bool:
        return self.path is not None

    # ------------------------------------------------------------------ recording (per step: host numbers only)

    def record_step(self, step: int, *, skipped: bool, scale: float | None = None, loss: float | None = None,
                    loss_finite: bool | None = None, lrs: Sequence[float] = ()) -> None:
        """One resolved optimizer step. ``scale`` is the scale the step ran with; ``loss`` only if already read."""
        if self.path is None:
            return
        if self._held_args is not None:
            self._materialize_held()
        if not self._started:
            self._start(step)
        row: dict[str, Any] = {"step": int(step)}
        if scale is not None:
            row["scale"] = float(scale)
        if skipped:
            row["skipped"] = True
        if loss_finite is not None:
            row["loss_finite"] = bool(loss_finite)
        if loss is not None:
            row["loss"] = float(loss)
        row["lrs"] = tuple(lrs)
        self._last_row = row
        self._last_step = row["step"]
        anomalous = skipped or loss_finite is False
        if anomalous and self.anomalous_kept < self.max_anomalous_rows:
            if self._held is not None:
                self._keep(self._held)  # the healthy step just before, so the plot shows where it started
            self._held = None
            self.anomalous_kept += 1
            self._keep(row)
        else:
            if anomalous and not self._thinning_noted:
                self._thinning_noted = True
                self._buffer.append({"event": "note", "step": int(step), "text":
                                     f"more than {self.max_anomalous_rows} anomalous steps: later ones are sampled"})
            if self._wanted_healthy(row):
                self._keep(row)
                self._held = None
            else:
                self._held = row
        self._previous_anomalous = anomalous
        if len(self._buffer) >= self.max_buffered_rows:
            self.flush()  # log steps that never come (huge log_every_n_steps): memory stays bounded

    def record_clean(self, step: int, scale: float | None, lrs: tuple[float, ...]) -> None:
        """A healthy step on the per-step fast path: when the row would not be kept, only its numbers are held
        (a tuple, no row built) in case the next step is anomalous or a log step reads its loss."""
        last = self._last_kept
        if (self.path is None or last is None or self._previous_anomalous or step % self.stride == 0
                or scale != last.get("scale") or lrs != last["lrs"]):
            self.record_step(step, skipped=False, scale=scale, lrs=lrs)
            return
        self._held_args = (step, scale, lrs)
        self._held = self._last_row = None
        self._last_step = step

    def record_clean_run(self, steps: Sequence[int], scales: Sequence[float | None],
                         lrss: Sequence[tuple[float, ...]]) -> None:
        """:meth:`record_clean` for a run of healthy steps taken in later, at once, as columns (one entry per step,
        in step order): the same rows and state as one call per step. The steps :meth:`record_clean` would only hold
        are passed over (found with C-level counts where the steps are consecutive), and only the last of such a
        stretch is held: each holding replaces the one before it, unread."""
        if self.path is None:
            return
        n, i = len(steps), 0
        consecutive = steps[-1] - steps[0] == n - 1  # strictly increasing: no gap
        while i < n:
            last = self._last_kept
            if last is None or self._previous_anomalous:
                self.record_step(steps[i], skipped=False, scale=scales[i], lrs=lrss[i])
                i += 1
                continue
            stride, last_scale, last_lrs = self.stride, last.get("scale"), last["lrs"]
            j = -1
            if consecutive and last_scale == last_scale:  # the next multiple of the stride, then a change before it
                j = min(i + (-steps[i]) % stride, n)
                if scales[i:j].count(last_scale) != j - i or lrss[i:j].count(last_lrs) != j - i:
                    j = -1  # a change in the stretch: step by step (a NaN scale too, above: count's identity)
            if j < 0:
                j = i
                while j < n:
                    if steps[j] % stride == 0 or scales[j] != last_scale or lrss[j] != last_lrs:
                        break
                    j += 1
            if j > i:  # held, as record_clean holds it
                step = steps[j - 1]
                self._held_args = (step, scales[j - 1], lrss[j - 1])
                self._held = self._last_row = None
                self._last_step = step
            if j < n:
                self.record_step(steps[j], skipped=False, scale=scales[j], lrs=lrss[j])
                j += 1
            i = j

    def _materialize_held(self) -> None:
        step, scale, lrs = self._held_args  # type: ignore[misc]
        self._held_args = None
        row: dict[str, Any] = {"step": int(step), "lrs": tuple(lrs)}
        if scale is not None:
            row["scale"] = float(scale)
        self._held = self._last_row = row

    def record_loss(self, loss: float) -> None:
        """The loss of the latest step, read at a log step: kept in the series (the row is kept too)."""
        if self._held_args is not None:
            self._materialize_held()
        row = self._last_row
        if self.path is None or row is None or "loss" in row:
            return
        row["loss"] = float(loss)
        row["loss_finite"] = math.isfinite(loss)
        if row is self._held:
            self._keep(row)
            self._held = None

    def record_diagnosis(self, diagnosis: Diagnosis) -> None:
        """A marker for the plot; the full diagnosis lives in ``diagnoses.jsonl``."""
        if self.path is None:
            return
        event: dict[str, Any] = {"event": "diagnosis", "step": int(diagnosis.step),
                                 "finding": diagnosis.finding.value}
        if diagnosis.location:
            event["location"] = diagnosis.location
        if diagnosis.remedy:
            event["remedy"] = diagnosis.remedy
        if self._last_step is not None:
            event["seen_at"] = self._last_step
        self._buffer.append(event)

    def record_remedy(self, step: int, name: str) -> None:
        """A remedy applied at ``step`` (drawn as a marker with its name)."""
        if self.path is None:
            return
        self._buffer.append({"event": "remedy", "step": int(step), "name": str(name)})

    def record_end(self, steps: int, skipped: int, nonfinite: int, scale: float | None,
                   precision: str | None = None) -> None:
        """The run's exact counters at fit end (the rows alone are sampled), for the report's header; ``precision``
        is the run's at the end (``bf16`` after a fallback), ``scale`` None once there is no scaler."""
        if self.path is None:
            return
        event: dict[str, Any] = {"event": "end", "step": self._last_step if self._last_step is not None else 0,
                                 "steps": int(steps), "skipped": int(skipped), "nonfinite": int(nonfinite)}
        if scale is not None:
            event["scale"] = float(scale)
        if precision is not None:
            event["precision"] = str(precision)
        self._buffer.append(event)

    # ------------------------------------------------------------------ writing

    def flush(self, read_last_loss: Callable[[], float] | None = None) -> None:
        """Append the buffered rows. ``read_last_loss`` (called at most once, only here) samples the loss."""
        if self.path is None:
            return
        if read_last_loss is not None and (self._held_args is not None or (
                self._last_row is not None and "loss" not in self._last_row)):
            self.record_loss(read_last_loss())
        if not self._buffer:
            return
        lines = list(map(_to_json, map(self._encode, self._buffer)))
        lines.append("")  # the last row's newline
        self._buffer.clear()
        if self._last_row is not None and self._last_row is not self._held:
            self._last_row = None  # written: a loss read later could not reach the file
        fd = self._file
        if fd is None:  # opened once per fit and kept: an open per log step costs more than the rows
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._file = os.open(self.path, _APPEND, 0o666)
        # One write of the bytes on the unbuffered descriptor: in the file at every log step, so a crash keeps what
        # led up to it (no text layer, no buffer to flush)
        data = "\n".join(lines).encode("utf-8")
        written = os.write(fd, data)
        while written < len(data):  # a short write (a full disk raises): the rest
            data = data[written:]
            written = os.write(fd, data)

    def close(self) -> None:
        """Write what is buffered and let the file go (fit end, teardown). Recording may go on and reopen it."""
        self.flush()
        if self._file is not None:
            fd, self._file = self._file, None
            os.close(fd)

    def __del__(self) -> None:  # a timeline let go without ``close``: its descriptor goes with it, as a file's would
        fd = self.__dict__.get("_file")
        if fd is not None:
            self._file = None
            try:
                os.close(fd)
            except OSError:
                pass

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = None
        return state

    # ------------------------------------------------------------------ internals

    def _start(self, step: int) -> None:
        self._started = True
        header: dict[str, Any] = {"event": "start", "step": int(step), "format": FORMAT_VERSION}
        if self.precision:
            header["precision"] = self.precision
        self._buffer.append(header)

    def _wanted_healthy(self, row: dict[str, Any]) -> bool:
        last = self._last_kept
        if last is None or self._previous_anomalous:
            return True  # the first step, and the first clean step after trouble
        if row.get("scale") != last.get("scale"):
            return True  # a growth (or a reconcile): the scale line must bend at the right step
        if self._lr_moved(row["lrs"], last["lrs"]):
            return True
        if row["step"] % self.stride == 0:
            self._taken_at_stride += 1
            if self._taken_at_stride >= self.healthy_rows_per_level:
                self._taken_at_stride = 0
                self.stride *= 2
            return True
        return False

    def _lr_moved(self, now: tuple[float, ...], before: tuple[float, ...]) -> bool:
        if len(now) != len(before):
            return True
        for a, b in zip(now, before):
            if (a > 0) != (b > 0):
                return a != b
            if a > 0 and not (1 / self.lr_change <= a / b <= self.lr_change):
                return True
        return False

    def _keep(self, row: dict[str, Any]) -> None:
        if row is self._last_kept:
            return
        self._last_kept = row
        self.rows_kept += 1
        self._buffer.append(row)

    def _encode(self, row: dict[str, Any]) -> dict[str, Any]:
        if "event" in row:
            return row
        out = row.copy()  # the row less its LRs, in its own key order (C calls, not a comprehension per row)
        lrs = out.pop("lrs", ())
        if "loss" in out:
            out["loss"] = _loss_json(out["loss"])
        if lrs != self._last_lrs:
            out["lrs"] = list(lrs)
            self._last_lrs = lrs
        return out


# ---------------------------------------------------------------------- reading


@dataclass
class TimelineData:
    """A timeline file parsed into columns (one entry per kept step) plus its events."""

    path: Path
    steps: list[int] = field(default_factory=list)
    scales: list[float | None] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    loss_finite: list[bool | None] = field(default_factory=list)
    losses: list[float | None] = field(default_factory=list)
    lrs: list[tuple[float, ...]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    precision: str | None = None
    earlier_runs: int = 0  # runs written to the same file before this one (ignored)
    starts: list[int] = field(default_factory=list)  # the step of each fit's start row in this run (a resume, a refit)

    def __len__(self) -> int:
        return len(self.steps)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def complete(self) -> bool:
        """Whether the timeline runs to its fit's end (an end row at or after its last row): its diagnosis markers are
        then every diagnosis the watch made, and the end row holds the exact counters. A killed run's timeline stops
        at its last log step; an end with rows after it belongs to a fit that was resumed."""
        ends = self.of_kind("end")
        return bool(ends) and bool(self.steps) and ends[-1].get("step", -1) >= self.steps[-1]


def _parse_loss(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        return float(value)  # "nan", "inf", "-inf"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"loss {value!r} is not a number")


#: The JSON parser's messages (``json.JSONDecodeError.msg``) in plain words
_JSON_ERRORS = {
    "Invalid control character at": "a control character (a raw newline, tab or other byte below 0x20) inside a "
                                    "string",
    "Expecting value": "a value was expected here",
    "Unterminated string starting at": "a string is never closed",
    "Expecting ',' delimiter": "a comma was expected here",
    "Expecting ':' delimiter": "a colon was expected here",
    "Expecting property name enclosed in double quotes": "a key in double quotes was expected here",
    "Extra data": "more text follows the end of the JSON value",
    "Invalid \\escape": "a backslash escape that JSON does not have",
    "Invalid \\uXXXX escape": "a \\u escape without four hex digits",
}


def json_error(err: ValueError, lineno: int) -> str:
    """Why a line is not JSON, in plain words: the line, the column, and what the parser found there."""
    if not isinstance(err, json.JSONDecodeError):
        return f"line {lineno} is not valid JSON ({err})"
    msg = err.msg
    what = _JSON_ERRORS.get(msg, msg[:1].lower() + msg[1:])
    return f"line {lineno} is not valid JSON: at column {err.colno}, {what}"


def jsonl_rows(path: Path, row_noun: str, file_noun: str,
               cut: list[int] | None = None) -> Iterator[tuple[int, Any]]:
    """Stream a JSON-lines file as (line number, value), one line in memory at a time.

    A last line cut short (no newline and not JSON: a crash or a full disk mid-write) is left out with one
    warning (and its number appended to ``cut``), so the run before it can still be read; any other bad line
    raises ``ValueError`` naming the file, the line and the column.
    """
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError as err:
                    if not line.endswith("\n"):  # only the last line can lack its newline
                        warnings.warn(f"{path}:{lineno}: the last line is cut short (the run was interrupted while "
                                      "writing it?); it is left out", RuntimeWarning, stacklevel=2)
                        if cut is not None:
                            cut.append(lineno)
                        return
                    raise ValueError(f"{path}:{lineno}: not {row_noun} ({json_error(err, lineno)})") from err
                yield lineno, value
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not {file_noun} (not UTF-8 text: {err.reason})") from err


def read_timeline(path: str | os.PathLike[str]) -> TimelineData:
    """Parse a timeline file, streamed; a bad line raises ``ValueError`` naming the file and the line.

    A file holding several runs (a directory reused without a logger) yields the last run: a ``start`` event
    whose step does not continue the previous rows begins a new run. A resumed run continues the same one.
    """
    path = Path(path)
    data = TimelineData(path)
    carried_lrs: tuple[float, ...] = ()
    for lineno, row in jsonl_rows(path, "an AmpWatch timeline row", "an AmpWatch timeline"):
        try:
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("each line must be a JSON object with an integer 'step'")
            kind = row.get("event")
            if kind == "start":
                if data.steps and row["step"] <= data.steps[-1]:
                    data = TimelineData(path, earlier_runs=data.earlier_runs + 1)
                    carried_lrs = ()
                data.precision = row.get("precision", data.precision)
                data.starts.append(row["step"])
                continue
            if kind is not None:
                data.events.append(row)
                continue
            if "lrs" in row:
                carried_lrs = tuple(float(v) for v in row["lrs"])
            scale = row.get("scale")
            data.steps.append(row["step"])
            data.scales.append(None if scale is None else float(scale))
            data.skipped.append(bool(row.get("skipped", False)))
            data.loss_finite.append(row.get("loss_finite"))
            data.losses.append(_parse_loss(row.get("loss")))
            data.lrs.append(carried_lrs)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}:{lineno}: not an AmpWatch timeline row ({err})") from err
    return data
