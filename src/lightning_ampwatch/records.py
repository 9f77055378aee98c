"""Typed records of what an investigation and a treatment established: every decision reads a field of these,
never a sentence. A finding's own measurements are ``diagnosis.measured`` (:mod:`.measured`, re-exported here).
The sentences and numbers users see (``Diagnosis.evidence``) are made from them where a record is published.

Pure Python (no torch, no Lightning). The verdict enums live with the verdict functions (:mod:`.verdicts`) and the
vocabulary in :mod:`.taxonomy`; they are re-exported here so that one import names every record type.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Sequence

from lightning_ampwatch.measured import LrRise, Measured, Tried
from lightning_ampwatch.taxonomy import Diagnosis, GradientPattern, LrEvent
from lightning_ampwatch.verdicts import (
    ControlResult,
    ControlVerdict,
    Fp32Reference,
    LevelOrigin,
    LowerLrKind,
    LowerLrVerdict,
    Outcome,
    Recovery,
    TrajectoryKind,
    TrajectoryVerdict,
    Unverified,
)

__all__ = [
    "ControlResult", "ControlVerdict", "Facts", "Fp32Reference", "GradientPattern", "LevelOrigin", "LowerLrKind",
    "LowerLrVerdict", "LrEvent", "LrRise", "Measured",
    "Outcome", "Recovery", "Rollback",
    "RollbackKind", "TrajectoryKind", "TrajectoryVerdict", "Tried", "Unverified", "facts_of", "with_facts",
]


class RollbackKind(str, Enum):
    """Where a treatment took the run back to before applying a remedy."""

    SNAPSHOT = "snapshot"  # the newest in-memory snapshot from before the onset
    CHECKPOINT = "checkpoint"  # the newest ModelCheckpoint file from before the onset
    NONE = "none"  # applied in place (``why`` says why)
    OFF = "off"  # rollback=False


@dataclass(frozen=True)
class Rollback:
    """A rollback (or why there was none), and, with ``replay_episode``, the losses of the episode trained again."""

    kind: RollbackKind
    now: int = 0  # the step the run was at
    to_step: int | None = None  # the first step run again
    snapshot_step: int | None = None  # the snapshot's step (taken after it)
    path: str | None = None  # the checkpoint file
    why: str | None = None  # for NONE: why nothing was rolled back
    retrained: tuple[float | None, ...] | None = None  # the episode's losses, trained on again with the remedy
    untouched: bool = False  # NONE because every step since the fit's start was skipped: the state is the start's

    @property
    def resumed_at(self) -> int | None:
        """The step the run went back to, or None when it stayed where it was."""
        return self.to_step if self.kind in (RollbackKind.SNAPSHOT, RollbackKind.CHECKPOINT) else None

    def sentence(self) -> str:
        """What the evidence's ``rollback`` entry says."""
        if self.kind is RollbackKind.OFF:
            return "off: applied in place"
        if self.kind is RollbackKind.NONE:
            return f"none: {self.why}"
        if self.retrained is not None:
            shown = ", ".join("-" if v is None else f"{v:.4g}" for v in self.retrained)
            fate = f"were trained on again with the remedy (losses {shown})"
        else:
            fate = "are skipped"
        if self.kind is RollbackKind.SNAPSHOT:
            taken = f"taken after step {self.snapshot_step}" if (self.snapshot_step or 0) >= 0 else \
                "taken at the fit's start, before its first step"
            return (f"rolled back from step {self.now} to step {self.to_step} (the in-memory snapshot {taken}); the "
                    f"batches of steps {self.to_step}..{self.now - 1} {fate}")
        return (f"rolled back from step {self.now} to step {self.to_step} (the checkpoint file {self.path}); the "
                f"batches of steps {self.to_step}..{self.now - 1} {fate}")

    def after_retraining(self, losses: Sequence[float | None]) -> "Rollback":
        return replace(self, retrained=tuple(losses))


@dataclass(frozen=True)
class Facts:
    """What is known about one diagnosis beyond its evidence, typed: the FP32 controls' verdicts, the rollback,
    the remedy and its recovery. Carried with the diagnosis (never serialised: the evidence is its public face)."""

    replay: Any = None  # replays.ReplayRecord: where the replay of the faulty step located it, its numbers
    control: ControlResult | None = None  # the single-batch FP32 control
    trajectory: TrajectoryVerdict | None = None  # the FP32 trajectory control (it stands over ``control``)
    lower_lr: LowerLrVerdict | None = None  # the same window at the run's precision with the LR lowered
    reference: float | None = None  # the healthy loss level before the onset (None: there was none)
    rollback: Rollback | None = None
    remedy: Any = None  # remedies.AppliedRemedy
    recovery: Recovery | None = None
    interventions: Any = None  # interventions.InterventionReport: each candidate fix replayed over the window

    @property
    def amp_confirmed(self) -> bool:
        """The replay that stands confirmed reduced precision as the cause."""
        if self.trajectory is not None:
            return self.trajectory.kind is TrajectoryKind.AMP_CONFIRMED
        return self.control is not None and self.control.verdict is ControlVerdict.AMP_FAULT


def facts_of(diagnosis: Diagnosis) -> Facts:
    facts = diagnosis.facts
    return facts if isinstance(facts, Facts) else Facts()


def with_facts(diagnosis: Diagnosis, **changes: Any) -> Diagnosis:
    """The diagnosis with some of its facts set (the others kept)."""
    return replace(diagnosis, facts=replace(facts_of(diagnosis), **changes))
