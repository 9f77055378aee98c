"""The vocabulary of the project: what can be wrong with an AMP run, and what to do about it (each finding's fix is
worded in :mod:`lightning_ampwatch.advice`; :func:`advise` picks it).

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

# each finding's fix in words; the scale's notation and float16's limits are named here too, where they were first
from lightning_ampwatch.advice import (
    FP16_LIMIT,
    NEAR_FP16_LIMIT_LOG2,
    advised_init_scale,
    clip_before_unscale,
    data_nonfinite,
    eps_underflow,
    format_pow2,
    forward_overflow,
    fp16_nearest,
    fp16_parameters,
    fp32_unstable,
    gradient_overflow,
    growth_overflow,
    input_range,
    inside_headroom,
    loss_outside_autocast,
    lr_schedule,
    manual_prescale,
    normal_scaling,
    not_reproduced,
    step_outside_scaler,
)
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
    Finding.NORMAL_SCALING: "a few skipped steps, clean steps after them: dynamic loss scaling at work",
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


def _forward_summary(ev: Mapping[str, Any]) -> str:
    """FORWARD_OVERFLOW's meaning in the run's precision. The probes see module outputs, not the operations inside
    them or in ``training_step``'s own code: "past float16's range" only when an output came near the limit; else
    the two ways a finite computation goes non-finite in reduced precision, since either fits what was seen."""
    precision = ev.get("precision")
    if precision == "bf16":
        return ("a value in the forward pass went non-finite under bfloat16, which has float32's range: most likely "
                "a rounding (bfloat16 keeps 8 significant bits), not an overflow")
    where = "in float16 (16-true)" if precision == "half" else "under float16 autocast"
    inside = inside_headroom(ev)
    if inside is not None:  # the interventions watched every tensor computed inside the located module(s)
        return (f"a value in the forward pass went non-finite {where}: past float16's range (65504) inside "
                f"{inside[0]}, whose values reach {2.0 ** -inside[1]:.3g}x that in FP32")
    nearest = fp16_nearest(ev)
    if nearest is not None and nearest[1] <= NEAR_FP16_LIMIT_LOG2:
        return (f"a value in the forward pass went non-finite {where}, with module outputs within a factor of 2 of "
                "float16's largest value (65504): most likely past what float16 can hold")
    return (f"a value in the forward pass went non-finite {where}: past float16's range (65504) inside an "
            "operation, or rounded to a value the next operation cannot take (log of 0, division by 0)")


def withdrawn_by(call: Diagnosis, finding: Finding) -> Diagnosis:
    """A withdrawn ``NORMAL_SCALING`` call naming the alarm that withdrew it as published (``finding``: the name the
    controls gave it), its advice to match."""
    evidence = {**call.evidence, "withdrawn_by": finding.value}
    return replace(call, evidence=evidence, advice=advise(Finding.NORMAL_SCALING, evidence))


ADVICE: dict[Finding, Callable[[Mapping[str, Any]], str]] = {
    Finding.DATA_NONFINITE: data_nonfinite,
    Finding.FP32_UNSTABLE: fp32_unstable,
    Finding.FORWARD_OVERFLOW: forward_overflow,
    Finding.INPUT_RANGE: input_range,
    Finding.GRADIENT_OVERFLOW: gradient_overflow,
    Finding.GROWTH_OVERFLOW: growth_overflow,
    Finding.LR_SCHEDULE: lr_schedule,
    Finding.NORMAL_SCALING: normal_scaling,
    Finding.LOSS_OUTSIDE_AUTOCAST: loss_outside_autocast,
    Finding.CLIP_BEFORE_UNSCALE: clip_before_unscale,
    Finding.STEP_OUTSIDE_SCALER: step_outside_scaler,
    Finding.MANUAL_PRESCALE: manual_prescale,
    Finding.FP16_PARAMETERS: fp16_parameters,
    Finding.EPS_UNDERFLOW: eps_underflow,
    Finding.NOT_REPRODUCED: not_reproduced,
}


def advise(finding: Finding, evidence: Mapping[str, Any], *, control_diverging: bool = False,
           against_first_loss: bool = False) -> str:
    """The concrete fix for ``finding`` given what was measured. ``control_diverging``: the single-batch FP32
    control found a finite loss far above the run's level (the optimisation diverges; float16 overflowed first);
    ``against_first_loss``: that level was the run's first loss, there being no healthy level yet."""
    if finding is Finding.FP32_UNSTABLE:
        return fp32_unstable(evidence, control_diverging, against_first_loss)
    return ADVICE[finding](evidence)
