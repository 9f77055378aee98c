"""The one place where AmpWatch's ranks talk to each other (docs/collectives.md draws it as a state machine).

Every collective the watch makes, in every adapter (Lightning's callback, Fabric's watch) and under every
strategy, goes through this module (tests/test_structure.py holds every other module to it): :func:`gather` (a
small record from every rank), :func:`broadcast` (a tensor from one rank: a split snapshot's entries),
:func:`all_reduce` (the log step's sums), :func:`decide` (rank zero's choice of a remedy or of its outcome, after
the agreement) and :func:`agree` (the decision every rank takes before any other collective of a region). A
region that talks to every rank (the restore of a split snapshot, a sharded model's replay) starts with a
:class:`Meeting`: each rank enters it exactly once, whatever happened to it before (its replay raised, its
snapshot failed, its watch switched itself off), and brings there whether it can go on. Only when every rank can
does any rank enter the region's other collectives; otherwise every rank stops at the same point. A rank that
cannot take part never skips the meeting: it enters it to say so.

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


def decide(choose: Callable[[], T]) -> T:
    """One decision every rank takes alike (the remedy chosen for an alarm, a watched remedy's outcome): each rank
    runs ``choose``; the ranks then agree (one small all-reduce, :func:`meet_or_abort`), a rank whose ``choose``
    raised bringing its error there; only when none did does rank zero's choice reach every rank (one
    ``broadcast_object_list``). When one did, every rank raises the same :class:`ReplayAborted` at that point, and no
    rank waits in a broadcast another rank never enters. With one process: ``choose()``, as it is."""
    if world_size() == 1:
        return choose()
    value: Any = None
    error: str | None = None
    try:
        value = choose()
    except Exception as err:  # noqa: BLE001 - brought to the agreement, raised there on every rank alike
        error = f"{type(err).__name__}: {err}"
    meet_or_abort(error)
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(vote: int) -> int:
    """Every rank's vote at one decision point, in one small all-reduce (MAX): the gravest vote any rank brought
    (:data:`CANNOT` over :data:`GO`). With one process, the vote itself."""
    if world_size() == 1:
        return vote
    return _agree_vector([vote])[0]


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


def meet_or_abort(error: str | None) -> None:
    """:func:`meet`, after which every rank raises the same :class:`ReplayAborted` when any rank brought an error
    (the failing rank too, in place of its own error): every rank leaves at this point, and says the same."""
    said = _meet(error)
    if said is not None:
        raise ReplayAborted(said)


def _meet(error: str | None, value: int = 0) -> str | None:
    """:func:`meet`'s agreement: None when no rank brought an error and every rank the same ``value``, else why not
    (the first failing rank's error, ``"rank r: error"``, or the values by rank), alike on every rank."""
    if world_size() == 1:
        return None if error is None else f"rank 0: {error}"
    if _agree_vector([CANNOT if error is not None else GO, value, -value]) == [GO, value, -value]:
        return None
    said = gather((error, value))
    failed = next(((r, e) for r, (e, _) in enumerate(said) if e is not None), None)
    if failed is not None:
        return f"rank {failed[0]}: {failed[1]}"
    return f"the ranks did not reach the same point (by rank: {[v for _, v in said]})"


def _agree_vector(votes: list[int]) -> list[int]:
    """The element-wise largest of every rank's ``votes``, in one all-reduce (MAX)."""
    t = torch.tensor(votes, dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def together(active: bool, body: Callable[[Callable[..., None]], T], absent: int = 0) -> T:
    """``body(ready)`` inside one :class:`Meeting` (``active``): ``body`` calls ``ready`` (with the value every rank
    must bring alike, if any) right before its first collective or its first change to the live state; a rank whose
    ``body`` returns without calling it brings ``absent``. When any rank could not reach it, or the values differ,
    every rank raises the same :class:`ReplayAborted` (the first failing rank's error), so that every rank says the
    same thing and none went on alone."""
    meeting = Meeting(active, absent)
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

    def __init__(self, active: bool, absent: int = 0) -> None:
        self.active = active and world_size() > 1
        self.absent = absent  # the value a rank that left without :meth:`ready` brings
        self.met = False  # this rank entered the meeting
        self.failed = False  # and a rank (this one or another) could not go on: every rank stopped there
        self.said: str | None = None  # then the first such rank's error, "rank r: error", alike on every rank

    def __enter__(self) -> "Meeting":
        return self

    def ready(self, value: int = 0) -> None:
        """This rank can go on (with ``value``, which every rank must bring alike)."""
        if self.active and not self.met:
            self.met = True
            self.said = _meet(None, value)
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
            self.ready(self.absent)
        elif not isinstance(exc, ReplayAborted):
            self.fail(f"{type(exc).__name__}: {exc}")
        return False


def said_alike(whys: list[Any]) -> Any:
    """One reason for every rank, from each rank's own (gathered, so alike everywhere): the reason itself when
    every rank that has one gives the same, else each rank's, named (``"rank 0: ...; rank 1: ..."``)."""
    given = [(r, w) for r, w in enumerate(whys) if w is not None]
    if len({w for _, w in given}) <= 1:
        return given[0][1] if given else None
    return "; ".join(f"rank {r}: {w}" for r, w in given)
