"""What happened in a run, in a few lines: the end-of-fit console summary, and the counters and episodes of
``ampwatch report`` (read back from the timeline).

Pure Python over plain numbers, diagnoses and a parsed timeline, so the callback and the CLI say the same thing.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import groupby, islice
from pathlib import Path
from typing import Any, Mapping, Sequence

from lightning_ampwatch.machine import Thresholds
from lightning_ampwatch.taxonomy import Diagnosis, Finding, format_pow2
from lightning_ampwatch.timeline import TimelineData

RECOVERY_GAP = Thresholds().recovery_steps  # clean steps that end an episode's span, as in the machine


@dataclass(frozen=True)
class RunStats:
    """The counters a summary rests on."""

    steps: int
    skipped: int = 0
    nonfinite: int = 0
    scale: float | None = None  # the loss scale at the end; None without a scaler
    precision: str | None = None
    #: skips the machine was still judging when the run ended, in words ("the skip at step 9 was"); None: none
    pending: str | None = None

    @classmethod
    def of_run(cls, machine: Any, mirror: Any) -> "RunStats | None":
        """The counters of a watched run, from its machine (None before one is built: no counters) and the scaler's
        host mirror (None without a scaler: no scale)."""
        if machine is None:
            return None
        state = machine.state
        pending = (f"the skips from step {state.streak.first_step} on were" if state.streak is not None else
                   f"the skip at step {state.isolated_since} was" if state.isolated_since is not None else None)
        return cls(steps=machine.steps_seen, skipped=machine.skipped_total, nonfinite=machine.nonfinite_total,
                   scale=mirror.scale if mirror is not None else None, precision=machine.mode.value, pending=pending)


def counts_line(stats: RunStats) -> str:
    """"60 optimizer steps, 8 skipped by the scaler (13%), loss scale 2**8 at the end". No scale is named once
    the run has no scaler (bf16, 32, or after a bf16 fallback dropped it)."""
    parts = [f"{stats.steps} optimizer step{'s' if stats.steps != 1 else ''}"]
    if stats.skipped:
        share = f" ({stats.skipped / stats.steps:.0%})" if stats.steps else ""
        parts.append(f"{stats.skipped} skipped by the scaler{share}")
    if stats.nonfinite:
        parts.append(f"{stats.nonfinite} non-finite loss{'es' if stats.nonfinite != 1 else ''}")
    if stats.scale is not None and stats.precision in (None, "fp16"):
        parts.append(f"loss scale {format_pow2(stats.scale)} at the end")
    return ", ".join(parts)


def timeline_stats(timeline: TimelineData | None) -> RunStats | None:
    """Counters for the report header, from the timeline (every anomalous step is in it)."""
    if timeline is None or not timeline.steps:
        return None
    ends = timeline.of_kind("end")
    # The exact counters, written at fit end. Its step is the run's last step, which the sampled rows need not
    # hold (a healthy last step is often left out); an end with rows after it belongs to a fit that was resumed.
    if timeline.complete:
        end = ends[-1]
        precision = end.get("precision", timeline.precision)
        scale = end.get("scale") if precision in (None, "fp16") else None
        steps, skipped, nonfinite = _fits_counted(ends, timeline.starts)
        return RunStats(steps=steps, skipped=skipped, nonfinite=nonfinite, scale=scale, precision=precision)
    # No end (a crash): what the rows say. The last row's scale, not the last one seen: after a bf16 fallback the
    # rows carry none.
    fell_back = any(e.get("name") == "bf16_fallback" for e in timeline.of_kind("remedy"))
    return RunStats(steps=timeline.steps[-1] - timeline.steps[0] + 1, skipped=sum(timeline.skipped),
                    nonfinite=sum(1 for f in timeline.loss_finite if f is False),
                    scale=timeline.scales[-1], precision="bf16" if fell_back else timeline.precision)


def _fits_counted(ends: Sequence[dict[str, Any]], starts: Sequence[int]) -> tuple[int, int, int]:
    """The run's counters from its fits' end rows. A fit resumed from a checkpoint counts on from it (its end row
    holds the whole run's counts); a second ``fit`` of the same watch counts its own steps only (it starts afresh),
    so its counts are added to the earlier fits'."""
    steps = skipped = nonfinite = 0
    for end in ends:
        step = int(end.get("step", 0))
        began = max((s for s in starts if s <= step), default=0)
        counts = (int(end.get("steps", 0)), int(end.get("skipped", 0)), int(end.get("nonfinite", 0)))
        if counts[0] <= step - began + 1 and began > 0:  # this fit's own steps only: after the earlier fits'
            steps, skipped, nonfinite = steps + counts[0], skipped + counts[1], nonfinite + counts[2]
        else:  # the whole run so far (a first fit, or one resumed from a checkpoint)
            steps, skipped, nonfinite = counts
    return steps, skipped, nonfinite


def judged(d: Diagnosis) -> bool:
    """Whether a remedied diagnosis's watch is over: recovered, not recovered, or ended with its recovery not verified
    (``"not_verified"``, the reason in ``evidence["recovery"]``; an event log written before 0.1 says None there);
    False while the remedy is still watched."""
    return d.remedy is not None and (d.outcome is not None or isinstance(d.evidence.get("recovery"), dict))


def remedy_outcome(d: Diagnosis) -> str:
    """What a remedy did, in the words the summary and the report use: "fixed" only for a verified recovery."""
    recovery = d.evidence.get("recovery") if isinstance(d.evidence.get("recovery"), dict) else {}
    why = recovery.get("reason") if isinstance(recovery, dict) else None
    if d.outcome == "recovered":
        return f"fixed with {d.remedy}, recovery verified"
    if d.outcome == "relapsed":
        return f"{d.remedy} applied, relapsed: {why}" if why else f"{d.remedy} applied, relapsed"
    if d.outcome == "not_recovered":
        return f"{d.remedy} applied, not fixed: {why}" if why else f"{d.remedy} applied, not fixed"
    return f"{d.remedy} applied; recovery not verified: {why}" if why else \
        f"{d.remedy} applied; recovery not verified (the run ended first)"


def summary_lines(diagnoses: Sequence[Diagnosis], stats: RunStats, log_dir: str | Path | None = None,
                  why_unfixed: Mapping[tuple[Finding, int], str] | None = None) -> list[str]:
    """The end-of-fit summary: one line for a healthy run, a few for one that had trouble, in step order.
    ``why_unfixed`` says, per (finding, step) of an alarm without a remedy, why it got none."""
    alarms = [d for d in diagnoses if d.is_alarm]
    if not alarms and stats.steps == 0:
        return ["AmpWatch: no optimizer step was seen, so nothing was judged."]
    if not alarms and stats.nonfinite:
        return [f"AmpWatch: {counts_line(stats)}; no alarm, but a non-finite loss on a step whose gradients were "
                "finite says something is wrong outside what the scaler sees (an empty batch's mean, a NaN the "
                "gradients do not reach): not a healthy run."]
    if not alarms and stats.pending:  # a skip is the scaler finding its level only once clean steps follow it
        return [f"AmpWatch: {counts_line(stats)}; no alarm, but the fit ended while {stats.pending} still being "
                "judged, so it is not called healthy."]
    if not alarms:
        if any(d.finding is Finding.NORMAL_SCALING for d in diagnoses):
            return [f"AmpWatch: {counts_line(stats)}; the skips were the scaler finding its level. Healthy run."]
        return [f"AmpWatch: {counts_line(stats)}; nothing to report. Healthy run."]
    lines = [f"AmpWatch summary: {counts_line(stats)}; {len(alarms)} alarm{'s' if len(alarms) != 1 else ''}."]
    rows: list[tuple[int, str]] = []  # (step, what follows it)
    for d in sorted(diagnoses, key=lambda d: d.step):  # stable: records of one step keep their order
        where = f" in {d.location}" if d.location else ""
        if d.remedy:
            outcome = remedy_outcome(d)
        elif d.is_alarm:
            why = (why_unfixed or {}).get((d.finding, d.step))
            outcome = "not fixed: see the advice above" + (f"; {why}" if why else "")
        elif d.withdrawn:
            outcome = f"withdrawn: a {d.evidence.get('withdrawn_by')} episode followed"
        else:
            outcome = "normal"
        rows.append((d.step, f"{d.finding.value}{where} ({outcome})"))
    lines.extend(_folded(rows))
    if log_dir is not None:
        lines.append(f"  Details in {Path(log_dir) / 'ampwatch'}; draw them with: "
                     f"ampwatch report {log_dir} --plot timeline.png")
    return lines


#: A run of this many rows alike in a row (a fault that recurs every few batches) is shown as its first row and one
#: line for the rest.
FOLD_AT = 3


def _folded(rows: Sequence[tuple[int, str]]) -> list[str]:
    """The summary's rows, a run of ``FOLD_AT`` or more alike in a row (the same finding, place and outcome) shown
    as its first row and a line with the others' count and steps (the first five and the last)."""
    out: list[str] = []
    for text, run in groupby(rows, key=lambda row: row[1]):
        steps = [step for step, _ in run]
        if len(steps) < FOLD_AT:
            out.extend(f"  step {step:>6}  {text}" for step in steps)
            continue
        rest = steps[1:]
        shown = rest if len(rest) <= 6 else [*rest[:5], "...", rest[-1]]
        out += [f"  step {steps[0]:>6}  {text}",
                f"  {'':>11}  and {len(rest)} more alike, at steps {', '.join(str(s) for s in shown)}"]
    return out


@dataclass(frozen=True)
class Episode:
    """One diagnosis with the stretch of anomalous steps it covers (from the timeline, when there is one)."""

    diagnosis: Diagnosis
    first: int
    last: int
    anomalous: int | None  # anomalous steps in the span; None without a timeline

    @property
    def steps(self) -> str:
        if self.last == self.first:
            return str(self.first)
        return f"{self.first}-{self.last}"


def episodes(diagnoses: Sequence[Diagnosis], timeline: TimelineData | None = None,
             recovery_gap: int = RECOVERY_GAP, alarm_steps: Sequence[int] | None = None) -> list[Episode]:
    """Each alarm spans from its onset over anomalous steps no more than ``recovery_gap`` apart, up to the next
    alarm; ``NORMAL_SCALING`` covers just its step. ``alarm_steps`` (sorted) are every alarm's onset when
    ``diagnoses`` holds only some of them."""
    ordered = sorted(diagnoses, key=lambda d: d.step)
    bad: list[int] = []
    if timeline is not None:
        bad = sorted(s for s, skip, fin in zip(timeline.steps, timeline.skipped, timeline.loss_finite)
                     if skip or fin is False)
    onsets = list(alarm_steps) if alarm_steps is not None else [d.step for d in ordered if d.is_alarm]
    out: list[Episode] = []
    for d in ordered:
        if not d.is_alarm or timeline is None:
            out.append(Episode(d, d.step, d.step, None))
            continue
        after = bisect_right(onsets, d.step)
        limit = onsets[after] if after < len(onsets) else math.inf
        last, count = d.step, 0
        for step in islice(bad, bisect_left(bad, d.step), None):
            if step >= limit or step - last > recovery_gap:
                break
            last, count = step, count + 1
        out.append(Episode(d, d.step, last, count))
    return out
