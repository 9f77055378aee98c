"""Why an alarm got no remedy, in a few words: the end-of-fit summary's and ``ampwatch explain``'s line under each
alarm left unfixed.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from lightning_ampwatch.interventions import INVASIVENESS
from lightning_ampwatch.records import facts_of
from lightning_ampwatch.taxonomy import Diagnosis, Finding


def unremedied_reason(diagnosis: Diagnosis, diagnoses: Sequence[Diagnosis],
                      allowed: Iterable[str] | None) -> str | None:
    """Why an alarm got no remedy, in a few words for the summary (after "not fixed: see the advice above; "): no ladder, a ladder ``remediate`` leaves out
    (``reduce_lr`` is opt-in), rungs that could not apply here, or a ladder used up by the same finding's earlier
    alarms. ``None`` when nothing can be said (``allowed`` unknown) or remediation is off."""
    from lightning_ampwatch.remedies import ladder_for

    if allowed is None:
        return None
    allowed = frozenset(allowed)
    ladder = [r.value for r in ladder_for(diagnosis)]
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
        from lightning_ampwatch.remedies.policy import MEASURED

        report = facts_of(diagnosis).interventions
        if report is None or diagnosis.finding not in MEASURED:
            return "no AMP setting fixes it"
        untried = [label for label, _ in report.not_tried]
        tail = f" ({', '.join(untried)}: not tried)" if untried else ""
        if not any(t.kind in INVASIVENESS for t in report.tried):  # only the fault and the FP32 control replayed
            return "no fix was tried on the replays" + tail
        return "no fix cured it on the replays" + tail
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
