"""Going back to before an episode's onset, before its remedy is applied (:func:`roll_back`).

A remedy applied to weights that had already diverged silences the NaNs without fixing anything, so before it is
applied the run goes back to the newest snapshot from before the onset (or the newest checkpoint file of this fit
from before it that holds the whole training state), and the episode's batches are skipped (or, with
``replay_episode``, trained on again). Where there is nothing to go back to, or nothing to undo, the remedy is applied
in place and the :class:`~lightning_ampwatch.records.Rollback` record says why. A rollback that fails leaves the alarm
published without a remedy, its evidence saying why (:func:`rollback_failed`).

Which remedy, and whether it recovered, is the treatment's (:mod:`lightning_ampwatch.remedies.treatment`): it keeps
what a next rung goes back to and hands it here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from lightning_ampwatch import compat, protocol
from lightning_ampwatch.records import Rollback, RollbackKind
from lightning_ampwatch.remedies.base import Effect
from lightning_ampwatch.taxonomy import Diagnosis, Finding

if TYPE_CHECKING:  # the front hands its control over; never imported at run time
    from lightning_ampwatch.trajectory.control import TrajectoryControl

#: What a rollback changes under the watch's feet: the scaler's state and the optimizers' (their learning rates).
ROLLED_BACK = frozenset({Effect.SCALER, Effect.OPTIMIZERS})


def roll_back(diagnosis: Diagnosis, *, now: int, control: TrajectoryControl | None, decide: Callable[[Any], Any],
              host: Any, retry: tuple[int, Any] | None = None, replay_episode: bool = False, untouched: bool = False,
              gather: Callable[[Any], list[Any]] = lambda v: [v]) -> tuple[Any, Rollback, list[Any]]:
    """Go back to the newest state from before the onset: a held snapshot, else a checkpoint file from before
    it (``host.rollback_to_checkpoint``: one this fit wrote, or resumed from, holding the whole training state;
    the host's optional ``rollback_passed_over()`` says which files it passed over, for the evidence). Returns
    the snapshot (kept for a later rung), the :class:`Rollback` record, and, with ``replay_episode``, the
    episode's held batches. ``retry``: (onset, snapshot) where a remedy of the same episode that did not recover
    went back to, the next rung's place. ``decide`` is rank zero's value on every rank; ``gather``
    every rank's value (several ranks roll back together, under a scaler): the ranks go back to a snapshot only
    where every rank holds one from the same step (each ring keeps and drops on its own budget, and a rank that
    lacks it would otherwise load a checkpoint, a collective under a sharded strategy, alone); else every rank
    looks for a checkpoint. ``host`` loads checkpoint files. The caller re-reads what a rollback changes
    (:data:`ROLLED_BACK`)."""
    if untouched:  # from the fit's first step the scaler skipped every step: nothing changed to go back from
        return None, Rollback(RollbackKind.NONE, now, why=(
            f"the scaler skipped every step since the onset at step {diagnosis.step}, the fit's first, so the "
            "weights and the optimizer are still those it started with: nothing to roll back, the remedy is "
            "applied in place"), untouched=True), []
    if diagnosis.finding is Finding.GROWTH_OVERFLOW:
        # every overflow came right after a growth and was skipped by the scaler, and the steps between trained
        # cleanly: going back would throw away healthy training to undo nothing
        return None, Rollback(RollbackKind.NONE, now, why=(
            "each overflow came right after a growth of the scale and was a step the scaler skipped, and the "
            "steps between trained cleanly: nothing to undo, the remedy is applied in place")), []
    before = _last_good_step(diagnosis)
    snapshot = retry[1] if retry is not None and retry[0] == diagnosis.step else None
    if snapshot is None and control is not None and control.ring.enabled:
        snapshot = control.ring.newest_before(max(before, 0))  # the fit's starting state is before step 0
    off = control.ring.reason if control is not None and not control.ring.enabled else None
    why = "snapshots are off" if control is None else f"no snapshot is kept ({off})" if off else \
        "snapshots are off" if not control.ring.enabled else f"no snapshot from before step {before} is held"
    # (with each rank's reason: where no rank rolls back to a snapshot, every rank says the same why)
    pairs = gather((None if snapshot is None else snapshot.step, why))
    held = [step for step, _ in pairs]
    if len(pairs) > 1:
        why = protocol.said_alike([w for _, w in pairs]) if set(held) == {None} else (
            f"the ranks do not hold the same snapshot from before step {before} (steps by rank: {held})")
    # every rank goes back to the same step, or none to a snapshot
    target = decide(held[0] if len(set(held)) == 1 else None)
    if target is not None and snapshot is not None and snapshot.step == target:
        assert control is not None  # (a snapshot is held: the control holds it)
        # (the episode is re-run only where steps can be replayed: not under DeepSpeed's engine)
        episode = control.ring.batches(target + 1, now - 1) \
            if replay_episode and control.state.replay_unavailable is None else []
        if len(episode) != (now - 1 - target):
            episode = []  # not every batch is held (a retry after the ring was reset): skipped instead
        if diagnosis.finding is Finding.DATA_NONFINITE:  # the batch that held the NaN/inf is never trained on again
            episode = [e for e in episode if e[0] != diagnosis.step]
        # every rank restores together (a split snapshot's broadcasts), after one meeting where a rank whose
        # checks failed says so: then every rank raises the same error, and none enters a broadcast
        protocol.together(len(held) > 1, lambda ready: snapshot.restore(control.state, ready))
        control.ring.reset()  # what it held after the snapshot belongs to the abandoned steps
        return snapshot, Rollback(RollbackKind.SNAPSHOT, now, to_step=target + 1, snapshot_step=target), episode
    if len(held) > 1:  # every rank restores the same checkpoint, or none does (one meeting, right before it)
        path, ckpt_step = protocol.together(
            True, lambda ready: host.rollback_to_checkpoint(before, ready=ready), absent=-1)
    else:
        path, ckpt_step = host.rollback_to_checkpoint(before)
    if path is not None:
        return None, Rollback(RollbackKind.CHECKPOINT, now, to_step=ckpt_step, path=path), []
    if before < 0:
        return None, Rollback(RollbackKind.NONE, now, why=(
            f"the episode began at step {diagnosis.step}, before any state could be kept, so the remedy is "
            "applied in place")), []
    unavailable = getattr(host, "rollback_unavailable", None)  # optional on a host (host.py)
    no_checkpoint = unavailable() if callable(unavailable) else None
    if no_checkpoint is not None:  # the strategy's reason, not "no file was found"
        return None, Rollback(RollbackKind.NONE, now, why=f"{why}, and {no_checkpoint}; the remedy is applied "
                                                              "in place"), []
    passed = getattr(host, "rollback_passed_over", None)  # optional on a host (host.py)
    passed_over = passed() if callable(passed) else None
    if passed_over is not None:  # files were there, but none this fit's with its whole training state
        return None, Rollback(RollbackKind.NONE, now, why=(
            f"{why} and no checkpoint file from before it could be rolled back to (passed over: {passed_over}), "
            "so the remedy is applied in place")), []
    return None, Rollback(RollbackKind.NONE, now, why=f"{why} and no checkpoint file from before it was found, "
                                                          "so the remedy is applied in place"), []


def rollback_failed(diagnosis: Diagnosis, err: Exception) -> Diagnosis:
    """The rollback raised: the alarm is published without a remedy (one applied to a state the failed rollback
    may have left partly restored would be judged on nothing known), its evidence saying what failed."""
    said = str(err) if isinstance(err, compat.RollbackFailed) else f"{type(err).__name__}: {err}"
    return replace(diagnosis, evidence={**diagnosis.evidence, "rollback": f"failed: {said}; no remedy was applied"})


def _last_good_step(diagnosis: Diagnosis) -> int:
    """The step before which the run is surely healthy: the loss at the onset was computed with the weights the
    previous step's update left, so that update may be the one that did the damage; and an LR rise that set the
    episode off happened at ``lr_change_step``, earlier still."""
    step = diagnosis.step - 1
    lr_change = diagnosis.measured.lr.step if diagnosis.measured.lr is not None else None
    return min(step, lr_change) if lr_change is not None else step
