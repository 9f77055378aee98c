"""The healthy reference: the loss level a run is measured against, and the climb away from it.

Pure Python (no torch, no Lightning), like the machine that owns it. :class:`HealthyReference` takes the losses the
adapter reads (one step's, or a log step's batch), keeps the candidate stretch, makes it the healthy level when it looks
healthy (:class:`Reference`), marks a climb above it (:class:`Climb`), and after a rollback finds the level the run had
where it went back to (:class:`LevelAt`). A climb that lasts is a finite divergence, an alarm of its own. Its fields
live in the machine's :class:`~lightning_ampwatch.machine.state.MachineState` (one checkpoint, one format).

It imports the machine's state and vocabulary, never the machine: it reads its owner through
:class:`ReferenceOwner`, and a climb that lasts is handed to the owner's ``on_climb``, which decides what it is (the
machine names its finding and raises it as an alarm).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from lightning_ampwatch.machine.state import Climb, MachineState, Reference, run_up_start
from lightning_ampwatch.machine.vocabulary import Thresholds
from lightning_ampwatch.taxonomy import DivergencePattern

#: Healthy losses needed before there is a loss level to compare with.
_LEVEL_MIN_LOSSES = 3
#: A stretch whose newer half has a median above this many times its older half's is climbing, not healthy; nor
#: is one whose median is this many times the healthy level before it (a slow build, under ``divergence_ratio``).
HEALTHY_RISE = 2.0
#: The healthy level is re-judged every this many candidate losses (and at the first sign of trouble): a few
#: medians of ``loss_window`` numbers, not one per step.
_PROMOTE_EVERY = 4
#: A stretch whose newer half has a median above this many times its older half's is already climbing: no healthy
#: level is taken from it. Medians of halves of a healthy stretch seldom part by half again; a run whose loss rises
#: from its first steps (a far too high LR) does, and a level made of that rise would make the climb look late.
CLIMBING_RISE = 1.5
_INF = math.inf


@dataclass(frozen=True)
class LevelAt:
    """The loss level a run had where a rollback took it back to: the median of the losses of the ``loss_window``
    steps before ``resumed_at`` (steps ``first_step``..``last_step``), or None (``why`` says why) when that stretch
    was not healthy or held no loss."""

    resumed_at: int
    level: float | None
    first_step: int
    last_step: int
    why: str | None = None
    count: int = 0  # the losses the level is the median of
    ahead: bool = False  # the losses are those the run first had on the steps it runs again (too few before them)


# ------------------------------------------------------------------------------------ the tracker


class ReferenceOwner(Protocol):
    """What the tracker reads of the machine that owns it."""

    @property
    def state(self) -> MachineState: ...

    @property
    def thresholds(self) -> Thresholds: ...

    @property
    def quiet(self) -> bool: ...


class HealthyReference:
    """The healthy-reference tracker of one :class:`~lightning_ampwatch.machine.AmpStateMachine`, which owns it and
    delegates to it. It reads and writes the owner's state (``owner.state``: ``losses``, ``loss_steps``,
    ``reference``, ``reference_before_skip``, ``climb``, ``start_loss``, ``divergence_noted``, ``rebased_why``), and
    the owner's ``quiet`` for whether anything is in progress. A climb that lasts is a finite divergence: the
    tracker hands it to ``on_climb`` at once (the machine raises it: its episode, its withdrawal of a
    ``NORMAL_SCALING`` call), and :meth:`finite_divergence` gives its onset and measurements, from which the machine
    names its finding."""

    def __init__(self, owner: ReferenceOwner, on_climb: Callable[[Climb], None]) -> None:
        self._owner = owner
        self._on_climb = on_climb
        self._since_promote = 0  # candidate losses taken since the healthy level was last judged

    @property
    def since_promote(self) -> int:
        """Candidate losses taken since the healthy level was last judged."""
        return self._since_promote

    # ---------------------------------------------------------------- losses read in batches (a log step)

    def note_losses(self, losses: Iterable[tuple[int, float]]) -> None:
        """Healthy steps' losses read after the fact (the adapter reads them in batches, at no added sync), in
        step order: they feed :attr:`loss_level` and mark a climb exactly as ``observe_clean(loss=...)`` would.
        The adapter hands them over before it observes any later anomalous step."""
        # :meth:`take_loss` for each, with its common case inline (a log step hands over ~50 at once): while nothing
        # is in progress (no climb, episode, streak, isolated skip or noted divergence), a finite loss under the climb
        # threshold only joins the candidate window, and the level is re-judged every ``_PROMOTE_EVERY`` losses. That
        # state and the threshold are read once, and again after anything that may change them (a re-judged level,
        # a loss that took the full path): the same result as one call per loss, for a few comparisons per loss.
        if not isinstance(losses, list):
            losses = list(losses)
        if self._owner.state.losses_apart is not None:  # not one series: only the non-finite ones count
            self._owner.state.nonfinite_total += sum(1 for _, loss in losses if not -_INF < loss < _INF)
            return
        taken = self.note_healthy_run(losses) if len(losses) > _PROMOTE_EVERY else 0
        s, take, promote = self._owner.state, self.take_loss, self.promote
        ratio = self._owner.thresholds.divergence_ratio
        limit: float | None = None  # the climb threshold while the inline path holds; None: read the state again
        since = self._since_promote
        for step, loss in (losses[taken:] if taken else losses):
            if limit is None:
                start = s.start_loss
                if (start is None or s.climb is not None or s.episode is not None or s.divergence_noted
                        or s.streak is not None or s.isolated_since is not None):
                    self._since_promote = since
                    take(step, loss)
                    since = self._since_promote
                    continue
                ref = s.reference
                limit = ratio * (ref.level if ref is not None else start)
                window, window_steps = s.losses, s.loss_steps
            if not -_INF < loss < _INF or loss > limit:
                self._since_promote = since
                take(step, loss)
                since = self._since_promote
                limit = None
                continue
            window.append(loss)
            window_steps.append(step)
            since += 1
            if since >= _PROMOTE_EVERY:  # quiet: read with the threshold
                promote()
                since = self._since_promote
                limit = None
        self._since_promote = since

    def note_healthy_run(self, batch: list[tuple[int, float]]) -> int:
        """The inline path of :meth:`note_losses` over whole runs of losses with C builtins: while nothing is in
        progress and every loss of the batch is finite, the losses up to the next re-judged level are taken at once
        when none of them is above the climb threshold in force (one ``max``, two ``extend``), and the level is
        re-judged exactly where the one-by-one path re-judges it. Returns how many losses it took, from the first:
        it stops before the first run that holds a loss over the threshold (the rest go one by one)."""
        s = self._owner.state
        start = s.start_loss
        if (start is None or s.climb is not None or s.episode is not None or s.divergence_noted
                or s.streak is not None or s.isolated_since is not None):
            return 0
        steps, values = zip(*batch)
        if not all(map(math.isfinite, values)):
            return 0
        ratio, promote = self._owner.thresholds.divergence_ratio, self.promote
        window, window_steps = s.losses, s.loss_steps
        n, since = len(values), self._since_promote
        ref = s.reference
        limit = ratio * (ref.level if ref is not None else start)
        taken = 0
        end = max(1, _PROMOTE_EVERY - since)  # where the level is re-judged first (after this many losses)
        while taken < n:
            end = min(end, n)
            run = values[taken:end]
            if max(run) > limit:
                break
            window.extend(run)
            window_steps.extend(steps[taken:end])
            since += end - taken
            taken = end
            if since >= _PROMOTE_EVERY:
                promote()  # as the one-by-one path: the level re-judged, and the threshold with it
                since = self._since_promote
                ref = s.reference
                limit = ratio * (ref.level if ref is not None else start)
            end = taken + _PROMOTE_EVERY
        self._since_promote = since
        return taken

    # ---------------------------------------------------------------- the level an alarm is measured against

    def reference_for(self, onset: int) -> Reference | None:
        """The healthy level from before ``onset`` (an episode's first sign), or None when no healthy stretch
        came before it: then there is nothing the episode can be measured against but what training itself shows."""
        s = self._owner.state
        # the newest level made wholly before the onset: a climb's first losses, still under the alarm's threshold
        # when they came, may have joined the newest level before the climb was seen
        for ref in (s.reference, s.reference_before_skip, s.reference_earlier):
            if ref is not None and ref.last_step < onset:
                return ref
        return None

    def reference_evidence(self, onset: int) -> dict[str, Any]:
        """``loss_reference`` (the healthy level before ``onset``, or None) and, when there is none, why."""
        ref = self.reference_for(onset)
        if ref is not None:
            return {"loss_reference": ref.level, "loss_reference_steps": [ref.first_step, ref.last_step]}
        start = self._owner.state.start_loss
        if self._owner.state.losses_apart is not None:
            return {"loss_reference": None,
                    "loss_reference_why": f"no healthy loss level: {self._owner.state.losses_apart}"}
        rebased = self._owner.state.rebased_why
        climbing = self._owner.state.climbing_why
        why = (f"no healthy loss level before step {onset}: {rebased}" if rebased is not None else
               f"no healthy loss level before step {onset}: {climbing}" if climbing is not None else
               f"no healthy loss level before step {onset}: the trouble began before a stretch of healthy steps "
               "could be seen")
        if start is not None:
            why += f"; the run's first loss was {start:.4g}"
        return {"loss_reference": None, "loss_reference_why": why, "loss_at_start": start}


    # ---------------------------------------------------------------- a rollback

    def level_before(self, recent: Iterable[tuple[int, float]], resumed_at: int) -> LevelAt:
        """The loss level the run had where a rollback takes it back to (``resumed_at``: the first step run again),
        from ``recent`` ((step, loss) pairs as read) over the ``loss_window`` steps before it, judged as a healthy
        stretch is: every loss finite, no two skipped steps in a row, its newer half not climbing over its older half,
        and not a slow build above the healthy level before it. Otherwise there is no level, and
        ``why`` says why."""
        t, s = self._owner.thresholds, self._owner.state
        if s.losses_apart is not None:
            return LevelAt(resumed_at, None, resumed_at, resumed_at, s.losses_apart)
        recent = list(recent)
        then = sorted((step, loss) for step, loss in recent if resumed_at - t.loss_window <= step < resumed_at)
        where = f"the run went back to step {resumed_at}"
        if len(then) < _LEVEL_MIN_LOSSES:  # a point is not a stretch (a rollback to the fit's start holds one loss)
            ahead = self._level_ahead(recent, resumed_at)
            if ahead is not None:
                return ahead
            if then:
                n = len(then)
                return LevelAt(resumed_at, None, then[0][0], then[-1][0], (
                    f"{where}, and only {n} loss{'' if n == 1 else 'es'} {'was' if n == 1 else 'were'} read in the "
                    f"{t.loss_window} steps before it: too few to tell a healthy stretch"))
        if not then:
            return LevelAt(resumed_at, None, resumed_at, resumed_at, (
                f"{where}, and no loss was read in the {t.loss_window} steps before it"))
        first, last = then[0][0], then[-1][0]
        span = f"steps {first}..{last}" if last > first else f"step {first}"

        def unhealthy(what: str) -> LevelAt:
            return LevelAt(resumed_at, None, first, last, f"{where}, and the losses of {span} before it {what}: not "
                                                          "a healthy stretch")

        bad = next((step for step, loss in then if not math.isfinite(loss)), None)
        if bad is not None:
            return unhealthy(f"include a non-finite one (step {bad})")
        skips = sorted(step for step in s.skip_log if resumed_at - t.loss_window <= step < resumed_at)
        streak = next((a for a, b in zip(skips, skips[1:]) if b == a + 1), None)
        if streak is not None:
            return unhealthy(f"include skipped steps in a row (from step {streak})")
        losses = [loss for _, loss in then]
        half = len(losses) // 2  # (a single loss shows no climb)
        older, newer = (statistics.median(losses[:half]), statistics.median(losses[half:])) if half else (0.0, 0.0)
        if half and newer > CLIMBING_RISE * older:
            return unhealthy(f"climb ({older:.4g} -> {newer:.4g})")
        level = statistics.median(losses)
        before = self.reference_for(first)
        if before is not None and level > HEALTHY_RISE * before.level:
            return unhealthy(f"stand at {level:.4g}, {level / before.level:.3g}x the healthy level {before.level:.4g} "
                             "before them (a slow build)")
        return LevelAt(resumed_at, level, first, last, count=len(losses))

    def _level_ahead(self, recent: list[tuple[int, float]], resumed_at: int) -> LevelAt | None:
        """Too few losses before ``resumed_at`` to judge a stretch (a rollback to the fit's start has one): the
        losses the run first had on the ``recovery_steps`` steps it now runs again, from the same state, when every
        one of them was read, finite, not skipped in a row, and before the open episode's onset. Their median is
        what a healthy run reached from that state, so the remedied run is held to it. None when they do not
        qualify (the caller then judges the few losses before, and a single loss shows no climb)."""
        t, s = self._owner.thresholds, self._owner.state
        end = resumed_at + t.recovery_steps
        if s.episode is None or s.episode.onset < end:
            return None
        ahead = sorted((step, loss) for step, loss in recent if resumed_at <= step < end)
        if [step for step, _ in ahead] != list(range(resumed_at, end)):
            return None
        if not all(math.isfinite(loss) for _, loss in ahead):
            return None
        skips = sorted(step for step in s.skip_log if resumed_at <= step < end)
        if any(b == a + 1 for a, b in zip(skips, skips[1:])):
            return None
        losses = [loss for _, loss in ahead]
        return LevelAt(resumed_at, statistics.median(losses), resumed_at, end - 1, count=len(losses), ahead=True)

    def apart(self, why: str) -> None:
        """The run's losses are not one series (``why``): each batch steps several optimizers, each on a loss of its
        own. A level made of them would be the median of two objectives, and a climb from one to the other no
        divergence: from now on there is neither (non-finite losses are still counted)."""
        s = self._owner.state
        if s.losses_apart is not None:
            return
        s.losses_apart = why
        s.reference = s.reference_before_skip = s.reference_earlier = None
        s.start_loss = s.climb = None
        s.divergence_noted = False
        s.losses.clear()
        s.loss_steps.clear()
        self._since_promote = 0

    def rebase(self, at: LevelAt) -> None:
        """The run went back to an earlier state (a rollback): its healthy level is the one it had there, if that
        stretch was healthy (:meth:`level_before`); otherwise there is none, and the evidence of a later alarm says
        why. What was climbing belongs to abandoned steps."""
        s = self._owner.state
        s.reference = None if at.level is None else Reference(at.level, at.first_step, at.last_step, at.count)
        s.rebased_why = at.why
        s.reference_before_skip = s.reference
        s.reference_earlier = None  # the levels before it belong to the abandoned steps
        s.losses.clear()
        s.loss_steps.clear()
        s.climb = None
        self._since_promote = 0

    # ---------------------------------------------------------------- one loss, and the level re-judged

    def take_loss(self, step: int, loss: float) -> None:
        """A step's finite loss: part of a climb when far above the healthy base, otherwise a candidate for the
        healthy level. A climb that goes on for ``divergence_steps`` losses is a finite divergence."""
        if not math.isfinite(loss):
            # read after the fact on a step the scaler took: its gradients were finite (an empty batch's mean, a
            # NaN the gradients do not see); counted, as every non-finite loss is
            self._owner.state.nonfinite_total += 1
            return
        s, t = self._owner.state, self._owner.thresholds
        if s.losses_apart is not None:
            return
        if s.start_loss is None:
            s.start_loss = loss
        ref = s.reference
        base = ref.level if ref is not None else s.start_loss
        ep = s.episode
        if loss > t.divergence_ratio * base and s.climb is None and self._since_promote and self._owner.quiet:
            self.promote()  # a climb may start here: measure it against the level as of the step before
            ref = s.reference
            base = ref.level if ref is not None else s.start_loss
        if base > 0 and loss > t.divergence_ratio * base:
            climb = s.climb
            if climb is None:
                climb = s.climb = Climb(step, base, loss, step, loss)
            else:
                climb.last_step, climb.last_loss, climb.steps = step, loss, climb.steps + 1
            if ep is not None:
                ep.back_run = 0
            elif climb.steps >= t.divergence_steps and not s.divergence_noted:
                self._on_climb(climb)  # the owner decides what it is, now: later losses see its episode
            return
        s.climb = None
        if s.divergence_noted and (base <= 0 or loss <= HEALTHY_RISE * base):
            s.divergence_noted = False
        if ep is not None:
            ep.back_run = ep.back_run + 1 if base <= 0 or loss <= HEALTHY_RISE * base else 0
        s.losses.append(loss)
        s.loss_steps.append(step)
        self._since_promote += 1
        if self._since_promote >= _PROMOTE_EVERY and self._owner.quiet:
            self.promote()

    def promote(self) -> None:
        """Make the candidate stretch the healthy level, if it looks healthy: enough finite losses, its newer half
        not climbing over its older half, and not a slow build above the level before it."""
        self._since_promote = 0
        s = self._owner.state
        losses = list(s.losses)  # (empty for good once the losses are apart: nothing joins them then)
        n = len(losses)
        if n < _LEVEL_MIN_LOSSES:
            return
        # statistics.median's arithmetic (the middle of the sorted values, or the mean of the two middle ones), on
        # lists made here: no per-call type checks (a log step re-judges the level about a dozen times)
        half = n // 2
        newer, older = losses[half:], losses[:half]
        newer.sort()
        older.sort()
        n_new = n - half
        mid = n_new // 2
        newer_median = newer[mid] if n_new % 2 else (newer[mid - 1] + newer[mid]) / 2
        mid = half // 2
        older_median = older[mid] if half % 2 else (older[mid - 1] + older[mid]) / 2
        if newer_median > CLIMBING_RISE * older_median:
            if s.reference is None:  # said where an alarm finds no level: the stretch was already climbing
                steps = s.loss_steps
                span = f"steps {steps[0]}..{steps[-1]}" if len(steps) == n else f"the {n} losses before it"
                s.climbing_why = (f"the losses of {span} already climbed ({older_median:.4g} -> {newer_median:.4g}), "
                                  "so no healthy level is taken from them")
            return
        losses.sort()
        level = losses[half] if n % 2 else (losses[half - 1] + losses[half]) / 2
        ref = s.reference
        if ref is not None and level > HEALTHY_RISE * ref.level:
            return
        steps = s.loss_steps  # the deque's ends: no list of it
        first, last = (steps[0], steps[-1]) if len(steps) == n else (s.steps_seen - n, s.steps_seen - 1)
        s.reference_earlier, s.reference = ref, Reference(level, first, last, n)
        s.climbing_why = None

    # ---------------------------------------------------------------- a climb that lasts

    def finite_divergence(self, climb: Climb) -> tuple[int, dict[str, Any]]:
        """A loss far above the healthy base for ``divergence_steps`` losses in a row, every one finite (the
        optimisation diverges; no skip or NaN needed): what the tracker found, as its onset (the climb's start, or the
        skip just before it) and its measurements (the evidence, without the run's precision, which the owner puts
        first). The owner decides what it is: its finding (an LR event before the onset makes it the schedule's), and
        an alarm with an episode or a noted one under DDP."""
        s, t = self._owner.state, self._owner.thresholds
        onset, at_onset, rise = climb.start_step, climb.start_loss, ""
        if self.reference_for(onset) is None:
            # no healthy level: the climb is measured from the run's first loss, and began where the loss last stood
            # at or under it (the losses since, under the climb threshold, were its first rise)
            before = [(st, v) for st, v in zip(s.loss_steps, s.losses) if st < onset]
            if len(before) == len(s.losses):
                low = next((i for i in range(len(before) - 1, -1, -1) if before[i][1] <= climb.level), None)
                if low is not None and low + 1 < len(before):
                    onset, at_onset = before[low + 1]
                    rise = (f"rising from the run's first loss since step {onset} ({at_onset:.3g} there), and ")
        # skips just before the climb were its first sign (the run's start-up skips never are)
        onset = run_up_start(s.recent_skips, onset, 2 * t.streak, s.startup_until)
        ref = self.reference_for(onset)
        base_from = "the healthy level" if ref is not None else "the run's first loss"
        ev: dict[str, Any] = {
            "pattern": DivergencePattern.FINITE_DIVERGENCE, "loss": climb.last_loss,
            **self.reference_evidence(onset), "loss_at_onset": at_onset, "diverged_first": True,
            "climb_base": climb.level, "climb_base_from": base_from, "climb_steps": climb.steps,
            "divergence": f"loss {climb.level:.3g} -> {climb.last_loss:.3g} over steps {climb.start_step}.."
                          f"{climb.last_step}, {climb.steps} losses in a row above {t.divergence_ratio:g}x "
                          f"{base_from}, none of them NaN or inf" if not rise else
                          f"loss {climb.level:.3g} -> {climb.last_loss:.3g} over steps {onset}..{climb.last_step}, "
                          f"{rise}{climb.steps} losses in a row above {t.divergence_ratio:g}x it from step "
                          f"{climb.start_step}, none of them NaN or inf",
            "skipped_steps": s.skipped_total, "steps": s.steps_seen,
        }
        return onset, ev

    def climb_evidence(self, climb: Climb, first_sign: int) -> dict[str, Any]:
        """What a climb adds to the evidence of an alarm it is part of (it came before ``first_sign`` or after)."""
        first = climb.start_step < first_sign
        when = "before any overflow" if first else f"after the first skip at step {first_sign}"
        return {
            "loss_level": climb.level, "loss_at_onset": climb.start_loss, "diverged_first": first,
            "divergence": f"loss {climb.level:.3g} -> {climb.last_loss:.3g} over steps "
                          f"{climb.start_step}..{climb.last_step} {when}",
        }
