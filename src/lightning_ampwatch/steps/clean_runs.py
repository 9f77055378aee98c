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

import operator
from typing import Any, Callable, Sequence

from torch import Tensor

from lightning_ampwatch.probes import MicroBatch, tensors_in

#: A step's batches as a deferred step holds them: the micro-batches, and the bytes of their tensors (-1 where they
#: could not be counted: the snapshot ring counts them again at its next snapshot, which then fails as it would have)
Counted = tuple[list[MicroBatch], int]
#: A deferred step: ``(step, (batches, their bytes), scale, grew, lrs)``.
Deferred = tuple[int, Counted, "float | None", bool, tuple[float, ...]]
#: A consumer of clean runs: called with the run as columns, ``(steps, counted batches, scales, grews, lrss)``.
Consumer = Callable[[Sequence[int], Sequence[Counted], Sequence["float | None"], Sequence[bool],
                     Sequence[tuple[float, ...]]], None]

_NBYTES = operator.attrgetter("nbytes")
_TENSOR_ONLY = {Tensor}


def batch_nbytes(micro_batches: Sequence[Any]) -> int:
    """The bytes of the micro-batches' tensors (``tensors_in`` each batch; a tensor held twice counts twice), without
    its walk for the usual batch: a tensor, or a tuple or list of plain tensors."""
    total = 0
    for mb in micro_batches:
        batch = mb[0]
        kind = type(batch)
        if kind is Tensor:
            total += batch.nbytes
        elif (kind is tuple or kind is list) and set(map(type, batch)) == _TENSOR_ONLY:
            total += sum(map(_NBYTES, batch))
        else:
            total += sum(t.nbytes for t in tensors_in(batch))
    return total


# Why a deferred step's bytes are taken when it is closed, not when its run is handed over: measured for issue 29
# on the toy, the ring's walk over a run's batches at the log step or the snapshot step took 26 us quiet (81 us at a
# load of 4) for 50 to 100 steps, nearly all of it reading tensors the training steps since had pushed out of the
# cache; read in the step that ran on them, the same reads cost well under a microsecond.
def counted(micro_batches: list[MicroBatch]) -> Counted:
    """A step's batches with their bytes (:data:`Counted`), taken while the step that ran on them is current."""
    try:
        return micro_batches, batch_nbytes(micro_batches)
    except Exception:  # noqa: BLE001 - counted again by the ring at its next snapshot, which fails as it did before
        return micro_batches, -1

#: a deferred step's batches when nothing will hold them (see :attr:`CleanRuns.keep_batches`), and their bytes
NO_BATCHES: tuple[list[Any], int] = ([], 0)


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
