"""The learning rate's history, as the state machine keeps it: the change points only (a constant LR costs
nothing per step) and the latest rise, in :class:`~lightning_ampwatch.machine.state.MachineState`; and which LR
event, if any, came just before an onset (a warmup that just peaked, or a plain increase). Pure Python; imports the
machine package's ``state`` and ``vocabulary`` only.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from lightning_ampwatch.machine.state import LrPoint, LrRise, MachineState
from lightning_ampwatch.machine.vocabulary import Thresholds
import lightning_ampwatch.measured as measured
from lightning_ampwatch.measured import LrEvent


def record_lr(s: MachineState, t: Thresholds, step: int, lrs: tuple[float, ...]) -> None:
    """Keep the LR's change points only (a constant LR costs nothing per step), and the latest rise."""
    if not lrs:
        return
    lr = max(lrs)
    if lr == s.lr_last:
        return
    s.lr_last = lr
    previous = s.lr_history[-1] if s.lr_history else None
    if previous is not None and lr > previous.lr:
        rise = s.lr_rise
        if rise is not None and rise.top_step == previous.step and \
                step - previous.step <= t.lr_lookback:
            rise.top_step, rise.top_lr, rise.points = step, lr, rise.points + 1
        else:  # a new rise, from the LR just before it
            s.lr_rise = LrRise(previous.step, previous.lr, step, lr)
    s.lr_history.append(LrPoint(step, lr))


def record_lr_run(s: MachineState, t: Thresholds, steps: Sequence[int], lrss: Sequence[tuple[float, ...]]) -> None:
    """:func:`record_lr` for a run of steps (``lrss`` their LRs, one tuple per step), checked only where the run's LR
    tuple changes: after a check ``s.lr_last`` holds that tuple's LR, so an unchanged tuple is a no-op."""
    first = lrss[0]
    if lrss.count(first) == len(steps):  # one LR through the run (a constant LR keeps its tuple): one check
        if first and (first[0] if len(first) == 1 else max(first)) != s.lr_last:
            record_lr(s, t, steps[0], first)
        return
    previous: tuple[float, ...] | None = None
    for step, lrs in zip(steps, lrss):
        if lrs is not previous:
            previous = lrs
            if lrs and (lrs[0] if len(lrs) == 1 else max(lrs)) != s.lr_last:
                record_lr(s, t, step, lrs)


def lr_event(s: MachineState, t: Thresholds, onset: int, now_lr: float | None = None) -> dict[str, Any] | None:
    """An LR rise in the steps just before ``onset``: a warmup that just peaked, or a plain increase. ``now_lr``
    is the LR of the latest step (not yet in the history): a warmup still rising has not ended."""
    # A warmup climbs over many steps, so its last few rise little: judge it by the whole rise (from the LR
    # it started at to a peak just before the onset). A single jump is an increase, not a warmup; and a ramp
    # whose LR is still going up at the onset (or after it) has not peaked: its warmup has not ended.
    rise = s.lr_rise
    stopped = rise is not None and (now_lr is None or now_lr <= rise.top_lr)
    if (rise is not None and stopped and rise.points >= 2 and onset - t.lr_lookback - 1 <= rise.top_step < onset
            and rise.top_lr >= t.warmup_ratio * rise.start_lr):
        return {**measured.LrRise(LrEvent.WARMUP_END, rise.start_lr, rise.top_lr, rise.top_step).entries(),
                "lr_ramp_start": rise.start_lr, "lr_ramp_start_step": rise.start_step}
    start = onset - t.lr_lookback - 1
    in_force = [p for p in s.lr_history if p.step < start][-1:]  # the LR at the window's start
    window = [LrPoint(start, p.lr) for p in in_force]
    window += [p for p in s.lr_history if start <= p.step < onset]
    best: tuple[float, LrPoint, LrPoint] | None = None
    lowest: LrPoint | None = None
    for point in window:
        if lowest is not None and point.lr > lowest.lr:
            ratio = math.inf if lowest.lr <= 0 else point.lr / lowest.lr
            if best is None or ratio > best[0]:
                best = (ratio, lowest, point)
        if lowest is None or point.lr < lowest.lr:
            lowest = point
    if best is None or best[0] < 1 + t.lr_rise:
        return None
    _, lo, hi = best
    ev: dict[str, Any] = measured.LrRise(LrEvent.LR_INCREASE, lo.lr, hi.lr, hi.step).entries()
    if rise is not None and rise.points >= 2 and rise.start_lr < lo.lr and rise.top_step >= lo.step:
        # the rise is the end of a longer ramp: where that began is its own field, not the LR before
        ev.update(lr_ramp_start=rise.start_lr, lr_ramp_start_step=rise.start_step)
    return ev


#: At most this many change points stay in an :class:`LrLog` (trimmed back to ``LR_LOG_KEEP`` past it): a schedule
#: that changes the LR every step keeps the latest steps' LRs, far more than a replay's window reaches back
LR_LOG_MAX = 4096
LR_LOG_KEEP = 2048


class LrLog:
    """The learning rates each optimizer step ran with, as the ledger read them: ``(step, lrs)`` change points in
    the order they were read (a constant LR adds nothing per step). The LRs of step ``s`` are those of the latest
    point read at or before ``s`` (after a rollback, points for steps already passed follow later ones: the last
    read wins). The replay runs each step at them (``trajectory.replay_trajectory``), so an LR set outside the
    schedulers (a callback, a hand-written warmup) is replayed too."""

    __slots__ = ("entries", "swapped_at")

    def __init__(self) -> None:
        self.entries: list[tuple[int, tuple[float, ...]]] = []
        #: the step at which the ledger saw the optimizers replaced (a callback swapped them), or None: the
        #: snapshots then hold the old optimizers' state and are stale (``trajectory.Snapshot.stale``)
        self.swapped_at: int | None = None

    def clear(self) -> None:
        self.entries.clear()  # in place: the replay's state holds this log
        self.swapped_at = None

    def trim(self) -> None:
        entries = self.entries
        if len(entries) > LR_LOG_MAX:
            del entries[:-LR_LOG_KEEP]

    def at(self, step: int) -> tuple[float, ...] | None:
        """The LRs step ``step`` ran with; None when no point read reaches back that far."""
        for point, lrs in reversed(self.entries):
            if point <= step:
                return lrs
        return None


#: A new param group counts as an LR rise when its LR is at least this many times the others' largest.
ADDED_GROUP_RATIO = 10.0


def added_group(entries: Sequence[tuple[int, tuple[float, ...]]], onset: int, lookback: int) -> dict[str, Any] | None:
    """The LR evidence of a param group added within ``lookback`` steps before ``onset`` (or at it) whose LR is at
    least :data:`ADDED_GROUP_RATIO` times the largest LR of the groups before it (Lightning's ``BackboneFinetuning``
    unfreezing a backbone at a high LR), from the LRs each step ran with (``entries``: (step, its groups' LRs), as
    the trajectory control's LR log keeps them); None otherwise."""
    by_step: dict[int, tuple[float, ...]] = {}
    for point, lrs in entries:
        by_step[point] = tuple(lrs)  # the last read of a step wins (after a rollback, points are read again)
    ordered = sorted(by_step.items())
    for (_, before), (point, after) in zip(ordered, ordered[1:]):
        if not (onset - lookback <= point <= onset) or len(after) <= len(before) or not before:
            continue
        old, new = max(before), max(after[len(before):])
        if old > 0 and new >= ADDED_GROUP_RATIO * old:
            return measured.LrRise(LrEvent.PARAM_GROUP_ADDED, old, new, point).entries()
    return None
