"""The one place where AmpWatch's ranks talk to each other (docs/collectives.md draws it as a state machine).

Every collective the watch makes goes through this module: :func:`gather` (a small record from every rank),
:func:`broadcast` (a tensor from one rank: a split snapshot's entries), :func:`all_reduce` (the log step's sums)
and :func:`agree` (the decision every rank takes before any other collective of a region). A region that talks
to every rank (the restore of a split snapshot, a sharded model's replay) starts with a :class:`Meeting`: each rank
enters it exactly once, whatever happened to it before (its replay raised, its snapshot failed, its watch switched
itself off), and brings there whether it can go on. Only when every rank can does any rank enter the region's
other collectives; otherwise every rank stops at the same point. A rank that cannot take part never skips the
meeting: it enters it to say so.

This module imports nothing from the package (the others import it), so no import cycle runs through it.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

#: What a rank brings to an agreement (:func:`agree`): the largest value any rank brought wins, so that a rank that
#: cannot go on outweighs every rank that can.
GO = 0
CANNOT = 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a small picklable record), on every rank."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(t: torch.Tensor, src: int) -> None:
    """``t`` from rank ``src`` into ``t`` on every rank (in place)."""
    dist.broadcast(t, src=src)


def all_reduce(t: torch.Tensor) -> None:
    """The sum of ``t`` over every rank, in place."""
    dist.all_reduce(t)


def agree(vote: int) -> int:
    """Every rank's vote at one decision point, in one small all-reduce (MAX): the gravest vote any rank brought
    (:data:`CANNOT` over :data:`GO`). With one process, the vote itself."""
    if world_size() == 1:
        return vote
    t = torch.tensor([vote], dtype=torch.int64)
    if dist.get_backend() == "nccl":  # (NCCL reduces device tensors only)
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


class ReplayAborted(RuntimeError):
    """Another rank could not take part in a region that talks to every rank: this rank stops at the same meeting,
    before the region's first collective, so that no rank waits in a collective another rank never enters."""


def meet(error: str | None) -> bool:
    """Every rank at the same point, each bringing its error (None: none). Returns whether any rank brought one;
    raises :class:`ReplayAborted` (naming the first rank that brought one, and its error) on a rank that brought
    none when another did, so that every rank stops there. One small all-reduce (nothing with one process); only
    when a rank failed, every rank (each knows it) then gathers the errors, to say which."""
    said = _meet(error)
    if said is not None and error is None:
        raise ReplayAborted(said)
    return said is not None


def _meet(error: str | None) -> str | None:
    """:func:`meet`'s agreement: None when no rank brought an error, else the first one's, ``"rank r: error"``,
    alike on every rank."""
    if world_size() == 1:
        return None if error is None else f"rank 0: {error}"
    if agree(CANNOT if error is not None else GO) == GO:
        return None
    return next(f"rank {r}: {e}" for r, e in enumerate(gather(error)) if e is not None)


def together(active: bool, body: Callable[[Callable[[], None]], T]) -> T:
    """``body(ready)`` inside one :class:`Meeting` (``active``): ``body`` calls ``ready`` right before its first
    collective. When any rank could not reach it, every rank raises the same :class:`ReplayAborted` (the first
    failing rank's error), so that every rank says the same thing."""
    meeting = Meeting(active)
    try:
        with meeting:
            return body(meeting.ready)
    except Exception as err:
        if meeting.failed and meeting.said is not None:
            raise ReplayAborted(meeting.said) from err
        raise


class Meeting:
    """One meeting that every rank enters exactly once, before the first collective of a region (``active``; with
    ``active`` False it is no meeting at all):

    - :meth:`ready`, right before that first collective: the rank can go on. Raises :class:`ReplayAborted` when
      another rank could not.
    - leaving the ``with`` block with an exception before :meth:`ready` was reached: the rank enters the meeting to
      say that it cannot (the exception goes on up).
    - leaving it without an exception and without :meth:`ready` (a path that reached no collective): the rank still
      enters the meeting, as one that can go on; when another rank could not, :class:`ReplayAborted` is raised.
    """

    def __init__(self, active: bool) -> None:
        self.active = active and world_size() > 1
        self.met = False  # this rank entered the meeting
        self.failed = False  # and a rank (this one or another) could not go on: every rank stopped there
        self.said: str | None = None  # then the first such rank's error, "rank r: error", alike on every rank

    def __enter__(self) -> "Meeting":
        return self

    def ready(self) -> None:
        if self.active and not self.met:
            self.met = True
            self.said = _meet(None)
            if self.said is not None:
                self.failed = True
                raise ReplayAborted(self.said)

    def fail(self, error: str) -> None:
        """Enter the meeting (if not entered yet) as a rank that cannot go on."""
        if self.active and not self.met:
            self.met = True
            self.said = _meet(error)
            self.failed = self.said is not None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.ready()
        elif not isinstance(exc, ReplayAborted):
            self.fail(f"{type(exc).__name__}: {exc}")
        return False
