"""What every step adds to the machine's running counts and histories before anything is judged: the steps, skips
and non-finite losses counted, the skip window pruned, the scaler's first scale and the largest at which a step went
through; and the same, with the growths and the LR's change points, for a run of clean steps taken in at once. Pure
functions of the machine's state; of the machine package, imports ``state``, ``vocabulary`` and ``lr_history``.
"""

from __future__ import annotations

import math
from itertools import compress
from typing import Sequence

from lightning_ampwatch.machine.lr_history import record_lr_run
from lightning_ampwatch.machine.state import MachineState
from lightning_ampwatch.machine.vocabulary import Observation, PrecisionMode, Thresholds


def count_step(s: MachineState, t: Thresholds, mode: PrecisionMode, obs: Observation) -> None:
    """One observed step counted: the steps seen, the scaler's first scale (kept for the advice), a skip in the
    window and the log, the window pruned to ``window`` steps, a non-finite loss; the first finite loss of an
    anomalous step (a skipped step leaves the weights as they were: still the fit's start), or the scale of a clean
    one (the largest at which a step went through)."""
    s.steps_seen += 1
    if s.first_scale is None:
        s.first_scale = obs.scale
    if obs.skipped:
        s.skipped_total += 1
        s.recent_skips.append(obs.step)
        s.skip_log.append(obs.step)
    while s.recent_skips and s.recent_skips[0] <= obs.step - t.window:
        s.recent_skips.popleft()
    if obs.loss_finite is False:
        s.nonfinite_total += 1
    if obs.anomalous:
        if s.start_loss is None and obs.loss is not None and math.isfinite(obs.loss) and s.losses_apart is None:
            s.start_loss = obs.loss
    elif obs.scale is not None and mode is PrecisionMode.FP16 and \
            (s.max_safe_scale is None or obs.scale > s.max_safe_scale):
        s.max_safe_scale = obs.scale


def count_clean_run(s: MachineState, t: Thresholds, mode: PrecisionMode, steps: Sequence[int],
                    scales: Sequence[float | None], grews: Sequence[bool], lrss: Sequence[tuple[float, ...]]) -> None:
    """A run of clean steps taken in at once, as columns (one entry per step, in step order; every step taken while
    the machine was quiet, with no loss read): the same state as one ``observe_clean`` per step. The counts added, the
    skip window pruned at the newest step (pruning is monotonic), the first and largest scale over the run, the growths
    in order, and the LR checked only where the run's LR tuple changes."""
    n = len(steps)
    if not n:
        return
    s.steps_seen += n
    skips = s.recent_skips
    if skips:
        limit = steps[-1] - t.window
        while skips and skips[0] <= limit:
            skips.popleft()
    if None in scales:
        scales = [v for v in scales if v is not None]
    if scales:
        if s.first_scale is None:
            s.first_scale = scales[0]
        if mode is PrecisionMode.FP16:
            top = max(scales)
            if s.max_safe_scale is None or top > s.max_safe_scale:
                s.max_safe_scale = top
    s.streak_from_start = False
    if True in grews:
        s.growths.extend(compress(steps, grews))
    record_lr_run(s, t, steps, lrss)
