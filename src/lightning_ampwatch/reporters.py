"""Every place a diagnosis, a metric or the summary goes while a run trains: the JSON event log, the timeline,
the console panel, logger text and the ``ampwatch/*`` metrics, behind one :class:`Reporters` object.

The event log is the source of truth: the console and the loggers never show anything it lacks. Each sink fails
alone, so a full disk or a broken logger costs that sink and never the run.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import warnings
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from lightning_ampwatch import compat, distributed, protocol
from lightning_ampwatch.summary import RunStats, judged, remedy_outcome, summary_lines
from lightning_ampwatch.taxonomy import Diagnosis, Finding, format_pow2
from lightning_ampwatch.timeline import TIMELINE_NAME, Timeline

EVENT_LOG_NAME = "diagnoses.jsonl"
#: Where a line goes without an adapter's own ``say``: the logger Lightning's ``rank_zero_info`` writes to.
_RANK_ZERO_LOG = logging.getLogger("lightning.pytorch.utilities.rank_zero")
LOG_WINDOWS = 4  # the skip rate is a running mean over this many log intervals


class EventLog:
    """``<log_dir>/ampwatch/diagnoses.jsonl``: one JSON object per line, appended and flushed at once."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(log_dir) / "ampwatch"
        self.path = self.dir / EVENT_LOG_NAME

    def append(self, diagnosis: Diagnosis) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(diagnosis.to_json() + "\n")


def format_value(value: object) -> str:
    """An evidence value in a few characters: floats to 6 digits, long lists as their ends."""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and len(value) > 8:
        return ("[" + ", ".join(format_value(v) for v in value[:3]) + ", ..., "
                + ", ".join(format_value(v) for v in value[-3:]) + "]")
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


#: The evidence rows a compact panel shows for each finding, in this order: the numbers that finding rests on
#: (the docs' "Findings" page says what each means). Every other row stays in ``Diagnosis.evidence``, the event
#: log and ``ampwatch report``; ``AmpWatch(verbose="full")`` prints them all.
KEY_EVIDENCE: dict[Finding, tuple[str, ...]] = {
    Finding.DATA_NONFINITE: ("nonfinite_where", "control_verdict"),
    Finding.FP32_UNSTABLE: ("control_verdict", "pattern", "divergence", "diverged_first", "loss_at_onset",
                            "loss_level", "loss_level_from", "loss_reference_why", "fp32_control_loss",
                            "lower_lr_reason"),
    Finding.FORWARD_OVERFLOW: ("replay_first_nonfinite_module", "live_first_nonfinite_module", "replay_loss",
                               "fp32_control_loss", "fp16_headroom_log2", "control_verdict"),
    Finding.INPUT_RANGE: ("input_absmax", "input_where", "control_verdict"),
    Finding.GRADIENT_OVERFLOW: ("pattern", "optimizer_skips", "skipped_in_row", "scale_history", "safe_scale",
                                "safe_scale_from", "replay_first_nonfinite_param", "control_verdict"),
    Finding.GROWTH_OVERFLOW: ("growth_steps", "skip_rate", "growth_interval", "growth_factor", "control_verdict"),
    Finding.LR_SCHEDULE: ("lr_event", "lr_before", "lr_after", "lr_change_step", "divergence", "control_verdict",
                          "loss_reference_why", "lower_lr_reason"),
    Finding.NORMAL_SCALING: ("skipped_steps", "steps", "scale", "withdrawn_by", "withdrawn_at"),
    Finding.NOT_REPRODUCED: ("control_verdict", "trajectory_window", "trajectory_amp_skipped"),
    Finding.LOSS_OUTSIDE_AUTOCAST: ("loss_op", "loss_dtype", "call_site", "code"),
    Finding.CLIP_BEFORE_UNSCALE: ("call_site", "via", "scale", "clip_limit", "limit_in_real_units"),
    Finding.STEP_OUTSIDE_SCALER: ("call_site", "optimizer", "optimizer_state"),
    Finding.MANUAL_PRESCALE: ("factor", "second_scaler_scale", "scale", "call_site"),
    Finding.FP16_PARAMETERS: ("float16_parameters", "first_float16"),
    Finding.EPS_UNDERFLOW: ("optimizer", "param_group", "eps", "eps_in_float16"),
}
#: Rows any finding shows when present: why nothing was replayed, and where a remedy took the run back to.
ALWAYS_SHOWN = ("weights_lost", "replay", "live_probe", "cofactors", "tried", "rollback")
#: Evidence the console never shows: the single batch's control verdict, kept in the evidence (and the event log)
#: when the trajectory control's verdict took its place as ``control_verdict``. Beside it, it would read as a
#: contradiction.
SUPERSEDED = ("batch_control_verdict",)
#: Rows the compact panel leaves out where the fixes tried on replays (``tried``) are shown: the single lower-LR
#: replay's verdict, judged by an older margin rule, beside the interventions' own LR line would read as a second,
#: sometimes contrary, answer to the same question. The event log and ``verbose="full"`` keep it.
SUPERSEDED_BY_TRIED = ("lower_lr_reason",)


#: What the compact panel calls each evidence row: plain words for the key names of the event log (which keep their
#: names: scripts read them). ``verbose="full"`` and ``ampwatch report --full`` show the keys as they are. Every
#: key the compact panel can show is here (``KEY_EVIDENCE``, ``ALWAYS_SHOWN``, and the rows a later update adds); a
#: test runs the demo scenarios and fails on a row without one.
EVIDENCE_LABELS: dict[str, str] = {
    # the batch and its data
    "nonfinite_where": "non-finite values in the batch",
    "input_absmax": "largest input magnitude",
    "input_where": "inputs past float16's range",
    "batch_idx": "batches replayed",
    # the replay at the run's precision, and where it failed
    "replay": "replay",
    "weights_lost": "weights after this step",
    "replay_note": "replay note",
    "replay_loss": "replayed loss at run precision",
    "replay_grads_finite": "gradients finite when replayed",
    "replay_unscaled_grads_finite": "gradients finite unscaled",
    "replay_grad_absmax": "largest gradient, unscaled",
    "replay_first_nonfinite_module": "first module to go non-finite",
    "replay_first_nonfinite_param": "first non-finite gradient",
    "live_probe": "live probe",
    "live_first_nonfinite_module": "first module non-finite (live)",
    "live_first_nonfinite_param": "first non-finite gradient, live",
    "fp16_headroom_log2": "headroom below float16's max",
    "precision": "precision",
    "loss": "loss",
    # the FP32 controls
    "control_verdict": "float32 control",
    "batch_control_verdict": "float32 control, one batch",
    "fp32_control_loss": "loss in float32",
    "fp32_control_grads_finite": "float32 gradients finite",
    "fp32_control_grad_absmax": "largest float32 gradient",
    "fp32_control": "float32 control replay",
    "fp32_control_first_nonfinite_param": "first non-finite in float32",
    "fp32_control_first_nonfinite_module": "first module non-finite, float32",
    "fp32_control_unscaled_grads_finite": "float32 grads finite unscaled",
    "fp32_control_grads": "float32 gradients",
    "replay_grads": "replayed gradients",
    "trajectory_verdict": "float32 replay verdict",
    "trajectory_reason": "float32 replay of the run says",
    "trajectory_window": "steps replayed in float32",
    "trajectory_snapshot_step": "replayed from snapshot at step",
    "trajectory_fp32_losses": "losses replayed in float32",
    "trajectory_amp_losses": "losses replayed at run precision",
    "trajectory_amp_skipped": "skips replayed at run precision",
    "trajectory_judged_by": "replay judged by",
    "trajectory_start_loss": "replay's first loss",
    "trajectory_snapshot_bytes": "snapshot size (bytes)",
    "trajectory_control": "float32 replay of the run",
    "trajectory_rank": "float32 replay run on rank",
    "lower_lr_verdict": "lower LR verdict",
    "lower_lr_reason": "same steps at a lower LR",
    "lower_lr_factor": "LR lowered by",
    "lower_lr_losses": "losses at the lower LR",
    "lower_lr_skipped": "skips at the lower LR",
    "lower_lr_margin": "fall needed to blame the LR",
    "superseded_amp_evidence": "AMP evidence set aside",
    # the loss and its level
    "divergence": "loss climb",
    "diverged_first": "loss climbed before any skip",
    "loss_at_onset": "loss at the onset",
    "loss_at_start": "loss at the start",
    "loss_level": "usual loss before the trouble",
    "loss_level_from": "usual loss taken from",
    "loss_reference": "healthy loss reference",
    "loss_reference_why": "healthy loss level",
    "loss_reference_steps": "healthy level from steps",
    # the scaler
    "pattern": "pattern of the skips",
    "skipped_in_row": "steps skipped in a row",
    "scale_history": "loss scale, skip by skip",
    "scale": "loss scale",
    "init_scale": "initial loss scale",
    "onset_scale": "loss scale at the onset",
    "safe_scale": "a safe loss scale",
    "safe_scale_from": "safe scale measured from",
    "skipped_steps": "steps skipped",
    "steps": "steps seen",
    "growth_steps": "steps where the scale grew",
    "span": "steps watched",
    "skip_rate": "share of steps skipped",
    "growth_interval": "scaler's growth interval",
    "growth_factor": "scaler's growth factor",
    "backoff_factor": "scaler's backoff factor",
    "withdrawn": "withdrawn",
    "withdrawn_by": "withdrawn by the alarm",
    "withdrawn_at": "withdrawn at step",
    "alarm_onset": "the alarm's onset step",
    "first_nonfinite_step": "first non-finite step",
    # the learning rate
    "lr_event": "learning-rate change",
    "lr_before": "learning rate before",
    "lr_after": "learning rate after",
    "lr_change_step": "learning rate changed at step",
    "lr_tried": "learning rates tried",
    # recipe checks
    "loss_op": "loss computed by",
    "loss_dtype": "loss dtype",
    "call_site": "in your code at",
    "code": "the line",
    "via": "called through",
    "clip_limit": "clip limit",
    "limit_in_real_units": "limit in unscaled units",
    "optimizer": "optimizer",
    "optimizer_skips": "the optimizer that skipped",
    "optimizer_state": "optimizer state",
    "factor": "loss multiplied by",
    "second_scaler_scale": "second scaler's scale",
    "float16_parameters": "float16 parameters",
    "first_float16": "first float16 parameter",
    "param_group": "parameter group",
    "eps": "optimizer eps",
    "eps_in_float16": "eps in float16",
    # ranks
    "fault_ranks": "ranks at fault",
    "investigated_on_rank": "investigated on rank",
    "reported_from_rank": "reported from rank",
    "judged_alone": "judged on one rank alone",
    # a remedy and what came of it
    "rollback": "rollback",
    # diagnosis by intervention: the fixes replayed, and what was seen beside the cause
    "tried": "fixes tried on replays",
    "cofactors": "co-factors",
    "remedy_details": "remedy changed",
    "skips_saved_estimate": "skipped steps saved (estimate)",
    "recovery": "recovery",
    "remedies_tried": "remedies tried before",
    "remedies_failed": "remedies that could not apply",
    "alarms_during_episode": "alarms during the episode",
    "treatment_failed": "treatment failed",
}
#: Scales shown as the user types them (``2**10``)
_POW2_KEYS = frozenset({"scale", "init_scale", "onset_scale", "safe_scale", "scale_history", "second_scaler_scale"})


def plain_row(key: str, value: object, diagnosis: Diagnosis | None = None) -> tuple[str, str]:
    """An evidence row as the compact panel shows it: its plain label (the key itself where none is set: a test
    keeps that from happening on the demo scenarios) and its value in a few plain words."""
    label = EVIDENCE_LABELS.get(key, key)
    if key == "fp16_headroom_log2" and isinstance(value, dict):
        return label, ", ".join(f"{where}: 2**{format_value(v)}" for where, v in value.items())
    if key in _POW2_KEYS:
        shown = [format_pow2(v) for v in value] if isinstance(value, list) else format_pow2(value)
        return label, format_value(shown) if isinstance(shown, list) else shown
    if key == "skip_rate" and isinstance(value, float):
        return label, f"{value:.0%}"
    if key == "rollback" and isinstance(value, str):
        return label, rollback_line(value, diagnosis)
    if key == "tried" and isinstance(value, str) and value.startswith("tried from step "):
        window, _, lines = value[len("tried "):].partition("): ")  # one line per fix tried
        return label, f"{window}):\n" + "\n".join(lines.split("; "))
    if key == "cofactors" and isinstance(value, list):
        return label, "; ".join(str(v) for v in value)
    return label, format_value(_reason(value))


_SKIPPED = re.compile(r"the batches of steps (\d+)\.\.(\d+) are skipped$")


def rollback_line(sentence: str, diagnosis: Diagnosis | None = None) -> str:
    """The rollback row of the compact panel: the evidence's sentence and, when the episode's batches were skipped,
    how many, and that ``snapshot_every`` (how far back the newest snapshot is) sets how many."""
    from lightning_ampwatch.records import RollbackKind, facts_of

    rollback = facts_of(diagnosis).rollback if diagnosis is not None else None
    if rollback is not None:
        if rollback.resumed_at is None or rollback.retrained is not None:
            return sentence
        skipped, kind = rollback.now - rollback.resumed_at, rollback.kind
    else:  # a diagnosis read back from the event log: its sentence is all there is
        match = _SKIPPED.search(sentence)
        if match is None:
            return sentence
        skipped = int(match.group(2)) - int(match.group(1)) + 1
        kind = RollbackKind.CHECKPOINT if "(the checkpoint file " in sentence else RollbackKind.SNAPSHOT
    batches = f"{skipped} batch{'es' if skipped != 1 else ''}, never trained on"
    if kind is RollbackKind.CHECKPOINT:
        return (f"{sentence}: {batches} (the newest checkpoint file from before the onset sets how many; "
                "snapshot_every keeps in-memory snapshots closer)")
    return f"{sentence}: {batches} (snapshot_every, the steps between snapshots, sets how many)"


def _reason(value: object) -> object:
    """A dict with a ``reason`` (``recovery``) shows as that sentence on the console."""
    if isinstance(value, dict) and isinstance(value.get("reason"), str):
        return value["reason"]
    return value


def panel_rows(diagnosis: Diagnosis, full: bool = False) -> list[tuple[str, object]]:
    """The evidence rows a panel shows: the finding's own (``KEY_EVIDENCE``) and ``ALWAYS_SHOWN``, or with
    ``full`` every row; never a ``SUPERSEDED`` one."""
    evidence = diagnosis.evidence
    if full:
        return [(k, v) for k, v in evidence.items() if k not in SUPERSEDED]
    keys = KEY_EVIDENCE.get(diagnosis.finding, ()) + ALWAYS_SHOWN
    hidden = SUPERSEDED_BY_TRIED if "tried" in evidence else ()
    return [(k, evidence[k]) for k in keys if k in evidence and k not in hidden]


def _evidence_table(rows: Sequence[tuple[str, object]], full: bool = True,
                    diagnosis: Diagnosis | None = None) -> Table:
    """The rows with their keys (``full``), or in plain words (:func:`plain_row`)."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim", no_wrap=not full)  # a plain label stays on one line (none is over 32 characters)
    table.add_column()
    for key, value in rows:
        label, text = (str(key), format_value(_reason(value))) if full else plain_row(str(key), value, diagnosis)
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


def applied_text(remedy: str, evidence: Mapping[str, Any]) -> str:
    """The remedy's name and, from the details it returned when applied, what it changed, in one line
    (``reduce_lr: learning rates x0.1: 5 -> 0.5``); the name alone when the details say nothing."""
    from lightning_ampwatch.remedies import REGISTRY, RemedyName

    details = evidence.get("remedy_details")
    if not isinstance(details, Mapping):
        return str(remedy)
    try:
        return f"{remedy}: {REGISTRY[RemedyName(remedy)].describe(details)}"
    except Exception:  # noqa: BLE001 - an unknown name or partial details: the name still says what was done
        return str(remedy)


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


def unremedied_reason(diagnosis: Diagnosis, diagnoses: Sequence[Diagnosis],
                      allowed: Iterable[str] | None) -> str | None:
    """Why an alarm got no remedy, in a few words for the summary (after "not fixed: see the advice above; "): no ladder, a ladder ``remediate`` leaves out
    (``reduce_lr`` is opt-in), rungs that could not apply here, or a ladder used up by the same finding's earlier
    alarms. ``None`` when nothing can be said (``allowed`` unknown) or remediation is off."""
    from lightning_ampwatch.remedies import ladder_for

    if allowed is None:
        return None
    allowed = frozenset(allowed)
    ladder = [str(getattr(r, "value", r)) for r in ladder_for(diagnosis)]
    if diagnosis.evidence.get("weights_lost") and diagnosis.finding is Finding.DATA_NONFINITE:
        lost = "the weights now hold NaN/inf and the run cannot recover"
        if not allowed or not any(r in allowed for r in ladder):
            return f"{lost}; remediate=True rolls back and skips the batch"
        return f"{lost}: no state from before the batch could be rolled back to"
    reason = _unremedied(diagnosis, diagnoses, allowed, ladder)
    if diagnosis.evidence.get("weights_lost"):  # another finding's weights gone non-finite: said after its reason
        lost = "the weights now hold NaN/inf"
        return lost if reason is None else f"{reason}; {lost}"
    return reason


def _unremedied(diagnosis: Diagnosis, diagnoses: Sequence[Diagnosis], allowed: frozenset[str],
                ladder: list[str]) -> str | None:
    if not ladder:
        return "no AMP setting fixes it"
    if not allowed:
        return None
    named = ", ".join(ladder)
    if not any(r in allowed for r in ladder):
        tail = ', remediate="all" allows it' if "reduce_lr" in ladder else ""
        return f"remediate= leaves out its ladder ({named}){tail}"
    rollback = diagnosis.evidence.get("rollback")
    if isinstance(rollback, str) and rollback.startswith("failed: "):
        return "its rollback failed, so no remedy was applied (the rollback row says why)"
    if "treatment_failed" in diagnosis.evidence:
        return "treating it failed inside AmpWatch, so no remedy was applied (treatment_failed says why)"
    failed = diagnosis.evidence.get("remedies_failed")
    if isinstance(failed, list) and failed:
        return f"no allowed remedy could apply here ({'; '.join(str(f) for f in failed)})"
    tried = [d.step for d in diagnoses
             if d.finding is diagnosis.finding and d.step < diagnosis.step and d.remedy in ladder]
    if tried:
        steps = ", ".join(str(s) for s in tried)
        return f"its ladder ({named}) is used up, tried for the alarm{'s' if len(tried) > 1 else ''} " \
               f"at step{'s' if len(tried) > 1 else ''} {steps}"
    return f"no rung of its ladder ({named}) was applied"


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


def ensure_writable(directory: Path) -> None:
    """Create ``directory`` and write a scratch file in it (the only check that holds for root, too); raises
    ``OSError`` when either fails."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
        pass


class Reporters:
    """Every place a diagnosis, a metric or the summary goes. Each sink fails alone: a failure is warned once
    (naming the sink, and the path for files) and never stops the other sinks or the caller."""

    def __init__(self, log_dir: str | os.PathLike[str], *, is_global_zero: bool, verbose: bool | str,
                 precision: str, device: torch.device, world_size: int = 1,
                 remedies: Iterable[str] | None = None, say: Callable[[str], None] | None = None) -> None:
        self.dir = Path(log_dir) / "ampwatch"
        self.remedies = None if remedies is None else frozenset(str(r) for r in remedies)  # what remediate= allows
        self._say = say or _RANK_ZERO_LOG.info  # the adapter's rank-zero info line
        self.is_global_zero = is_global_zero
        self.verbose = verbose
        # what the console last showed of each diagnosis: a later fact about it prints as a short update
        self._printed: dict[tuple[Any, int], Diagnosis] = {}
        self.event_log = EventLog(log_dir)
        self._warned: set[str] = set()
        self._console: Console | None = None  # made on first use: a Console does not pickle (ddp_spawn)
        self._step_metrics: compat.StepMetrics | None = None
        # The skip rate needs no cross-rank sum (under a scaler every rank skips the same steps) and its window
        # holds a few host integers: a deque does it at no cost, where torchmetrics' RunningMean took ~130 us a
        # log step. The non-finite count differs by rank: under DDP a sum across ranks (one process needs none, and
        # is spared it), which also carries the few counts the ranks agree on at log steps
        # (distributed.CrossRank.signals): one all-reduce for them all.
        self._skip_window: deque[tuple[int, int]] = deque(maxlen=LOG_WINDOWS)  # (steps, skipped) per interval
        self._nonfinite_sum = RankSums(distributed.SIGNALS, device) if world_size > 1 else None
        self._nonfinite_total = 0
        self.writable = is_global_zero and self._check_writable()
        self.timeline: Timeline | None = (
            Timeline(self.dir / TIMELINE_NAME, precision=precision) if self.writable else None)

    def _check_writable(self) -> bool:
        try:
            ensure_writable(self.dir)
        except OSError as err:
            self._warn("files", f"AmpWatch cannot write its logs to {self.dir} ({err}); the event log and the "
                                "timeline are off for this run, the console and the loggers still get every "
                                "diagnosis.")
            return False
        return True

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = Console(highlight=False)
        return self._console

    def _warn(self, sink: str, message: str) -> None:
        if sink not in self._warned:
            self._warned.add(sink)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def sink(self, sink: str, action: Callable[[], Any], where: Path | None = None) -> None:
        """Run one sink (also an adapter's own, such as its logger connector); a failure is warned once per sink
        and goes no further."""
        try:
            action()
        except Exception as err:  # noqa: BLE001 - one broken sink must not silence the others
            at = f" ({where})" if where is not None else ""
            self._warn(sink, f"AmpWatch could not write to the {sink}{at}: {type(err).__name__}: {err}. "
                             "Training and AmpWatch's other outputs go on.")

    def publish(self, diagnosis: Diagnosis, loggers: Sequence[Any]) -> None:
        """Rank zero: event log, timeline marker, console panel (if verbose), logger text. Never raises."""
        if not self.is_global_zero:
            return
        if self.writable:
            self.sink("event log", lambda: self.event_log.append(diagnosis), self.event_log.path)
        if self.timeline is not None:
            self.sink("timeline", lambda: self.timeline.record_diagnosis(diagnosis), self.timeline.path)
        if self.verbose:
            self.sink("console", lambda: self._print(diagnosis))
        for logger in loggers:
            writer = text_writer(logger)
            if writer is not None:
                self.sink(type(logger).__name__, lambda: writer(logger, diagnosis))  # noqa: B023 - called at once

    def carry_over(self, diagnoses: Sequence[Diagnosis]) -> None:
        """Rank zero, at the start of a resumed run: the diagnoses its checkpoint brought back, written to this run's
        event log where it does not hold them yet (a resumed run that logs to a new directory), so that the log and
        ``ampwatch report`` count the whole run as its summary does. Never raises."""
        if not (self.is_global_zero and self.writable and diagnoses):
            return

        def write() -> None:
            path = self.event_log.path
            held = set(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else set()
            for d in diagnoses:
                if d.to_json() not in held:
                    self.event_log.append(d)

        self.sink("event log", write, self.event_log.path)

    def _print(self, diagnosis: Diagnosis) -> None:
        key = (diagnosis.finding, diagnosis.step)
        before = self._printed.get(key)
        if before is None:
            more_at = str(self.dir.parent) if self.writable else None
            self.console.print(diagnosis_panel(diagnosis, self.verbose, more_at))
        else:
            self.console.print(update_panel(before, diagnosis, full=self.verbose == "full"))
        self._printed[key] = diagnosis

    def record_remedy(self, step: int, name: str) -> None:
        if self.timeline is not None:
            self.sink("timeline", lambda: self.timeline.record_remedy(step, name), self.timeline.path)

    def say(self, message: str) -> None:
        """One plain line on rank zero, prefixed with "AmpWatch: " unless it already names AmpWatch."""
        if self.is_global_zero:
            self._say(message if message.startswith("AmpWatch") else f"AmpWatch: {message}")

    def metric_tensors(self, trainer: Any, *, steps: int, skipped: int, nonfinite: int,
                       signals: Sequence[float] = (0.0, 0.0)) -> list[torch.Tensor]:
        """Under DDP, the cross-rank sums as one device vector, not read: it joins the log step's one packed read
        (its first value is the non-finite count, then ``signals``, each rank's increments of what the ranks agree
        on: see :class:`~lightning_ampwatch.distributed.CrossRank`). Empty with one process, or when there is no
        logger. Also takes the interval's counts."""
        if not trainer.loggers and self._nonfinite_sum is None:
            return []
        # Under DDP the cross-rank sum is taken with or without a logger: it is the agreement point at
        # which rank zero learns of a fault another rank judged alone (distributed.Relay)
        self._skip_window.append((steps, skipped))
        self._nonfinite_total += nonfinite
        if self._nonfinite_sum is None:
            return []  # one process: the host count is the total
        self._nonfinite_sum.update(torch.tensor([float(nonfinite), *signals], device=self._nonfinite_sum.device))
        return [self._nonfinite_sum.compute()]

    def log_metrics(self, trainer: Any, values: Sequence[float], *, skipped_total: int, scale: float | None,
                    send: Callable[[dict[str, float]], None] | None = None) -> None:
        """The ``ampwatch/*`` metrics (``values``: what :meth:`metric_tensors` gave, read), only when there is a
        logger, through Lightning's logger connector at the step Lightning logs at (see ``compat.StepMetrics``). Not
        ``self.log``: its bookkeeping costs milliseconds per call."""
        if not trainer.loggers:
            return
        nonfinite_total = values[0] if values else self._nonfinite_total
        steps = skipped = 0
        for n, k in self._skip_window:  # one pass, no generators: once per log step
            steps += n
            skipped += k
        skip_rate = skipped / steps if steps else 0.0
        metrics: dict[str, float] = {
            "ampwatch/skipped_steps": float(skipped_total),
            "ampwatch/nonfinite_losses": float(nonfinite_total),
            "ampwatch/skip_rate": float(skip_rate),
        }
        if scale is not None:
            metrics["ampwatch/scale"] = float(scale)
        self.sink("loggers", lambda: send(metrics) if send is not None else self._hold_metrics(trainer, metrics))

    def _hold_metrics(self, trainer: Any, metrics: dict[str, float]) -> None:
        """A Lightning trainer's way: in the same logger call as the step's own values (``compat.StepMetrics``)."""
        connector = compat.logger_connector(trainer)
        if self._step_metrics is None or self._step_metrics.connector is not connector:
            self._step_metrics = compat.StepMetrics(connector)
        self._step_metrics.hold(compat.batches_that_stepped(trainer), metrics)

    def flush(self, read_last_loss: Callable[[], float] | None = None) -> None:
        """Write the buffered timeline rows; ``read_last_loss`` samples the latest loss. Never raises."""
        if self.timeline is not None:
            self.sink("timeline", lambda: self.timeline.flush(read_last_loss), self.timeline.path)

    def finish(self, diagnoses: Sequence[Diagnosis], stats: RunStats | None) -> None:
        """End of fit: the exact counters and the last rows to the timeline, then the summary (rank zero,
        verbose)."""
        self.sink("loggers", self._release_metrics)
        if self.timeline is not None and stats is not None:
            scale = stats.scale if stats.precision in (None, "fp16") else None  # a bf16 fallback dropped the scaler
            self.sink("timeline", lambda: self.timeline.record_end(stats.steps, stats.skipped, stats.nonfinite,
                                                                   scale, precision=stats.precision),
                      self.timeline.path)
        self.flush()
        if self.is_global_zero and self.verbose and stats is not None:
            self.sink("console", lambda: self._print_summary(diagnoses, stats))

    def _print_summary(self, diagnoses: Sequence[Diagnosis], stats: RunStats) -> None:
        why = {(d.finding, d.step): unremedied_reason(d, diagnoses, self.remedies)
               for d in diagnoses if d.is_alarm and not d.remedy}
        for line in summary_lines(diagnoses, stats, self.dir.parent, why):
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _release_metrics(self) -> None:
        step_metrics, self._step_metrics = self._step_metrics, None
        if step_metrics is not None:
            step_metrics.detach()

    def close(self) -> None:
        """On an exception or at teardown: what is buffered goes to disk, the connector is left as found."""
        self.sink("loggers", self._release_metrics)
        if self.timeline is not None:
            self.sink("timeline", self.timeline.close, self.timeline.path)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_console"] = None
        state["_step_metrics"] = None  # bound to one trainer's connector, which a spawned process does not share
        return state


class RankSums:
    """A vector of counts summed over the ranks, each rank adding its increments: the non-finite count and the counts
    of :data:`lightning_ampwatch.distributed.SIGNALS`. One ``all_reduce`` of a few floats at ``compute`` (no read:
    the result joins the log step's packed read). A torchmetrics sum would gather the vector's shape first, a
    second collective at every log step."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        self.sums = torch.zeros(size, device=device)

    @property
    def device(self) -> torch.device:
        return self.sums.device

    def update(self, values: torch.Tensor) -> None:
        self.sums += values

    def compute(self) -> torch.Tensor:
        summed = self.sums.clone()
        if distributed.world_size() > 1:
            protocol.all_reduce(summed)
        return summed
