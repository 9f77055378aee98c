"""The episode: what an alarm opens and what closes it, and the ``NORMAL_SCALING`` call made where no alarm came.
:class:`EpisodeTracker` keeps them in the machine's state (``episode``, ``closed_episodes``, ``isolated_since``,
``normal_call``) and returns what a transition gives back (the call an alarm withdraws, the call made); the machine
decides when each happens, and makes the diagnoses. Pure Python; of the machine package, imports ``state`` and
``vocabulary`` only.
"""

from __future__ import annotations

from lightning_ampwatch.machine.state import Episode, MachineView, NormalCall
from lightning_ampwatch.machine.vocabulary import Observation, PrecisionMode
from lightning_ampwatch.taxonomy import Finding

#: Findings whose episode is a divergence of the loss: it lasts until the loss is back, whatever the skips do.
DIVERGENCE_FINDINGS = frozenset({Finding.FP32_UNSTABLE, Finding.LR_SCHEDULE})


#: What the episode tracker reads of the machine that owns it.
EpisodeOwner = MachineView


class EpisodeTracker:
    """An open alarm's episode and its ends: raised once (:meth:`open`), over when training has been clean for a while
    (:meth:`clean_step`) or when a remedy was applied (:meth:`close`); and the one ``NORMAL_SCALING`` call of a run
    (:meth:`normal_call`), withdrawn by an alarm its skip turns out to have begun."""

    def __init__(self, owner: EpisodeOwner) -> None:
        self._owner = owner

    def judged_apart(self, obs: Observation | None) -> bool:
        """An anomaly (``obs``; None: the end of a streak) is judged as if no episode were open: none is, or, under a
        GradScaler, the open one is a data episode (a NaN batch, skipped: the weights stay clean), which does not hide
        a fault of its own kind in the steps around it (such as a start-up gradient overflow) whose own batch is
        clean."""
        episode = self._owner.state.episode
        return episode is None or (episode.finding is Finding.DATA_NONFINITE and self._owner.mode is PrecisionMode.FP16
                                   and (obs is None or not obs.data_nonfinite))

    def open(self, finding: Finding, onset: int) -> NormalCall | None:
        """An alarm opens its episode: the skips that made it must not make the next one. Returns the
        ``NORMAL_SCALING`` call it withdraws (one whose skip turns out to have begun it: within ``window`` steps of its
        onset), or None."""
        s = self._owner.state
        s.episode = Episode(finding, onset)
        s.recent_skips.clear()
        s.isolated_since = None
        s.climb = None
        call, s.normal_call = s.normal_call, None
        window = self._owner.thresholds.window
        return call if call is not None and finding is not Finding.DATA_NONFINITE and onset - call.step <= window \
            else None

    def clean_step(self, episode: Episode, step: int) -> None:
        """A clean step of the open episode (after the step that opened it): it ends after ``recovery_steps`` clean
        steps in a row, a growth overflow only once ``growth_repeats`` growths survive (otherwise it would reopen every
        growth interval), and a divergence only once its loss is back too, skips or not (alarms meanwhile are part of
        it)."""
        t, s = self._owner.thresholds, self._owner.state
        episode.clean_run += 1
        if episode.finding is Finding.GROWTH_OVERFLOW:
            last = s.growths[-1] if s.growths else None
            if last is not None and step - last == t.growth_lag + 1 and \
                    (not s.growth_skips or s.growth_skips[-1] != last):
                episode.growth_survived += 1
            done = episode.growth_survived >= t.growth_repeats
        else:
            done = episode.clean_run >= t.recovery_steps
        if episode.finding in DIVERGENCE_FINDINGS and episode.back_run < t.recovery_steps:
            done = False
        if done:
            s.closed_episodes.append({"finding": episode.finding.value, "onset": episode.onset, "end": step})
            s.episode = None
            s.growth_skips.clear()

    def close(self, step: int, reason: str) -> None:
        """A remedy was applied: the episode is over, so a recurrence is a new episode (and escalates); the skips and
        the climb that led to it are over with it."""
        s = self._owner.state
        if s.episode is not None:
            s.closed_episodes.append({"finding": s.episode.finding.value, "onset": s.episode.onset,
                                      "end": int(step), "reason": reason})
            s.episode = None
        s.streak = None
        s.climb = None
        s.recent_skips.clear()
        s.growth_skips.clear()

    def normal_call(self, step: int, scale: float | None) -> NormalCall | None:
        """An isolated skip, then a clean stretch of ``recovery_steps`` steps at ``step``: the scaler found its level
        again by itself. Returns the ``NORMAL_SCALING`` call, made at most once per run and kept, so that an alarm that
        follows it closely can withdraw it; None where it is not due."""
        t, s = self._owner.thresholds, self._owner.state
        since, skips = s.isolated_since, s.recent_skips
        if since is None or s.episode is not None or s.normal_reported or \
                (skips and skips[-1] > step - t.recovery_steps):
            return None
        s.normal_reported = True
        s.normal_call = NormalCall(since, {"skipped_steps": s.skipped_total, "steps": s.steps_seen, "scale": scale})
        s.isolated_since = None
        return s.normal_call
