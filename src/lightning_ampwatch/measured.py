"""The measurements a finding rests on, typed: what every decision after the alarm reads (the remedy ladder, the LR
factor, the safe scale, what the ranks agree on, the rollback's last good step), in place of the evidence's keys.

A :class:`Measured` is carried by every :class:`~lightning_ampwatch.taxonomy.Diagnosis` as ``diagnosis.measured``.
It is taken from the diagnosis's evidence once, where the diagnosis is made (``Diagnosis.__post_init__``), by
:meth:`Measured.read_back`: the one place that reads those keys. A diagnosis made again with other evidence
(``dataclasses.replace``) gets its record made again with it, so the record and the published evidence cannot drift
apart, and a diagnosis read back from JSON (another rank's, a checkpoint's) has the same record it was published with.
The event log keeps its keys: the evidence is still the record's public face (``tests/test_demo_event_logs.py``).

The entries a record adds to the evidence are made from the record's own types (:meth:`Tried.entry`,
:meth:`Measured.lr_tried_entry`), so that writing and reading back meet in this module.

Pure Python: no torch, no Lightning, and no other module of the package (the vocabulary of patterns and LR events
lives here, and :mod:`.taxonomy` re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping


class GradientPattern(str, Enum):
    """Which shape of skipped steps made a gradient-overflow alarm; written to the evidence as ``pattern``."""

    STARTUP = "startup"  # skips in a row from the first step: the initial scale is too high
    BURST = "burst"  # several skips close together, not all in a row
    COLLAPSE = "collapse"  # skips in a row after a healthy start: the scale halves again and again
    PERSISTENT = "persistent"  # a steady skip rate over the window
    UNSCALED_OVERFLOW = "unscaled_overflow"  # still skipping below a scale of 1: the gradients overflow unscaled
    GROWTH_OVERFLOW = "growth_overflow"  # each growth of the scale is followed by a skip

    def __str__(self) -> str:
        return self.value


class DivergencePattern(str, Enum):
    """Which shape of the loss made a divergence alarm (``FP32_UNSTABLE`` or ``LR_SCHEDULE``); ``pattern``."""

    FINITE_DIVERGENCE = "finite_divergence"  # far above its healthy level and staying there, no skip, no NaN

    def __str__(self) -> str:
        return self.value


class LrEvent(str, Enum):
    """Which rise of the learning rate set an episode off; written to the evidence as ``lr_event``."""

    WARMUP_END = "warmup_end"  # a warmup that climbed over many steps just peaked
    LR_INCREASE = "lr_increase"  # a single rise
    PARAM_GROUP_ADDED = "param_group_added"  # a new param group, at an LR far above the others' (a backbone unfrozen)

    def __str__(self) -> str:
        return self.value


def _number(value: Any) -> float | None:
    """A measured number (an int or a float, never a bool or the string a non-finite float is written as), as it was
    measured (an int stays an int: what is made from it is published as the evidence said it)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _pattern(value: Any) -> GradientPattern | DivergencePattern | None:
    for kind in (GradientPattern, DivergencePattern):
        try:
            return kind(value)
        except ValueError:
            continue
    return None


@dataclass(frozen=True)
class LrRise:
    """The rise of the learning rate that set the episode off (evidence ``lr_event``, ``lr_before``, ``lr_after``,
    ``lr_change_step``): any of them None where it was not measured as a number."""

    event: LrEvent | None = None
    before: float | None = None
    after: float | None = None
    step: int | None = None  # the step the raised LR first ran at

    @property
    def rose(self) -> tuple[float, float] | None:
        """(before, after) when the LR measurably rose from a positive level; None otherwise."""
        if self.before is not None and self.after is not None and 0 < self.before < self.after:
            return self.before, self.after
        return None

    def entries(self) -> dict[str, Any]:
        """The evidence entries this rise is published as (read back by :meth:`Measured.read_back`)."""
        return {"lr_event": self.event, "lr_before": self.before, "lr_after": self.after,
                "lr_change_step": self.step}

    def words(self) -> str | None:
        """The rise in words ("0.0006 -> 0.0018 at step 8"), or None where the LR did not measurably go up."""
        if self.before is None or self.after is None or not self.after > self.before:
            return None
        return f"{self.before:.3g} -> {self.after:.3g}" + (f" at step {self.step}" if self.step is not None else "")


@dataclass(frozen=True)
class Tried:
    """A remedy tried on this episode that did not recover (one entry of the evidence's ``remedies_tried``)."""

    remedy: str | None
    outcome: str | None = None
    reason: str | None = None

    def entry(self) -> dict[str, Any]:
        """The evidence entry this record is published as."""
        return {"remedy": self.remedy, "outcome": self.outcome, "reason": self.reason}


@dataclass(frozen=True)
class Measured:
    """What decisions read of a finding's measurements (the evidence says the same in words and numbers)."""

    pattern: GradientPattern | DivergencePattern | None = None  # the shape of the skips or of the climb
    safe_scale: float | None = None  # the largest loss scale measured to hold (None: none measured)
    safe_scale_sought: bool = False  # a safe scale was asked for (``safe_scale`` in the evidence, even as None)
    pattern_before_replay: GradientPattern | None = None  # the pattern the replay's unscaled overflow replaced
    lr: LrRise | None = None  # the LR rise that set the episode off
    weights_lost: bool = False  # the weights hold non-finite values (no scaler skipped the faulty step)
    remedies_tried: tuple[Tried, ...] | None = None  # the rungs tried before this one (None: this is the first)
    lr_tried: tuple[float | None, ...] | None = None  # the LRs an earlier reduce_lr rung set (None: none)
    nonfinite_where: str | None = None  # where the batch itself held non-finite values (``nonfinite_where``)
    input_where: str | None = None  # where in the batch the values too large for float16 sit (``input_where``)
    first_nonfinite_step: int | None = None  # the first step whose loss went non-finite
    scale: float | None = None  # the loss scale at the faulty step
    init_scale: float | None = None  # the loss scale the run started at
    onset_scale: float | None = None  # the loss scale where the skips began
    withdrawn_by: str | None = None  # for a withdrawn call: the alarm's finding that took it back
    fault_ranks: tuple[int, ...] | None = None  # the ranks the fault was found on (set where the ranks merged)
    reported_from_rank: int | None = None  # the rank that reached this diagnosis alone

    @property
    def finite_divergence(self) -> bool:
        """The loss climbed and stays up, finite (a divergence alarm, judged from the run's own losses)."""
        return self.pattern is DivergencePattern.FINITE_DIVERGENCE

    @property
    def nonfinite_batch(self) -> bool:
        """The batch itself held non-finite values."""
        return bool(self.nonfinite_where)

    @property
    def earlier_lr_rungs(self) -> int:
        """How many ``reduce_lr`` rungs were tried on this episode before (and did not recover)."""
        return sum(1 for t in self.remedies_tried or () if t.remedy == "reduce_lr")

    def lr_tried_entry(self) -> list[float | None]:
        """The evidence's ``lr_tried``: the LRs the earlier rung set."""
        return list(self.lr_tried or ())

    @classmethod
    def read_back(cls, evidence: Mapping[str, Any]) -> "Measured":
        """The record of a diagnosis's evidence: where the diagnosis is made, and when it is read back from JSON.
        The one reader of these evidence keys."""
        before = evidence.get("lr_before")
        after = evidence.get("lr_after")
        lr = None
        if any(k in evidence for k in ("lr_event", "lr_before", "lr_after", "lr_change_step")):
            try:
                event: LrEvent | None = LrEvent(evidence.get("lr_event"))
            except ValueError:
                event = None
            lr = LrRise(event, _number(before), _number(after), _int(evidence.get("lr_change_step")))
        tried = evidence.get("remedies_tried")
        lr_tried = evidence.get("lr_tried")
        ranks = evidence.get("fault_ranks")
        withdrawn_by = evidence.get("withdrawn_by")
        before_replay = _pattern(evidence.get("pattern_before_replay"))
        return cls(
            pattern=_pattern(evidence.get("pattern")),
            safe_scale=_number(evidence.get("safe_scale")),
            safe_scale_sought="safe_scale" in evidence,
            pattern_before_replay=before_replay if isinstance(before_replay, GradientPattern) else None,
            lr=lr,
            weights_lost=evidence.get("weights_lost") is not None,
            remedies_tried=tuple(Tried(t.get("remedy"), t.get("outcome"), t.get("reason"))
                                 for t in tried if isinstance(t, Mapping)) if isinstance(tried, list) else None,
            lr_tried=tuple(_number(v) for v in lr_tried) if isinstance(lr_tried, list) else None,
            nonfinite_where=evidence.get("nonfinite_where"),
            input_where=evidence.get("input_where") if "input_where" in evidence else None,
            first_nonfinite_step=_int(evidence.get("first_nonfinite_step")),
            scale=_number(evidence.get("scale")),
            init_scale=_number(evidence.get("init_scale")),
            onset_scale=_number(evidence.get("onset_scale")),
            withdrawn_by=withdrawn_by if isinstance(withdrawn_by, str) else None,
            fault_ranks=tuple(r for r in ranks if isinstance(r, int)) if isinstance(ranks, list) else None,
            reported_from_rank=_int(evidence.get("reported_from_rank")) if "reported_from_rank" in evidence else None,
        )
