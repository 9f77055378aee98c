"""The evidence rows users read: which rows a finding's panel shows (``KEY_EVIDENCE``, ``ALWAYS_SHOWN``), what each
is called in plain words (``EVIDENCE_LABELS``) and how its value is written. The console panel, the logger text and
``ampwatch report`` (its table and its HTML page) all take their rows from here, so they say the same thing.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from lightning_ampwatch.taxonomy import Diagnosis, Finding, format_pow2


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
#: Rows any finding shows when present: why nothing was replayed, where replays from after the onset started (a
#: resumed fit), and where a remedy took the run back to.
ALWAYS_SHOWN = ("weights_lost", "replay", "live_probe", "cofactors", "trajectory_from", "tried", "rollback")
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
    "trajectory_from": "replays started from",
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
    return label, format_value(reason_of(value))


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


def reason_of(value: object) -> object:
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
