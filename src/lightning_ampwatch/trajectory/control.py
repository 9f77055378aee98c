"""The FP32 trajectory control (:class:`TrajectoryControl`): snapshots taken at the core's steps, within a memory
budget and at a cadence that follows what they cost, and the judge that replays the steps since one of them for an
alarm that blames reduced precision (:class:`~lightning_ampwatch.trajectory.judge.TrajectoryJudge`, ``judgement``).
Owned by the core (``RunWatcher.trajectory``); the step route hands it every step's batches, the investigations
its judge the alarm, the treatment its snapshots to roll back to."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from lightning_ampwatch import distributed
from lightning_ampwatch.machine import Thresholds
from lightning_ampwatch.steps.cadence import SnapshotCadence
from lightning_ampwatch.trajectory.judge import TrajectoryJudge
from lightning_ampwatch.trajectory.ring import SnapshotRing
from lightning_ampwatch.trajectory.state import TrainState


class TrajectoryControl:
    """The true FP32 control: snapshots every ``every`` steps within a memory budget (``ring``; ``adaptive``: the
    interval lengthened from what the first ones cost), and their judge (:attr:`judgement`), which for an alarm that
    blames reduced precision runs the steps since the newest snapshot before the onset again in FP32 and at the run's
    own precision (then the live state is put back exactly). Its verdict is the one that stands."""

    def __init__(self, ring: SnapshotRing, state: TrainState, divergence_ratio: float,
                 say: Callable[[str], None], adaptive: bool = False,
                 on_failure: Callable[[str, Exception], None] | None = None,
                 thresholds: Thresholds | None = None) -> None:
        self.ring = ring
        self.state = state
        self.judgement = TrajectoryJudge(ring, state, divergence_ratio, thresholds or Thresholds())
        self.say = say
        self.on_failure = on_failure  # the callback's: a failure is reported once, the watch goes on
        if state.unavailable is not None:
            ring.turn_off(state.unavailable)  # said in the evidence of each alarm it would have judged
        self.paused = False  # while a remedy is watched: a snapshot of a run not yet known to be healthy is no base
        # ``snapshot_every="auto"``: the interval is lengthened from what the first snapshots cost (one process
        # only: under DDP the ranks must snapshot at the same steps, and the interval asked for stays)
        self.cadence = SnapshotCadence(ring.every) if adaptive and distributed.world_size() == 1 else None
        self._last_snapshot: tuple[int, float] | None = None  # (step, clock) at the end of the latest one timed
        #: while the cadence measures: (step, clock) at the end of every step since the latest snapshot, so that a
        #: snapshot is timed as what its whole step costs over an ordinary one (cache effects and all)
        self._step_ends: list[tuple[int, float]] | None = [] if self.cadence is not None else None
        self.start_step = 0  # the first step of this fit (its starting state is snapshotted before it)
        self.keep = ring.keep

    @classmethod
    def for_run(cls, config: Any, host: Any, ledger: Any, say: Callable[[str], None],
                on_failure: Callable[[str, Exception], None]) -> "TrajectoryControl | None":
        """The control of one run, from the watch's configuration (``snapshot_every``, ``snapshot_budget``,
        ``control_replay``, the thresholds) and the host (what a replay drives, the processes that share the node's
        snapshot budget), started with a snapshot of the state before its first step; None where it is off.
        From the ledger (:class:`~lightning_ampwatch.steps.StepLedger`) it takes each step's LRs (``lr_log``, which
        a replay runs its steps at) and the clean steps' batches it holds back (``runs``, handed over in runs)."""
        if not (config.snapshot_every and config.control_replay):
            return None
        every, adaptive = config.snapshot_interval  # "auto": the cadence lengthens it from the measured copies
        # the default budget is the node's, shared by the processes training on it
        ring = SnapshotRing(config.snapshot_budget, every,
                            processes_per_node=int(getattr(host, "processes_per_node", 1) or 1))
        control = cls(ring, host.train_state(), config.thresholds.divergence_ratio, say, adaptive=adaptive,
                      on_failure=on_failure, thresholds=config.thresholds)
        control.state.lr_log = ledger.lr_log
        control.start(host.global_step)  # a state from before the first step this run takes
        ledger.runs.hand_to("trajectory", lambda steps, batches, *_: control.note_run(steps, batches))
        return control

    def start(self, global_step: int) -> None:
        """The fit starts (or resumes) at ``global_step``: a snapshot of the state before its first step, so that an
        episode at that very step has a state to replay from and to roll back to."""
        ring = self.ring
        self.start_step = global_step
        if not ring.enabled:
            return
        try:
            ring.after_step(global_step - 1, self.state, due=True)
        except Exception as err:  # noqa: BLE001 - a failed snapshot costs the control, never the run
            self._failed(err)
            return
        if not ring.enabled:
            self.say(f"{ring.reason}. The FP32 control falls back to replaying the faulty batch alone, and the "
                     "loss trend still separates divergence from overflow.")

    def _failed(self, err: Exception) -> None:
        """A snapshot failed: the ring is off for the run with the real reason, and the failure reported once."""
        self.ring.turn_off(f"the snapshot ring is off for this run: a snapshot failed ({type(err).__name__}: {err})")
        if self.on_failure is not None:
            self.on_failure("a snapshot for the FP32 trajectory control", err)

    def note_step(self, step: int, batches: Sequence[Any], quiet: bool, known: bool = True) -> None:
        """Optimizer step ``step`` is over: keep its batches, and take a snapshot when one is due (only while nothing
        is in progress, ``quiet``: a snapshot of a faulty state is no control). Until a healthy loss level is
        ``known``, the fit's starting state is the only one known to be healthy: no snapshot may push it out of the
        ring (the losses since are not read yet, and may be climbing)."""
        ring = self.ring
        if not ring.enabled:
            return
        try:
            ring.add_batches(step, batches)
            if quiet and not self.paused and step % ring.every == 0:  # due (the ring's rule, checked here: per step)
                held = ring.snapshots
                keep_start = not known and bool(held) and held[0].step == self.start_step - 1
                ring.keep = self.keep + 1 if keep_start else self.keep  # the start state, and the newest as ever
                if not keep_start or len(held) < ring.keep:
                    if self.cadence is None or self.cadence.decided:
                        ring.after_step(step, self.state)
                    else:
                        self._timed_snapshot(step)
        except Exception as err:  # noqa: BLE001 - the step is still taken in by the ledger: never drop it
            self._failed(err)
            return
        if not ring.enabled:  # the budget turned it off just now (``say`` says a line once)
            self.say(f"{ring.reason}. The FP32 control falls back to replaying the faulty batch alone, and the "
                     "loss trend still separates divergence from overflow.")
            return
        ends = self._step_ends
        if ends is not None:  # the cadence is measuring (the first few snapshots' spans only)
            ends.append((step, time.perf_counter()))
            if len(ends) > 4 * ring.every:  # no snapshot for long (a stretch of trouble): the newest suffice
                del ends[:-ring.every]

    def note_run(self, steps: Sequence[int], batches: Sequence[Any]) -> None:
        """:meth:`note_step` for a run of clean steps taken in later (their steps and batches, in order): the batches
        kept. The core defers no step a snapshot is due at, and none while the cadence measures (its clock
        is read at each step's end), so keeping the batches is all :meth:`note_step` would do for them."""
        ring = self.ring
        if not ring.enabled:
            return
        try:
            ring.add_run(steps, batches)
        except Exception as err:  # noqa: BLE001 - as note_step
            self._failed(err)
            return
        if not ring.enabled:
            self.say(f"{ring.reason}. The FP32 control falls back to replaying the faulty batch alone, and the "
                     "loss trend still separates divergence from overflow.")

    @property
    def defer_limit(self) -> int | None:
        """For the core's deferral: the interval the next snapshot is due at a multiple of, 0 when clean steps may
        not be deferred at all (the cadence is measuring: each step's end is timed), None when no snapshot is
        taken."""
        ring = self.ring
        if not ring.enabled:
            return None
        if self._step_ends is not None:
            return 0
        return ring.every

    def _timed_snapshot(self, step: int) -> None:
        """A snapshot that is due, timed for the cadence, which sets the interval (once, said once).

        What a snapshot costs is what its step takes over an ordinary step of the same span: the step from the end
        of the one before it to the end of the snapshot, less the fastest of the span's steps (the copy's own time
        when that is more; load from elsewhere only adds time, so the fastest step is the ordinary one's best
        estimate, and the cadence keeps the lowest of these costs). Timing the copy alone, cache-warm, reads
        several times lower than a snapshot step costs in the run: the copy and its bookkeeping run once in many
        steps, from a cold cache. A snapshot without an ordinary step measured before it (the first of the run)
        only starts the span. The healthy step the copy is set against is the median of the span's ordinary steps
        (at most the span's mean): a few steps that load from elsewhere stretched to several times the rest would
        otherwise raise the mean, and shorten the interval, on a busy machine."""
        assert self.cadence is not None
        ring, last, ends = self.ring, self._last_snapshot, self._step_ends or []
        start = time.perf_counter()
        ring.after_step(step, self.state)
        end = time.perf_counter()
        if not ring.enabled:
            return
        ordinary = [t1 - t0 for (s0, t0), (s1, t1) in zip(ends, ends[1:]) if s1 == s0 + 1]
        before = ends[-1][1] if ends and ends[-1][0] == step - 1 else None
        self._step_ends = []  # the next span starts with this step (note_step adds its end)
        if before is None or not ordinary:
            self._last_snapshot = None
            return
        copy_s = max(end - start, (end - before) - min(ordinary))
        self._last_snapshot = (step, end)
        span = (end - last[1], step - last[0]) if last is not None else (None, 0)
        per_step = ring.step_batch_bytes  # the most one step's batches held: the memory bound
        room = (ring.budget_bytes - ring.bytes_per_snapshot) // per_step if per_step else None
        said = self.cadence.observe(copy_s, *span, room_steps=room, step_s=statistics.median(ordinary))
        if self.cadence.decided:
            ring.every = self.cadence.every
            # the bound on held steps follows the interval (as the ring sets it from the one it was made with): a
            # longer interval under the old bound let every snapshot go before the next was due
            ring.max_held_steps = max(ring.max_held_steps, ring.every * (self.keep + 2))
            self._step_ends = None  # measured: no clock on the steps from here on
        if said is not None:
            self.say(said)
