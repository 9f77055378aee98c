"""The gradient-overflow patterns, read from the skip history: the anomalous streak and the skips that led up to it,
the growths the scaler's skips followed, the skips over the window. Pure functions of the machine's state and the step
at hand: each returns what it found (an :class:`Overflow`: the finding, its onset, its measurements), and the machine
decides what it makes of it (an alarm, or an LR event or the input range before it). Pure Python; of the machine
package, imports ``state`` and ``vocabulary`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lightning_ampwatch.machine.state import MachineState, Streak, run_up_start
from lightning_ampwatch.machine.vocabulary import Observation, Thresholds
from lightning_ampwatch.taxonomy import Finding, GradientPattern


@dataclass(frozen=True)
class Overflow:
    """A pattern of skips: its finding, the step it began at, and its measurements (the evidence entries, in the order
    they are published)."""

    finding: Finding
    onset: int
    entries: dict[str, Any]


def extend_streak(s: MachineState, t: Thresholds, obs: Observation) -> None:
    """An anomalous step joins the skip history: the growth it came right after (a skip within ``growth_lag`` steps of
    a growth), and the streak of anomalous steps in a row."""
    if obs.skipped and s.growths and obs.step - s.growths[-1] <= t.growth_lag:
        if not s.growth_skips or s.growth_skips[-1] != s.growths[-1]:
            s.growth_skips.append(s.growths[-1])
    streak = s.streak
    if streak is None:
        streak = s.streak = Streak(obs.step, obs.scale)
    streak.count += 1
    streak.scales.append(obs.scale)
    if obs.data_nonfinite:
        streak.data += 1  # (a loss its own NaN batch made non-finite says nothing of the scale)
    elif obs.loss_finite is False:
        streak.all_loss_finite = False


def first_sign(s: MachineState, t: Thresholds, step: int) -> int:
    """Where the trouble now at ``step`` first showed: the start of the anomalous streak, or earlier, the first skip of
    the cluster of skips (each within ``2 * streak`` steps of the next) that led up to it, the run's start-up skips
    left out (the scaler lowering its first scale until a step goes through is no sign of what comes later)."""
    start = s.streak.first_step if s.streak is not None else step
    return run_up_start(s.recent_skips, start, 2 * t.streak, s.startup_until)


def skip_counts(s: MachineState, in_row: int) -> dict[str, Any]:
    """The counts every overflow's evidence begins with: the skips in a row and in the run, and the scaler's first
    scale."""
    entries: dict[str, Any] = {"skipped_in_row": in_row, "skipped_steps": s.skipped_total, "steps": s.steps_seen}
    if s.first_scale is not None:
        entries["init_scale"] = s.first_scale
    return entries


def scaler_entries(scaler_config: Mapping[str, Any]) -> dict[str, Any]:
    """The scaler's own settings, as the growth overflow's advice quotes them."""
    keys = ("growth_interval", "growth_factor", "backoff_factor")
    return {k: scaler_config[k] for k in keys if k in scaler_config}


def unscaled_overflow(scale: float | None, t: Thresholds, first_or_again: bool, onset: int,
                      scales: list[float | None]) -> Overflow | None:
    """A skip at a scale under ``floor_scale``, the first of a run or one skip more: the gradients overflow float16
    unscaled, whatever the scale does."""
    if scale is not None and scale < t.floor_scale and first_or_again:
        return Overflow(Finding.GRADIENT_OVERFLOW, onset,
                        {"pattern": GradientPattern.UNSCALED_OVERFLOW, "scale_history": scales})
    return None


def skip_pattern(s: MachineState, t: Thresholds, step: int, scale: float | None, safe_scale: float | None,
                 scales: list[float | None], *, early_startup: bool,
                 scaler_config: Mapping[str, Any]) -> Overflow | None:
    """The patterns of skips (start-up, growth, burst, collapse, persistent) the skip at ``step`` (at ``scale``) forms,
    if any; ``safe_scale`` the largest scale known to hold, ``scales`` the scales the evidence shows."""
    streak = s.streak
    assert streak is not None  # the current step is in it
    if s.streak_from_start:
        if early_startup and streak.count - streak.data >= t.startup_streak and streak.all_loss_finite:
            return Overflow(Finding.GRADIENT_OVERFLOW, streak.first_step,
                            {"pattern": GradientPattern.STARTUP, "scale_history": scales})
        return None  # wait: the streak is judged when it ends and the safe scale is known
    if len(s.growth_skips) >= t.growth_repeats:
        span = max(1, step - s.growth_skips[0] + 1)
        skips_in_span = sum(1 for skip in s.recent_skips if skip >= s.growth_skips[0])
        rate = max(skips_in_span, t.growth_repeats) / span
        if rate >= t.growth_skip_rate:
            return Overflow(Finding.GROWTH_OVERFLOW, s.growth_skips[0] + 1, {
                "pattern": GradientPattern.GROWTH_OVERFLOW, "growth_steps": list(s.growth_skips), "span": span,
                "skip_rate": round(rate, 4),
                "safe_scale": scale * scaler_config.get("backoff_factor", 0.5) if scale else None,
                **scaler_entries(scaler_config)})
    burst = [skip for skip in s.recent_skips if skip > step - 2 * t.streak]
    if len(burst) >= t.streak:
        pattern = GradientPattern.COLLAPSE if streak.count >= t.streak else GradientPattern.BURST
        return Overflow(Finding.GRADIENT_OVERFLOW, burst[0], {
            "pattern": pattern, "scale_history": scales, "safe_scale": safe_scale, "onset_scale": streak.first_scale})
    window_steps = min(t.window, s.steps_seen)
    if window_steps >= t.window // 2 and len(s.recent_skips) >= max(3, t.window_skip_rate * window_steps):
        return Overflow(Finding.GRADIENT_OVERFLOW, s.recent_skips[0], {
            "pattern": GradientPattern.PERSISTENT, "skip_rate": round(len(s.recent_skips) / window_steps, 4),
            "window": window_steps, "safe_scale": safe_scale})
    return None


def startup_overflow(streak: Streak, safe_scale: float | None, t: Thresholds) -> Overflow:
    """A streak of skips from the run's first step, ended by a step that went through at ``safe_scale``: the scaler's
    first scale was too high (or, under ``floor_scale``, the gradients overflow unscaled)."""
    below_floor = safe_scale is not None and safe_scale < t.floor_scale
    return Overflow(Finding.GRADIENT_OVERFLOW, streak.first_step, {
        "pattern": GradientPattern.UNSCALED_OVERFLOW if below_floor else GradientPattern.STARTUP,
        "skipped_in_row": streak.count, "init_scale": streak.first_scale, "safe_scale": safe_scale,
        "scale_history": list(streak.scales)})
