"""How often to take a snapshot: an interval chosen from what a snapshot was measured to cost.

A snapshot's price is one host copy of the weights and optimizer state (and the ring's bookkeeping around it),
paid once per interval; a healthy step pays its share of it. :class:`SnapshotCadence` takes the first few
snapshots' costs against the steps between them and, once, lengthens the interval so that the snapshots cost at
most ``fraction`` of the training time they span. It never shortens the interval below the one the user asked
for. Its caller (``trajectory.control.TrajectoryControl``) measures a snapshot's cost as what its whole step takes over
the fastest ordinary step of its span: the copy alone, timed cache-warm, reads several times lower than a snapshot
step costs in a run, where the copy and its bookkeeping run once in many steps, from a cold cache.

Those first snapshots are timed while no healthy step is held back (each step's end is timed); in the steady run
that follows, a snapshot step also takes in the healthy steps held back since the last one (``steps.clean_runs``),
which is what the benchmark (``benchmarks/overhead.py``) reports a snapshot step to cost. So the interval is checked
again against ``STEADY_MEASURED`` snapshot steps of the steady run, timed whole in the hooks, and lengthened if they
cost more, then checked at the longer interval, up to ``STEADY_ROUNDS`` times (:meth:`SnapshotCadence.observe_steady`): on the toy, 0.24 ms for the first
snapshots against 0.46 ms a steady snapshot step (issue 29), so the 0.25% aimed at had landed at 0.37 to 0.63%;
with the checks, 0.30 to 0.34% (``benchmarks/FINDINGS.md``: a snapshot step costs 2 to 4 us more for each step
of a longer interval, a share of every step that no interval spreads thinner).

On CUDA a snapshot's copies go to pinned memory without a sync: the time the host spends is their launch, and
the transfers overlap the next steps, so there the interval mostly stays as asked.

Pure: it reads no clock and knows no tensor. The caller hands it a snapshot's duration and the time the steps
since the previous snapshot took; it answers with the interval to use and, once, a sentence to say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

#: ``snapshot_every="auto"``: the interval the first snapshots are taken at, before their cost is known.
AUTO_START = 20
#: The most of a healthy run's time that snapshots may take: at most this fraction of the steps they span. A
#: quarter of the 1% a healthy step may cost in all: on a 1 ms step the hooks and the log step need the rest.
SNAPSHOT_FRACTION = 0.0025
#: Snapshots timed before the interval is chosen. The first snapshots allocate their host buffers; from the
#: third on (two are held) a snapshot reuses the oldest one's, as in the rest of the run.
SNAPSHOTS_MEASURED = 3
#: Snapshot steps of the steady run timed whole, once the interval is decided, before it is checked; and the most
#: checks made, each at the longer interval the one before chose (a snapshot step costs more at a longer interval:
#: it lets go of more batches), until one leaves the interval as it is.
STEADY_MEASURED = 3
STEADY_ROUNDS = 3
#: The longest interval the policy picks, in optimizer steps: a longer one holds more batches and makes the
#: trajectory control replay more steps per alarm. A snapshot that would need longer is said to cost more.
MAX_INTERVAL = 1000


def snapshot_interval(copy_s: float, step_s: float, every: int, fraction: float = SNAPSHOT_FRACTION,
                      max_interval: int = MAX_INTERVAL) -> int:
    """The interval at which a snapshot taking ``copy_s`` seconds costs at most ``fraction`` of the training time
    between two snapshots, for healthy steps of ``step_s`` seconds: the smallest multiple of ``every`` (the
    interval asked for) with ``copy_s <= fraction * interval * step_s``, at most ``max_interval`` (unless
    ``every`` itself is longer). Times that are not positive and finite leave ``every`` as it is."""
    if every < 1:
        raise ValueError(f"every={every!r}: expected a whole number of steps of at least 1")
    if max_interval < every:
        return every
    if not (fraction > 0 and math.isfinite(copy_s) and math.isfinite(step_s)) or copy_s <= 0 or step_s <= 0:
        return every
    needed = copy_s / (fraction * step_s)  # steps the copy must be spread over
    multiple = max(1, math.ceil(needed / every - 1e-9))
    return min(multiple * every, max_interval - max_interval % every)


def _check_interval_and_fraction(every: object, fraction: float) -> None:
    """What both cadences take: a whole number of steps of at least 1, and a fraction of the training time."""
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every={every!r}: expected a whole number of steps of at least 1")
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction!r}: expected a number between 0 and 1")


@dataclass
class SnapshotCadence:
    """The snapshot interval of one run: the one asked for, until the first ``measured`` snapshots have been timed;
    then the interval :func:`snapshot_interval` picks from the fastest of them, kept for the rest of the run."""

    every: int
    fraction: float = SNAPSHOT_FRACTION
    measured: int = SNAPSHOTS_MEASURED
    max_interval: int = MAX_INTERVAL
    asked: int = field(init=False)
    decided: bool = field(default=False, init=False)
    copies: list[float] = field(default_factory=list, init=False)  # seconds per snapshot, as timed
    steps: list[float] = field(default_factory=list, init=False)  # seconds per healthy step between snapshots
    #: seconds per snapshot step of the steady run, as its hooks paid it (:meth:`observe_steady`)
    steady: list[float] = field(default_factory=list, init=False)
    checked: bool = field(default=False, init=False)  # the steady run's snapshot steps have checked the interval
    _rounds: int = field(default=0, init=False)  # checks made
    _before: int | None = field(default=None, init=False)  # the interval before the first check lengthened it
    _cost: float = field(default=0.0, init=False)  # the snapshot step's cost the interval was last chosen for
    _longest: int = field(default=MAX_INTERVAL, init=False)  # the bound the decision was made under

    def __post_init__(self) -> None:
        _check_interval_and_fraction(self.every, self.fraction)
        self.asked = self.every

    def observe(self, copy_s: float, span_s: float | None, span_steps: int,
                room_steps: int | None = None, step_s: float | None = None) -> str | None:
        """One snapshot took ``copy_s`` seconds; the ``span_steps`` steps since the previous one took ``span_s``
        (None for the first snapshot). ``room_steps``: the most steps of batches the memory budget holds beside
        a snapshot (None: no limit known), a bound on the interval. ``step_s``: a healthy step of the span as the
        caller measured it step by step (the median of its ordinary steps), used instead of the span's mean,
        which load from elsewhere inflates (a few steps of several milliseconds among steps of well under one
        shorten the interval, while the copy, taken as a least time, is not inflated alike). Once enough
        snapshots are timed the interval is decided (:attr:`decided`, :attr:`every`); the sentence returned then,
        when it differs from the one asked for, is to be said once. Otherwise None."""
        if self.decided:
            return None
        self.copies.append(copy_s)
        if span_s is not None and span_steps > 0 and span_s > copy_s:
            mean = (span_s - copy_s) / span_steps  # the span's steps, without the copy itself
            ok = step_s is not None and math.isfinite(step_s) and step_s > 0
            self.steps.append(min(mean, step_s) if ok else mean)  # type: ignore[type-var]
        if len(self.copies) < self.measured or not self.steps:
            return None
        self.decided = True
        copy = min(self.copies)  # load from elsewhere only ever adds time
        step = min(self.steps)
        longest = self.max_interval if room_steps is None else max(self.asked, min(self.max_interval, room_steps))
        self._longest = longest
        chosen = snapshot_interval(copy, step, self.asked, self.fraction, longest)
        self.every = chosen
        if chosen == self.asked:
            return None
        return self._said(f"A snapshot takes {copy * 1e3:.2f} ms", copy, step, self.asked)

    def observe_steady(self, cost_s: float, step_s: float | None = None) -> str | None:
        """Once decided: a snapshot step of the steady run took ``cost_s`` seconds in the watch's hooks, the copy
        with the bookkeeping handed over there (the healthy steps taken in later, in runs, which no snapshot timed
        before the decision sees: nothing is held back while the first snapshots are timed); ``step_s``: the mean
        step since the previous one timed (None for the first). After ``STEADY_MEASURED`` of them the interval is
        checked: lengthened, never shortened, to the one :func:`snapshot_interval` picks for their median (a snapshot
        step varies with what it hands over: the least of them reads low against the typical one the benchmark
        reports, and the median passes over one that load from elsewhere stretched) against the least healthy step
        measured (the first snapshots' span their warm-up steps, slower than
        the steady run's). A check that lengthens it is made again at the new interval, up to ``STEADY_ROUNDS``
        checks or the longest interval; then the interval is final (:attr:`checked`), and the sentence returned,
        when it changed, is to be said once. Otherwise None."""
        if not self.decided or self.checked:
            return None
        self.steady.append(cost_s)
        if step_s is not None and math.isfinite(step_s) and step_s > 0:
            self.steps.append(step_s)
        if len(self.steady) < STEADY_MEASURED:
            return None
        cost, step = sorted(self.steady)[len(self.steady) // 2], min(self.steps)
        chosen = snapshot_interval(cost, step, self.asked, self.fraction, self._longest)
        self._rounds += 1
        at_final = chosen <= self.every  # this cost was measured at the interval that stays
        if chosen > self.every:
            self._before = self.every if self._before is None else self._before
            self.every, self._cost = chosen, cost
            if self._rounds < STEADY_ROUNDS and chosen < self._longest:
                self.steady = []  # timed again at the longer interval
                return None
        self.checked = True
        if self._before is None:
            return None
        if at_final:  # say what a snapshot step costs at the interval in force, as measured there
            return self._said(f"A snapshot step takes {cost * 1e3:.2f} ms at this interval once the healthy steps are "
                              "taken in by the run", cost, step, self._before)
        # the last lengthening is not measured yet (a snapshot step costs more the longer the interval): say so
        return self._said(f"A snapshot step took {self._cost * 1e3:.2f} ms at a shorter interval once the healthy steps "
                          "are taken in by the run (not timed at the longer one, where it costs more)",
                          self._cost, step, self._before, measured=False)

    def _said(self, what: str, cost: float, step: float, before: int, measured: bool = True) -> str:
        """The sentence said once when the interval changes from ``before`` to :attr:`every` (``measured``: ``cost``
        was timed at the new interval; else the share is a floor, and the sentence claims no ceiling)."""
        chosen = self.every
        share = cost / (chosen * step)
        said = f"{what} against a healthy step of {step * 1e3:.2f} ms: "
        if not measured:
            longest = " (the longest interval the memory budget and the replay length allow)" \
                if chosen >= self._longest else ""
            said += (f"one is taken every {chosen} steps instead of every {before}{longest}; snapshots take at least "
                     f"{share:.2%} of the training time (aimed at: at most {self.fraction:.2%}); snapshot_every=0 "
                     "turns them off.")
        elif share <= self.fraction * (1 + 1e-9):
            said += (f"one is taken every {chosen} steps instead of every {before}, so that snapshots take "
                     f"{share:.2%} of the training time (at most {self.fraction:.2%}).")
        else:
            said += (f"one is taken every {chosen} steps instead of every {before} (the longest interval the "
                     f"memory budget and the replay length allow), and snapshots still take {share:.2%} of the "
                     f"training time, over the {self.fraction:.2%} aimed at; snapshot_every=0 turns them off.")
        return said


# ---------------------------------------------------------------------------------------------------------------
# The log step's cadence
# ---------------------------------------------------------------------------------------------------------------

#: The most of a healthy run's time that the log steps' own work (the losses' read, the loss level, the timeline's
#: write) may take: the same quarter of the 1% budget that snapshots get.
LOG_FRACTION = 0.0025
#: Log steps are timed only from this optimizer step on: the cadence never changes a short run (and a run's first
#: log steps pay for first calls: imports, the timeline's file opened).
LOG_CADENCE_AFTER = 300
#: Log steps timed (each against the steps since the previous one) before the interval is chosen.
LOG_STEPS_MEASURED = 3
#: The longest interval between two log steps that do the work, in optimizer steps: it bounds how late a finite
#: divergence of a quiet run is read.
LOG_MAX_INTERVAL = 1000


@dataclass
class LogCadence:
    """How often a quiet single-process run does its log step's work: every ``every`` optimizer steps (the
    framework's log interval) until ``measured`` log steps from step ``after`` on have been timed, then, once, the
    smallest multiple of ``every`` at which that work takes at most ``fraction`` of the training time it spans.

    Pure, like :class:`SnapshotCadence`: the caller hands it each timed log step (its step, when it began and ended,
    on one clock); :meth:`observe` answers with the sentence to say, once, when the interval changes."""

    every: int
    fraction: float = LOG_FRACTION
    after: int = LOG_CADENCE_AFTER
    measured: int = LOG_STEPS_MEASURED
    max_interval: int = LOG_MAX_INTERVAL
    interval: int = field(init=False)
    decided: bool = field(default=False, init=False)
    costs: list[float] = field(default_factory=list, init=False)  # seconds per log step's work, as timed
    steps: list[float] = field(default_factory=list, init=False)  # seconds per step between two timed log steps
    _last: tuple[int, float] | None = field(default=None, init=False)  # (step, end) of the last log step seen

    def __post_init__(self) -> None:
        _check_interval_and_fraction(self.every, self.fraction)
        self.interval = self.every

    def observe(self, step: int, start_s: float, end_s: float) -> str | None:
        """The log step at optimizer step ``step`` did its work from ``start_s`` to ``end_s``. Once enough are timed
        the interval is decided (:attr:`decided`, :attr:`interval`); the sentence returned then, when the interval
        is longer than ``every``, is to be said once. Otherwise None."""
        if self.decided:
            return None
        last, self._last = self._last, (step, end_s)
        if step < self.after or last is None or step <= last[0] or start_s < last[1]:
            return None
        self.costs.append(end_s - start_s)
        self.steps.append((start_s - last[1]) / (step - last[0]))
        if len(self.costs) < self.measured:
            return None
        self.decided = True
        cost, step_s = min(self.costs), min(self.steps)  # load from elsewhere only ever adds time
        if not (cost > 0 and step_s > 0 and math.isfinite(cost) and math.isfinite(step_s)):
            return None
        longest = max(self.every, self.max_interval - self.max_interval % self.every)
        needed = cost / (self.fraction * step_s)
        self.interval = min(max(1, math.ceil(needed / self.every - 1e-9)) * self.every, longest)
        if self.interval == self.every:
            return None
        share = cost / (self.interval * step_s)
        return (f"AmpWatch's log-step work (reading the losses, the loss level, the timeline) takes {cost * 1e3:.2f} "
                f"ms against a healthy step of {step_s * 1e3:.2f} ms: while the run is quiet it is done every "
                f"{self.interval} steps instead of every {self.every} ({share:.2%} of the training time). The "
                f"ampwatch/* metrics still go out every {self.every} steps; a skipped step, an anomaly or a remedy "
                f"brings the work back to every log step.")
