"""Which remedy a finding gets: a table of ladders, climbed when a finding comes back soon after its remedy."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from lightning_ampwatch.remedies.base import REGISTRY, AppliedRemedy, RemedyContext, RemedyName
from lightning_ampwatch.interventions import Intervention
from lightning_ampwatch.records import facts_of
from lightning_ampwatch.verdicts import TrajectoryKind
from lightning_ampwatch.taxonomy import Diagnosis, Finding, GradientPattern

DEFAULT_REMEDIES = tuple(r for r in RemedyName if r is not RemedyName.REDUCE_LR)  # what remediate=True allows

#: finding -> the remedies to try, in order. No AMP knob fixes data or divergence: FP32_UNSTABLE gets only a lower
#: learning rate (opt-in, as ever), the other not-AMP findings nothing.
LADDERS: dict[Finding, tuple[RemedyName, ...]] = {
    Finding.GRADIENT_OVERFLOW: (RemedyName.LOWER_INIT_SCALE, RemedyName.BF16_FALLBACK),
    Finding.GROWTH_OVERFLOW: (RemedyName.SLOW_GROWTH, RemedyName.LOWER_INIT_SCALE, RemedyName.BF16_FALLBACK),
    Finding.FORWARD_OVERFLOW: (RemedyName.FP32_ISLAND, RemedyName.BF16_FALLBACK),
    Finding.INPUT_RANGE: (RemedyName.BF16_FALLBACK,),
    Finding.LR_SCHEDULE: (RemedyName.REDUCE_LR,),
    Finding.FP32_UNSTABLE: (RemedyName.REDUCE_LR, RemedyName.REDUCE_LR),  # never bf16 or an island: not AMP
    Finding.CLIP_BEFORE_UNSCALE: (RemedyName.UNSCALE_BEFORE_CLIP,),
    # only where the batch's NaN/inf reached the weights (no scaler skipped the step): see ladder_for
    Finding.DATA_NONFINITE: (RemedyName.SKIP_BATCH,),
}


#: The remedy that does in the run what each intervention did in its replay (FP32 as a whole has none: it is the
#: control, not a fix AmpWatch applies).
REMEDY_OF = {Intervention.LOWER_SCALE: RemedyName.LOWER_INIT_SCALE, Intervention.ISLAND: RemedyName.FP32_ISLAND,
             Intervention.BF16: RemedyName.BF16_FALLBACK, Intervention.LOWER_LR: RemedyName.REDUCE_LR}
#: Findings whose ladder follows the interventions' replays where they ran (the recipe findings and a growth overflow
#: keep their own: their fix is not among the interventions).
MEASURED = frozenset({Finding.GRADIENT_OVERFLOW, Finding.FORWARD_OVERFLOW, Finding.INPUT_RANGE, Finding.LR_SCHEDULE,
                      Finding.FP32_UNSTABLE})


def measured_ladder(diagnosis: Diagnosis) -> tuple[RemedyName, ...] | None:
    """The remedies whose interventions cured the replayed window, least invasive first; where none cured, none (a
    rung no replay tried is not applied on trust: a bf16 fallback, never replayed, was applied to a rounding fault
    (log of 1 - sigmoid) that bfloat16 has as well, and with no scaler left to skip it the NaN reached the weights
    of a run that float16 had kept alive). None where no interventions ran."""
    report = facts_of(diagnosis).interventions
    if report is None or diagnosis.finding not in MEASURED:
        return None
    cures = tuple(REMEDY_OF[k] for k in report.cures() if k in REMEDY_OF)
    if report.lr_only_delays() and report.cured(Intervention.LOWER_LR):
        cures += (RemedyName.REDUCE_LR,)  # clean over the window, but only delaying the fault: the last resort
    if diagnosis.finding is Finding.FP32_UNSTABLE or _fp32_fails(diagnosis, report):
        # FP32 fails too: never an AMP knob, whatever quieted the skips (a warmup to a peak LR that FP32 does not
        # survive either was once given lower_init_scale, 2**16 -> 2**16, before the lower LR)
        cures = tuple(r for r in cures if r not in PRECISION_REMEDIES)
    return cures


#: The remedies that change how reduced precision runs: no cure for a fault FP32 has too.
PRECISION_REMEDIES = frozenset({RemedyName.LOWER_INIT_SCALE, RemedyName.SLOW_GROWTH, RemedyName.FP32_ISLAND,
                                RemedyName.BF16_FALLBACK})


def _fp32_fails(diagnosis: Diagnosis, report: Any) -> bool:
    """The FP32 replay of the window failed too: non-finite, or (the trajectory control's verdict) climbing far above
    the level. Not an AMP fault."""
    fp32 = report.get(Intervention.FP32)
    if fp32 is not None and not fp32.cured:
        return True
    trajectory = facts_of(diagnosis).trajectory
    return trajectory is not None and trajectory.kind in (TrajectoryKind.FP32_NONFINITE, TrajectoryKind.FP32_DIVERGES)


def ladder_for(diagnosis: Diagnosis) -> tuple[RemedyName, ...]:
    """The ladder for this diagnosis, trimmed of rungs that cannot help this particular case: the cures its replays
    measured where they ran (:func:`measured_ladder`), else the finding's table row."""
    measured = measured_ladder(diagnosis)
    if measured is not None:
        return measured
    ladder = LADDERS.get(diagnosis.finding, ())
    if diagnosis.finding is Finding.DATA_NONFINITE and not diagnosis.measured.weights_lost:
        return ()  # the scaler skipped the step: the weights never saw the batch, nothing to undo
    pattern = diagnosis.measured.pattern
    if diagnosis.finding is Finding.GRADIENT_OVERFLOW and pattern == GradientPattern.UNSCALED_OVERFLOW:
        ladder = tuple(r for r in ladder if r is not RemedyName.LOWER_INIT_SCALE)  # the gradients overflow unscaled
    if diagnosis.finding is Finding.FORWARD_OVERFLOW and not diagnosis.location:
        ladder = tuple(r for r in ladder if r is not RemedyName.FP32_ISLAND)
    return ladder


@dataclass
class RemedyPolicy:
    """Which remedy a diagnosis gets, given what is allowed and what was already tried for the same finding.

    A finding that comes back within ``escalation_window`` steps of its last remedy climbs to the next rung; one
    that comes back later starts again at the bottom (the earlier fix held for a long while).
    """

    allowed: frozenset[RemedyName]
    escalation_window: int = 500
    rungs: dict[str, tuple[int, int]] = field(default_factory=dict)  # finding -> (rung index, step applied)
    used: dict[str, list[str]] = field(default_factory=dict)  # finding -> the remedies applied for it, in order

    def choose(self, diagnosis: Diagnosis) -> tuple[int, RemedyName] | None:
        ladder = ladder_for(diagnosis)
        previous = self.rungs.get(diagnosis.finding.value)
        start = 0
        replayed = diagnosis.finding in MEASURED and facts_of(diagnosis).interventions is not None  # (measured_ladder)
        if replayed and self.used.get(diagnosis.finding.value):
            # the fault came back after a remedy (a relapse, at any later step): the next cure its fresh replays
            # measured that was not applied yet
            used = set(self.used[diagnosis.finding.value])
            return next(((i, r) for i, r in enumerate(ladder) if r in self.allowed and r.value not in used), None)
        if previous is not None and diagnosis.step - previous[1] <= self.escalation_window:
            start = previous[0] + 1
        return self._allowed_from(ladder, start)

    def _allowed_from(self, ladder: tuple[RemedyName, ...], start: int) -> tuple[int, RemedyName] | None:
        return next(((i, ladder[i]) for i in range(start, len(ladder)) if ladder[i] in self.allowed), None)

    def record(self, diagnosis: Diagnosis, index: int, name: RemedyName | None = None) -> None:
        self.rungs[diagnosis.finding.value] = (index, diagnosis.step)
        if name is not None:
            self.used.setdefault(diagnosis.finding.value, []).append(name.value)

    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis, choice: tuple[int, RemedyName] | None,
              step: int) -> tuple[Diagnosis, AppliedRemedy | None]:
        """Apply ``choice``, or the next allowed rung above it when it cannot apply here; the diagnosis comes back
        with the remedy's name and details (and the rungs that failed), and the record of what was applied."""
        ladder = ladder_for(diagnosis)
        failures: list[str] = []
        while choice is not None:
            index, name = choice
            try:
                details = REGISTRY[name].apply(ctx, diagnosis)
            except Exception as err:  # noqa: BLE001 - a remedy that cannot apply leaves the next rung
                failures.append(f"{name}: {err}")
                choice = self._allowed_from(ladder, index + 1)
                continue
            self.record(diagnosis, index, name)
            evidence = {**diagnosis.evidence, "remedy_details": details}
            if failures:
                evidence["remedies_failed"] = failures
            applied = AppliedRemedy(name, step, diagnosis.finding.value, details)
            return replace(diagnosis, remedy=applied.name.value, evidence=evidence), applied
        if failures:
            return replace(diagnosis, evidence={**diagnosis.evidence, "remedies_failed": failures}), None
        return diagnosis, None

    def state_dict(self) -> dict[str, Any]:
        return {"rungs": {k: list(v) for k, v in self.rungs.items()}, "used": {k: list(v) for k, v in self.used.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rungs = {k: (int(v[0]), int(v[1])) for k, v in state.get("rungs", {}).items()}
        self.used = {k: [str(n) for n in v] for k, v in state.get("used", {}).items()}


def parse_remediate(remediate: Any) -> frozenset[RemedyName]:
    """``remediate=`` as a set of remedy names; ``ValueError`` naming the bad value and the valid ones."""
    if remediate is True:
        return frozenset(DEFAULT_REMEDIES)
    if remediate == "all":  # every remedy, reduce_lr included (API.md)
        return frozenset(RemedyName)
    if remediate is False or remediate is None:
        return frozenset()
    valid = _valid_values()
    if isinstance(remediate, str):
        try:
            return frozenset([RemedyName(remediate)])
        except ValueError:
            raise ValueError(f"remediate={remediate!r} is not valid; {valid}") from None
    try:
        items = list(remediate)
    except TypeError:
        raise ValueError(f"remediate={remediate!r} is not valid; {valid}") from None
    names = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"remediate holds {item!r} ({type(item).__name__}), not a remedy name; {valid}")
        try:
            names.append(RemedyName(item))
        except ValueError:
            raise ValueError(f"remediate has unknown remedy {item!r}; {valid}") from None
    return frozenset(names)


def _valid_values() -> str:
    """What ``remediate=`` takes, for its error messages: the remedy names and the three other values."""
    names = ", ".join(r.value for r in RemedyName)
    return (f"valid names are {names} (one, or a list of them); or use True (every remedy but reduce_lr), "
            "False (none) or 'all' (every remedy, reduce_lr included)")
