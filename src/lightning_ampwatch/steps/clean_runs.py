"""Clean steps taken in later, in runs: the step owner's batching of a healthy run's bookkeeping.

A clean step on the fast path needs nothing from the machine, the timeline or the snapshot ring at once: the ledger
holds it here (:attr:`CleanRuns.deferred`) while its step is below :attr:`CleanRuns.until` (set by the core: its
next snapshot, its cap), and hands the run over to every consumer registered at the run's start, in one call each
(:meth:`CleanRuns.settle`). Each consumer's run method equals one call per step, and the consumers do not read one
another, so a run handed over later leaves them as the steps one by one would have.

The ledger settles the run itself before anything that must see the steps taken in: any step that is not a deferred
clean one, a read of the losses, a log step, the fit's end. Whoever reads those rooms from outside a step (an
adapter's ``machine``, a checkpoint, a diagnosis emitted from inside a step) asks the ledger to settle
(``StepLedger.settle``); nobody hands a run over by hand.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from lightning_ampwatch.probes import MicroBatch

#: A deferred step: ``(step, batches, scale, grew, lrs)``.
Deferred = tuple[int, list[MicroBatch], "float | None", bool, tuple[float, ...]]
#: A consumer of clean runs: called with the run as columns, ``(steps, batches, scales, grews, lrss)``.
Consumer = Callable[[Sequence[int], Sequence[list[MicroBatch]], Sequence["float | None"], Sequence[bool],
                     Sequence[tuple[float, ...]]], None]

#: a deferred step's batches when nothing will hold them (see :attr:`CleanRuns.keep_batches`)
NO_BATCHES: list[Any] = []


class CleanRuns:
    """The clean steps held back, and who takes them in."""

    def __init__(self) -> None:
        self.deferred: list[Deferred] = []
        #: steps below this one may be held back (0: none); the core's plan (its next snapshot, its cap)
        self.until = 0
        # Whether a deferred step keeps its batches: only while a snapshot ring holds them (the core's). A held batch
        # is not free on the CPU: the allocator cannot hand its memory to the next batch, which then lands in memory
        # the cache has not seen (a plain torch loop holding 240 toy batches ran 6-15 us a step slower)
        self.keep_batches = True
        self._consumers: dict[str, Consumer] = {}

    def hand_to(self, role: str, consumer: Consumer | None) -> None:
        """``consumer`` takes every clean run from now on, in the order the roles were first registered (a role
        registered again keeps its place: the trajectory control made anew after a precision change); None: the
        role takes none any more."""
        if consumer is None:
            self._consumers.pop(role, None)
        else:
            self._consumers[role] = consumer

    def hand_to_watch(self, machine: Any, timeline: Any) -> None:
        """The watch's own consumers, after the trajectory control's (the order the steps' route feeds them in): the
        machine takes each run's scales, growths and LRs; the timeline, if one is written, records them."""
        self.hand_to("machine", lambda steps, _, scales, grews, lrss:
                     machine.observe_clean_run(steps, scales, grews, lrss))
        if timeline is not None:
            self.hand_to("timeline", lambda steps, _, scales, __, lrss: timeline.record_clean_run(steps, scales, lrss))

    def settle(self) -> None:
        """Hand the steps held back to every consumer, in one run."""
        run = self.deferred
        if not run:
            return
        self.deferred = []
        columns = tuple(zip(*run))  # the run as columns, in one C call
        for consumer in list(self._consumers.values()):
            consumer(*columns)

    def drop(self) -> None:
        """Forget the steps held back and the consumers (the run is over)."""
        self.deferred = []
        self.until = 0
        self._consumers = {}
