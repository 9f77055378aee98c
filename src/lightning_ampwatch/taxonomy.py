"""The vocabulary of the project: what can be wrong with an AMP run, and what to do about it.

Pure Python on purpose: the state machine, the reporters and the CLI all share these names,
and none of them should need torch or Lightning to talk about a finding.
"""

from __future__ import annotations

import json
import math
import copy
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Mapping

# the patterns and LR events live with the typed measurements; re-exported here, where they were first named
from lightning_ampwatch.measured import DivergencePattern, GradientPattern, LrEvent, LrRise, Measured


class Finding(str, Enum):
    """A class in the AMP failure taxonomy. The value equals the name, so it survives JSON."""

    DATA_NONFINITE = "DATA_NONFINITE"
    FP32_UNSTABLE = "FP32_UNSTABLE"
    LOSS_OUTSIDE_AUTOCAST = "LOSS_OUTSIDE_AUTOCAST"
    CLIP_BEFORE_UNSCALE = "CLIP_BEFORE_UNSCALE"
    STEP_OUTSIDE_SCALER = "STEP_OUTSIDE_SCALER"
    MANUAL_PRESCALE = "MANUAL_PRESCALE"
    FORWARD_OVERFLOW = "FORWARD_OVERFLOW"
    INPUT_RANGE = "INPUT_RANGE"
    GRADIENT_OVERFLOW = "GRADIENT_OVERFLOW"
    GROWTH_OVERFLOW = "GROWTH_OVERFLOW"
    LR_SCHEDULE = "LR_SCHEDULE"
    NORMAL_SCALING = "NORMAL_SCALING"
    FP16_PARAMETERS = "FP16_PARAMETERS"
    EPS_UNDERFLOW = "EPS_UNDERFLOW"
    NOT_REPRODUCED = "NOT_REPRODUCED"

    @property
    def is_alarm(self) -> bool:
        """Everything but healthy dynamic scaling is something the user must act on."""
        return self is not Finding.NORMAL_SCALING

    @property
    def is_recipe(self) -> bool:
        """Found by the recipe guards (a line of code), not by the state machine (a pattern in the signals)."""
        return self in _RECIPE

    @property
    def summary(self) -> str:
        return _SUMMARIES[self]

    def __str__(self) -> str:  # "GRADIENT_OVERFLOW", not "Finding.GRADIENT_OVERFLOW"
        return self.value


_RECIPE = frozenset({"LOSS_OUTSIDE_AUTOCAST", "CLIP_BEFORE_UNSCALE", "STEP_OUTSIDE_SCALER", "MANUAL_PRESCALE",
                     "FP16_PARAMETERS", "EPS_UNDERFLOW"})

_SUMMARIES: dict[Finding, str] = {
    Finding.DATA_NONFINITE: "the batch itself contains NaN or inf values; this is a data problem, not AMP",
    Finding.FP32_UNSTABLE: "the run is unstable at full precision too: the optimisation is at fault, not AMP",
    Finding.LOSS_OUTSIDE_AUTOCAST: "the loss is computed outside autocast, in the precision of the model outputs",
    Finding.CLIP_BEFORE_UNSCALE: "gradients are clipped while they are still multiplied by the loss scale",
    Finding.STEP_OUTSIDE_SCALER: "the optimizer stepped without going through the GradScaler",
    Finding.MANUAL_PRESCALE: "the loss was multiplied by hand before the GradScaler multiplied it again",
    Finding.FORWARD_OVERFLOW: "a value in the forward pass went non-finite in reduced precision: past float16's "
                              "range, or rounded to a value the next operation cannot take",
    Finding.INPUT_RANGE: "inputs or targets are larger than float16 holds comfortably",
    Finding.GRADIENT_OVERFLOW: "the scaled gradients overflow float16, so the scaler keeps skipping steps",
    Finding.GROWTH_OVERFLOW: "every time the scaler doubles the loss scale, the very next steps overflow",
    Finding.LR_SCHEDULE: "the trouble began right after the learning rate went up",
    Finding.NORMAL_SCALING: "a few skipped steps at a healthy scale: dynamic loss scaling doing its job",
    Finding.FP16_PARAMETERS: "trainable parameters are already float16 under 16-mixed, so nothing is kept in float32",
    Finding.EPS_UNDERFLOW: "the optimizer's eps is too small for float16 and no longer guards its division",
    Finding.NOT_REPRODUCED: "the same steps replayed from a snapshot stay finite: the fault did not reproduce, so "
                            "it is not blamed on AMP",
}


class AmpWatchError(RuntimeError):
    """Raised with ``on_unrecoverable="raise"``; ``.diagnosis`` is the finding that could not be fixed."""

    def __init__(self, message: str, diagnosis: "Diagnosis | None" = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


def _jsonable(value: Any) -> Any:
    """Evidence must survive ``json.dumps``; non-finite floats become strings so the log stays valid JSON."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


@dataclass(frozen=True)
class Diagnosis:
    """One named cause, with the measurements it rests on and a concrete fix.

    A withdrawal is a Diagnosis too: when an alarm episode turns out to have begun with the isolated skip an
    earlier ``NORMAL_SCALING`` call was about, the machine returns that call again, same step, with
    ``evidence["withdrawn"] = True``, ``withdrawn_by`` (the alarm's finding) and ``withdrawn_at`` (the step the
    alarm was raised at); it replaces the earlier record, and :meth:`headline` says it was withdrawn.
    """

    finding: Finding
    step: int
    location: str | None = None
    evidence: dict[str, object] = field(default_factory=dict)
    advice: str = ""
    remedy: str | None = None
    outcome: str | None = None
    """After a remedy: ``"recovered"`` (verified healthy again) or ``"not_recovered"``; None while it is watched,
    or when no remedy was applied. The numbers are in ``evidence["recovery"]``."""
    facts: Any = field(default=None, compare=False, repr=False)
    """The typed records behind the evidence (:class:`lightning_ampwatch.records.Facts`), for the decisions that
    follow; never serialised: a diagnosis read back from JSON has none."""
    measured: Measured = field(init=False, compare=False, repr=False)
    """The measurements decisions read (:class:`lightning_ampwatch.measured.Measured`), made with the diagnosis from
    its evidence (and made again whenever the diagnosis is made again with other evidence)."""

    def __post_init__(self) -> None:
        if not isinstance(self.finding, Finding):
            object.__setattr__(self, "finding", Finding(self.finding))
        object.__setattr__(self, "evidence", _jsonable(dict(self.evidence)))
        object.__setattr__(self, "measured", Measured.read_back(self.evidence))

    @property
    def is_alarm(self) -> bool:
        return self.finding.is_alarm

    @property
    def withdrawn(self) -> bool:
        """A premature ``NORMAL_SCALING`` call taken back by a later alarm."""
        return self.evidence.get("withdrawn") is True

    @property
    def summary(self) -> str:
        """The finding's meaning in plain words, narrowed to what this diagnosis measured."""
        if self.withdrawn:
            onset = self.evidence.get("alarm_onset")
            after = f" {onset - self.step} steps after this skip" if isinstance(onset, int) and onset > self.step \
                else " right after this skip" if onset == self.step else ""
            return (f"withdrawn at step {self.evidence.get('withdrawn_at')}: a {self.evidence.get('withdrawn_by')} "
                    f"episode began{after}, so the skip may have been its first sign, not dynamic scaling doing its "
                    "job")
        full = self.evidence.get("precision") == "fp32"  # a run without reduced precision: AMP is not in it
        if self.finding is Finding.FP32_UNSTABLE and self.measured.finite_divergence:
            return ("the loss climbed far above where it was healthy and stays there, with no skip and no NaN: "
                    "the optimisation is diverging" + ("" if full else ", not AMP"))
        if self.finding is Finding.FP32_UNSTABLE and self.evidence.get("diverged_first") is True:
            if full:
                return ("the loss diverged before it went non-finite, in a run at full precision: the optimisation "
                        "is at fault")
            return "the loss diverged before any overflow: the optimisation is at fault, not AMP"
        if self.finding is Finding.FP32_UNSTABLE and full:
            return "the loss went non-finite in a run at full precision: the optimisation is at fault"
        if self.finding is Finding.FORWARD_OVERFLOW:
            return _forward_summary(self.evidence)
        return self.finding.summary

    def to_dict(self) -> dict[str, Any]:
        """The record as plain data: one line of the event log (``diagnoses.jsonl``) before it is encoded."""
        return {"finding": self.finding.value, "step": self.step, "location": self.location,
                "evidence": copy.deepcopy(self.evidence), "advice": self.advice, "remedy": self.remedy,
                "outcome": self.outcome}

    def to_json(self) -> str:
        """The record as one JSON line, as the event log holds it."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Diagnosis":
        """The record back from :meth:`to_dict`'s data, e.g. a parsed event-log line (keys it does not know are
        left out, so a newer log reads)."""
        known = {k: data[k] for k in ("finding", "step", "location", "evidence", "advice", "remedy", "outcome")
                 if k in data}
        return cls(**known)

    def headline(self) -> str:
        where = f" in {self.location}" if self.location else ""
        return f"{self.finding.value} at step {self.step}{where}: {self.summary}"


#: float16's largest finite value.
FP16_LIMIT = 65504.0
#: Within this many powers of 2 of float16's largest value, a module's output counts as near the limit.
NEAR_FP16_LIMIT_LOG2 = 1.0


def _fp16_nearest(ev: Mapping[str, Any]) -> tuple[str, float] | None:
    """The module whose float16 output came nearest float16's limit in the replay (``fp16_headroom_log2``: its
    headroom in powers of 2), or None when the replay measured none."""
    headroom = ev.get("fp16_headroom_log2")
    if not isinstance(headroom, Mapping):
        return None
    rooms = [(str(k), float(v)) for k, v in headroom.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return min(rooms, key=lambda kv: kv[1]) if rooms else None


def _forward_summary(ev: Mapping[str, Any]) -> str:
    """FORWARD_OVERFLOW's meaning in the run's precision. The probes see module outputs, not the operations inside
    them or in ``training_step``'s own code: "past float16's range" only when an output came near the limit; else
    the two ways a finite computation goes non-finite in reduced precision, since either fits what was seen."""
    precision = ev.get("precision")
    if precision == "bf16":
        return ("a value in the forward pass went non-finite under bfloat16, which has float32's range: most likely "
                "a rounding (bfloat16 keeps 8 significant bits), not an overflow")
    where = "in float16 (16-true)" if precision == "half" else "under float16 autocast"
    inside = _inside_headroom(ev)
    if inside is not None:  # the interventions watched every tensor computed inside the located module(s)
        return (f"a value in the forward pass went non-finite {where}: past float16's range (65504) inside "
                f"{inside[0]}, whose values reach {2.0 ** -inside[1]:.3g}x that in FP32")
    nearest = _fp16_nearest(ev)
    if nearest is not None and nearest[1] <= NEAR_FP16_LIMIT_LOG2:
        return (f"a value in the forward pass went non-finite {where}, with module outputs within a factor of 2 of "
                "float16's largest value (65504): most likely past what float16 can hold")
    return (f"a value in the forward pass went non-finite {where}: past float16's range (65504) inside an "
            "operation, or rounded to a value the next operation cannot take (log of 0, division by 0)")


# --------------------------------------------------------------------------------------------
# Advice: one function per finding, reading the evidence the machine gathered. Kept here (not in
# the machine) so that the wording lives in one place and the machine only decides.
# --------------------------------------------------------------------------------------------


def format_pow2(value: object) -> str:
    """A scale as the user would type it: ``2**10`` for a power of two, else a short float."""
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return str(value)
    if v > 0 and math.isfinite(v) and math.log2(v).is_integer():
        return f"2**{int(math.log2(v))}"
    return f"{v:g}"


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def advised_init_scale(ev: Mapping[str, Any]) -> float | None:
    """The measured safe scale, only when it is below the scale the run started at or failed at: advice (and a
    remedy) must never recommend the value already in use. None when no lower scale is known."""
    m = Measured.read_back(ev)
    safe = _number(m.safe_scale)
    in_use = [v for v in (_number(m.init_scale), _number(m.onset_scale)) if v is not None]
    if safe is None or safe <= 0 or (in_use and safe >= max(in_use)):
        return None
    return safe


def _advice_gradient(ev: Mapping[str, Any]) -> str:
    # made from the typed record of the measurements (as _advice_lr): the pattern, the scales
    m = Measured.read_back(ev)
    if m.pattern is GradientPattern.UNSCALED_OVERFLOW:
        return (
            "Even a loss scale below 1 does not stop the overflow, so the gradients themselves are too large for "
            "float16 and no scaler setting can help. Fix the operation that makes them: a log-softmax or "
            "log(sum(exp(x))) written by hand instead of torch.log_softmax / torch.logsumexp, a sum where a mean "
            "was meant; or keep that operation in float32 inside autocast (an fp32 island); or train in bf16-mixed "
            "where the hardware supports it."
        )
    safe = advised_init_scale(ev)
    init = _number(m.init_scale)
    if safe is not None and ev.get("loss_scaler") == "deepspeed":
        power_text = str(math.floor(math.log2(safe)))  # DeepSpeed takes the scale as a power of two
        instead = f" instead of {format_pow2(init)}" if init is not None else ""
        return (
            f"Start DeepSpeed's loss scaler where it proved safe, {format_pow2(safe)}{instead}: "
            f'"initial_scale_power": {power_text} in the "fp16" section of the DeepSpeed config (in Lightning, '
            f"DeepSpeedStrategy(initial_scale_power={power_text})). If skips continue, clip gradients "
            '("gradient_clipping" in the config; Lightning\'s gradient_clip_val).'
        )
    if safe is not None:
        instead = f" instead of {format_pow2(init)}" if init is not None else ""
        return (
            f"Start the scaler where it proved safe: torch.amp.GradScaler(init_scale={format_pow2(safe)}){instead}; "
            f"in Lightning pass it as MixedPrecision('16-mixed', device, "
            f"scaler=GradScaler(init_scale={format_pow2(safe)})). "
            "If skips continue, clip gradients (Lightning's gradient_clip_val unscales first)."
        )
    held = _number(m.safe_scale)
    if held is not None and held > 0:
        return (
            f"Steps went through at a scale of {format_pow2(held)} before these skips began, so a lower starting "
            "scale would not have prevented them: the gradients grew during training. Check what changed (the "
            "learning rate, the batches) and clip gradients after unscaling (Lightning's gradient_clip_val does)."
        )
    onset = _number(m.onset_scale) or init
    lower = f"below the {format_pow2(onset)} the skips began at" if onset is not None else \
        "for example torch.amp.GradScaler(init_scale=2**10)"
    return (
        f"Lower the starting scale, {lower}, and clip gradients after unscaling (Lightning's gradient_clip_val "
        "does this for you). Most of these steps were thrown away."
    )


def _advice_growth(ev: Mapping[str, Any]) -> str:
    interval = ev.get("growth_interval")
    factor = ev.get("growth_factor")
    bigger = f"{int(interval) * 10}" if isinstance(interval, (int, float)) and interval else "2000 or more"
    safe = advised_init_scale(ev)
    if safe is not None:
        start = f"; or start at the scale that held, init_scale={format_pow2(safe)}."
    elif _number(ev.get("safe_scale")) is not None:
        start = f"; the scale it started at ({format_pow2(ev['safe_scale'])}) holds, so slower growth is the fix."
    else:
        start = "; or start at a lower init_scale."
    if ev.get("loss_scaler") == "deepspeed":
        return (
            f'The scale keeps doubling into overflow. Let DeepSpeed\'s loss scaler grow less often: '
            f'"loss_scale_window": {bigger} in the "fp16" section of the DeepSpeed config (in Lightning, '
            f"DeepSpeedStrategy(loss_scale_window={bigger})), or let it survive an overflow before halving "
            f'("hysteresis")' + start.replace("init_scale=", "a starting scale of ")
        )
    return (
        f"The scale keeps doubling into overflow. Let it grow less often or by less: "
        f"GradScaler(growth_interval={bigger}"
        + (f", growth_factor={max(1.0001, float(factor) ** 0.5):.3g})" if isinstance(factor, (int, float)) else ")")
        + start
    )


def _divergence(ev: Mapping[str, Any]) -> str:
    """The climb of the loss as the machine worded it (measured, with its steps), to lead an advice with."""
    climb = ev.get("divergence")
    return f"The loss climbed ({climb}). " if climb else ""


def _advice_lr(ev: Mapping[str, Any]) -> str:
    # made from the typed record of the rise (the pattern for a sentence made from a record, not from keys)
    rise = Measured.read_back(ev).lr or LrRise()
    before, after, kind = rise.before, rise.after, rise.event
    what = "warmup reached its peak" if kind is LrEvent.WARMUP_END else "the learning rate rose"
    if kind is LrEvent.PARAM_GROUP_ADDED:
        at = f" ({after:.3g}, the others at most {before:.3g})" if before is not None and after is not None else ""
        return _divergence(ev) + (
            f"The failure began right after a param group was added at a far higher learning rate{at} (a "
            "backbone unfrozen, say BackboneFinetuning's backbone_initial_lr). Give the new group a learning rate "
            "near the others' (or warm it up), then re-test before touching the loss scaler.")
    return _divergence(ev) + (
        f"The failure began right after {what} ({before:.3g} -> {after:.3g}). Lower the peak learning rate "
        "or lengthen the warmup, then re-test before touching the loss scaler; float16 only makes the "
        "instability visible sooner."
        if before is not None and after is not None
        else f"The failure began right after {what}. Lower the peak learning rate or lengthen the warmup."
    )


def _advice_data(ev: Mapping[str, Any]) -> str:
    where = ev.get("nonfinite_where")
    return (
        f"Clean the data before it reaches the model{' (' + str(where) + ')' if where else ''}: "
        "check torch.isfinite(batch).all() in the dataset or a collate function, and drop or repair the "
        "offending rows. Changing the precision will not help."
    ) + (" The weights already hold NaN/inf from this batch: unless the run goes back to a state from before it, "
         "the rest of the run is lost (remediate=True rolls back and skips the batch; by hand, resume from a "
         "checkpoint from before it without that batch)." if ev.get("weights_lost") else "")


def _advice_fp32(ev: Mapping[str, Any], control_diverging: bool = False, against_first_loss: bool = False) -> str:
    level, control = ev.get("loss_level"), ev.get("fp32_control_loss")
    precision = ev.get("precision")
    full = precision == "fp32"  # the run itself is at full precision: there is no reduced precision to blame
    if ev.get("pattern") == "finite_divergence":
        why = (f"The loss climbed ({ev['divergence']}): training diverges at the precision it runs in, and no "
               "loss-scale or precision setting changes that. ")
    elif ev.get("divergence") and full:
        why = (f"The loss climbed ({ev['divergence']}): training diverges, in a run at full precision, so no "
               "loss-scale or precision setting is involved. ")
    elif ev.get("divergence"):
        why = f"The loss climbed ({ev['divergence']}): training was diverging before reduced precision failed. "
    elif control_diverging and isinstance(level, (int, float)) and isinstance(control, (int, float)):
        against = "the run's first loss" if against_first_loss else "a healthy level"
        reduced = "bfloat16" if precision == "bf16" else "float16"
        why = (f"Replayed in float32 the loss is finite but {control:.3g}, against {against} of {level:.3g}: "
               f"training is diverging and {reduced} merely went non-finite first. ")
    elif full:
        why = ("The loss went non-finite in a run at full precision, so no loss-scale or precision setting is "
               "involved. ")
    else:
        why = "The loss is non-finite at full precision as well, so reduced precision is not the cause. "
    return why + (
        "Lower the learning rate, add gradient clipping, and look for log/exp/division of values that can "
        "reach zero or grow without bound in the loss."
    )


def _fp32_island(ev: Mapping[str, Any]) -> str:
    if ev.get("precision") == "half":  # 16-true: no autocast to step out of; the tensors themselves are float16
        return ("Keep the fragile operation in float32: cast its inputs with .float() (and a module that computes "
                "it with module.float())")
    return ("Keep the fragile operation in float32 inside autocast: wrap it in torch.autocast(device_type, "
            "enabled=False) and cast its inputs with .float()")


def _advice_forward(ev: Mapping[str, Any]) -> str:
    island = _fp32_island(ev)
    if ev.get("precision") == "bf16":
        return (
            "bfloat16 has float32's range, so this is rarely an overflow; more often a value rounded in bfloat16 "
            "(8 significant bits) to one the next operation cannot take: 1 - sigmoid(x) or a small difference "
            f"rounded to 0, then a log or a division. {island}, or write it in a form that does not round that "
            "way (torch.nn.functional.logsigmoid, torch.log1p, a clamp before the log)."
        )
    inside = _inside_headroom(ev)
    if inside is not None:  # the interventions watched every tensor computed inside the located module(s)
        where, bits = inside
        return (
            f"{island} (the replays watched the values computed inside {where}: in FP32 they reach "
            f"{2.0 ** -bits:.3g}x float16's maximum, 65504; exp, pow and large sums are the usual ones). Where the "
            "hardware supports it, precision='bf16-mixed' lifts float16's range limit (bfloat16 has float32's range), "
            "though it rounds more coarsely than float16."
        )
    nearest = _fp16_nearest(ev)
    if nearest is not None and nearest[1] <= NEAR_FP16_LIMIT_LOG2:
        return (
            f"{island} (softmax, exp, pow, large sums are the usual ones). Where the hardware supports it, "
            "precision='bf16-mixed' lifts float16's range limit (bfloat16 has float32's range), though it rounds "
            "more coarsely than float16."
        )
    seen = ""
    if nearest is not None:
        seen = (f" No float16 module output came near float16's limit in the replay (the largest, about "
                f"{FP16_LIMIT / 2.0 ** nearest[1]:.3g}, in {nearest[0]}): an overflow, if this was one, happened "
                "inside an operation, where the probes do not look; else it was a rounding.")
    return (
        f"{island}. The usual ones: exp, pow and large sums, which overflow float16; a log or a division of a value "
        f"that rounded to 0 (1 - sigmoid(x), a small difference).{seen} precision='bf16-mixed', where the hardware "
        "supports it, lifts float16's range limit but not the rounding: bfloat16 keeps fewer significant bits than "
        "float16, so it helps with an overflow only."
    )


def _inside_headroom(ev: Mapping[str, Any]) -> tuple[str, float] | None:
    """(the island's modules, the lowest headroom in bits under float16's maximum of the values computed inside them
    in the FP32 replay) when that went below zero: values float16 cannot hold; None otherwise."""
    info = ev.get("interventions")
    if not isinstance(info, Mapping):
        return None
    for tried in info.get("tried", ()):
        if isinstance(tried, Mapping) and tried.get("intervention") == "fp32":
            bits = [b for b in tried.get("headroom_log2") or () if isinstance(b, (int, float))]
            island = next((t.get("modules") for t in info.get("tried", ())
                           if isinstance(t, Mapping) and t.get("modules")), None)
            if bits and min(bits) < 0 and island:
                return ", ".join(island), min(bits)
    return None


def _advice_input(ev: Mapping[str, Any]) -> str:
    amax = ev.get("input_absmax")
    where = ev.get("input_where")
    return (
        f"The batch holds values up to {amax:.3g}{' in ' + str(where) if where else ''}; float16 tops out at 65504. "
        "Normalise inputs and targets (standardise features, rescale regression targets) or keep the first layer "
        "and the loss in float32."
        if isinstance(amax, (int, float))
        else "Normalise inputs and targets; float16 tops out at 65504."
    )


def withdrawn_by(call: Diagnosis, finding: Finding) -> Diagnosis:
    """A withdrawn ``NORMAL_SCALING`` call naming the alarm that withdrew it as published (``finding``: the name the
    controls gave it), its advice to match."""
    evidence = {**call.evidence, "withdrawn_by": finding.value}
    return replace(call, evidence=evidence, advice=advise(Finding.NORMAL_SCALING, evidence))


def _advice_normal(ev: Mapping[str, Any]) -> str:
    if ev.get("withdrawn") is True:
        return (
            f"The earlier 'normal scaling' call was premature: a {ev.get('withdrawn_by')} episode (raised at step "
            f"{ev.get('withdrawn_at')}) began soon after the skip it was about, which may have been its first sign. "
            "Follow that diagnosis's advice instead."
        )
    return (
        "Nothing to fix: GradScaler skips a step now and then to find the largest safe scale. "
        "Keep an eye on ampwatch/skipped_steps; act only if skips become frequent."
    )


def _at(ev: Mapping[str, Any]) -> str:
    code = ev.get("code")
    return f" (`{code}`)" if code else ""


def _advice_loss_autocast(ev: Mapping[str, Any]) -> str:
    op = ev.get("loss_op")
    return (
        f"The loss op {op + ' ' if op else ''}ran in float16 because autocast was off where the loss was computed"
        f"{_at(ev)}. Compute the loss inside the autocast region (in Lightning, training_step already is one: "
        "drop the autocast(enabled=False) block), or cast the model outputs and targets with .float() before the "
        "loss so it runs in float32."
    )


def _advice_clip(ev: Mapping[str, Any]) -> str:
    real = ev.get("limit_in_real_units")
    effect = (f"Your clipping limit acts as {real:.3g} on the real gradients. " if isinstance(real, (int, float))
              else "")
    if ev.get("optimization") == "manual" or ev.get("via") == "LightningModule.clip_gradients":
        return effect + (
            "In manual optimization opt.step() unscales only after this line runs, and calling scaler.unscale_ "
            "yourself makes that step fail. Move the clipping into the on_before_optimizer_step(self, optimizer) "
            "hook, which Lightning calls after unscaling: self.clip_gradients(optimizer, gradient_clip_val=...)."
        )
    return effect + (
        "Clip where the gradients are already unscaled: pass gradient_clip_val to the Trainer, or clip inside "
        "on_before_optimizer_step or configure_gradient_clipping (both run after Lightning unscales). Outside "
        "Lightning, call scaler.unscale_(optimizer) before clipping."
    )


def _advice_step(ev: Mapping[str, Any]) -> str:
    if ev.get("optimization") == "manual":
        return (
            f"Step the LightningOptimizer from self.optimizers(), not the raw optimizer{_at(ev)}: opt.step() goes "
            "through the GradScaler, which unscales, skips steps with inf/NaN gradients and updates the scale."
        )
    return (
        f"Let the GradScaler step the optimizer{_at(ev)}: in an optimizer_step override call optimizer.step("
        "closure=optimizer_closure) on the LightningOptimizer you are given; outside Lightning use "
        "scaler.step(optimizer) followed by scaler.update()."
    )


def _advice_prescale(ev: Mapping[str, Any]) -> str:
    if ev.get("second_scaler_scale"):
        what = "The loss went through scaler.scale twice"
        fix = "Hand the plain loss to backward (self.manual_backward(loss)); Lightning scales it once itself."
    else:
        factor = ev.get("factor")
        what = f"The loss was multiplied by {format_pow2(factor)} before the scaler's own scale" if factor else \
            "The loss was multiplied by hand before the scaler's own scale"
        fix = "Drop that factor and let the GradScaler pick the scale; if you want a larger start, pass " \
              "GradScaler(init_scale=...) to the precision plugin."
    return (
        f"{what}{_at(ev)}, so the gradients carry both and overflow early. {fix} Dividing the loss by the number "
        "of accumulation steps is fine."
    )


def _advice_fp16_params(ev: Mapping[str, Any]) -> str:
    return (
        "16-mixed keeps the parameters in float32 and lets autocast run selected ops in float16; with float16 "
        "parameters the scaler cannot unscale their gradients (it refuses float16 gradients) and the updates lose "
        "precision. Remove the .half() / .to(torch.float16) on the model and let the precision plugin cast, or "
        "train with precision='16-true' if you really want float16 weights."
    )


def _advice_eps(ev: Mapping[str, Any]) -> str:
    eps, held = ev.get("eps"), ev.get("eps_in_float16")
    known = isinstance(eps, (int, float)) and isinstance(held, (int, float))
    what = f"eps={eps:g} becomes {held:g} in float16" if known else "eps is below float16's smallest normal number"
    return (
        f"{what}, so it no longer keeps the update m / (sqrt(v) + eps) finite once v underflows. Pass eps=1e-4 "
        f"(or larger) to {ev.get('optimizer') or 'the optimizer'}, or train with 16-mixed / bf16 so that the "
        "optimizer state stays in float32."
    )


def _advice_not_reproduced(ev: Mapping[str, Any]) -> str:
    window = ev.get("trajectory_window")
    where = f" (steps {window[0]}-{window[1]})" if isinstance(window, list) and len(window) == 2 else ""
    return (
        f"Replayed from a snapshot{where} with the same batches and random state, in float32 and at the run's own "
        "precision, the steps stay finite: the fault is not a deterministic overflow, so no precision setting is "
        "the fix. Suspect something outside the replayed computation: a transient hardware fault, a "
        "nondeterministic kernel or data race, or state your training_step changes on its own (counters, caches). "
        "If it comes back, rerun from the same checkpoint and seed to catch it."
    )


ADVICE: dict[Finding, Callable[[Mapping[str, Any]], str]] = {
    Finding.DATA_NONFINITE: _advice_data,
    Finding.FP32_UNSTABLE: _advice_fp32,
    Finding.FORWARD_OVERFLOW: _advice_forward,
    Finding.INPUT_RANGE: _advice_input,
    Finding.GRADIENT_OVERFLOW: _advice_gradient,
    Finding.GROWTH_OVERFLOW: _advice_growth,
    Finding.LR_SCHEDULE: _advice_lr,
    Finding.NORMAL_SCALING: _advice_normal,
    Finding.LOSS_OUTSIDE_AUTOCAST: _advice_loss_autocast,
    Finding.CLIP_BEFORE_UNSCALE: _advice_clip,
    Finding.STEP_OUTSIDE_SCALER: _advice_step,
    Finding.MANUAL_PRESCALE: _advice_prescale,
    Finding.FP16_PARAMETERS: _advice_fp16_params,
    Finding.EPS_UNDERFLOW: _advice_eps,
    Finding.NOT_REPRODUCED: _advice_not_reproduced,
}


def advise(finding: Finding, evidence: Mapping[str, Any], *, control_diverging: bool = False,
           against_first_loss: bool = False) -> str:
    """The concrete fix for ``finding`` given what was measured. ``control_diverging``: the single-batch FP32
    control found a finite loss far above the run's level (the optimisation diverges; float16 overflowed first);
    ``against_first_loss``: that level was the run's first loss, there being no healthy level yet."""
    if finding is Finding.FP32_UNSTABLE:
        return _advice_fp32(evidence, control_diverging, against_first_loss)
    return ADVICE[finding](evidence)
