"""Several optimizers through one scaler (a GAN's generator and discriminator share Lightning's one GradScaler): each
one's own row of skips and its own safe scale, since another optimizer's clean step says nothing of this one's
gradients. :class:`OptimizerRows` keeps them (``MachineState.optimizers``, by the optimizer's index) and returns what
they show (an :class:`~lightning_ampwatch.machine.overflow.Overflow`); the machine decides whether it is an alarm.
Pure Python; of the machine package, imports ``state``, ``vocabulary`` and ``overflow``.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

from lightning_ampwatch.machine.overflow import Overflow, skip_counts, skip_pattern, unscaled_overflow
from lightning_ampwatch.machine.state import SCALE_HISTORY, MachineView, OptimizerSteps
from lightning_ampwatch.machine.vocabulary import Observation, PrecisionMode
from lightning_ampwatch.taxonomy import Finding, GradientPattern, format_pow2


class RowsOwner(MachineView, Protocol):
    """What the rows read of the machine that owns them."""

    @property
    def early_startup(self) -> bool: ...

    @property
    def scaler_config(self) -> Mapping[str, Any]: ...

    @property
    def optimizer_names(self) -> tuple[str, ...]: ...


class OptimizerRows:
    """Each optimizer's own steps, skips in a row and safe scale, where several step through one scaler: its skips
    make its own patterns (:meth:`pattern`), its start-up row is judged when it first steps (:meth:`stepped`), and the
    run's safe scale is the largest at which every one of them stepped (:attr:`safe_scale`)."""

    def __init__(self, owner: RowsOwner) -> None:
        self._owner = owner

    def _row_of(self, index: int) -> OptimizerSteps:
        records = self._owner.state.optimizers
        record = records.get(str(index))
        if record is None:
            record = records[str(index)] = OptimizerSteps()
        return record

    @property
    def safe_scale(self) -> float | None:
        """The largest scale at which every optimizer stepped (None until each one has)."""
        scales = [r.safe_scale for r in self._owner.state.optimizers.values()]
        return None if None in scales else min(scales)  # type: ignore[type-var]

    def skipped(self, obs: Observation, index: int) -> None:
        """Optimizer ``index``'s step was skipped: its own row of skips grows."""
        record = self._row_of(index)
        record.skipped += 1
        if not record.skips_in_row:
            record.first_skip, record.scales, record.all_loss_finite = obs.step, [], True
        record.skips_in_row += 1
        record.scales.append(obs.scale)
        del record.scales[:-SCALE_HISTORY]
        if obs.loss_finite is False and not obs.data_nonfinite:
            record.all_loss_finite = False

    def stepped(self, obs: Observation, index: int) -> Overflow | None:
        """Optimizer ``index``'s step went through: its safe scale, and the end of its row of skips. Returns the row
        it ends when that row began with its first step and lasted ``startup_streak`` skips: a start-up overflow of
        this optimizer, the scale it now stepped at its measured safe scale (as for one optimizer, judged when the row
        ends). The machine decides whether it raises it."""
        t, s = self._owner.thresholds, self._owner.state
        record = self._row_of(index)
        found = None
        if not record.stepped and record.skips_in_row >= t.startup_streak and record.all_loss_finite:
            below_floor = obs.scale is not None and obs.scale < t.floor_scale
            assert record.first_skip is not None
            found = Overflow(Finding.GRADIENT_OVERFLOW, record.first_skip, {
                "pattern": GradientPattern.UNSCALED_OVERFLOW if below_floor else GradientPattern.STARTUP,
                "skipped_in_row": record.skips_in_row, "init_scale": s.first_scale, "safe_scale": obs.scale,
                "safe_scale_from": f"the scale optimizer {index} first stepped at without a skip (step {obs.step})",
                "scale_history": list(record.scales), **self.evidence(index, record)})
        record.stepped += 1
        record.last_step = obs.step
        record.skips_in_row = 0
        if obs.scale is not None and self._owner.mode is PrecisionMode.FP16 and \
                (record.safe_scale is None or obs.scale > record.safe_scale):
            record.safe_scale = obs.scale
        return found

    def pattern(self, obs: Observation, index: int) -> Overflow | None:
        """The overflow pattern a skip of optimizer ``index`` forms, if any: its own row of skips and its own safe scale
        decide, and the evidence names it."""
        owner = self._owner
        t, s = owner.thresholds, owner.state
        record = self._row_of(index)
        head = {**skip_counts(s, record.skips_in_row), **self.evidence(index, record)}
        assert record.first_skip is not None  # the skip at hand is in its row
        found = unscaled_overflow(obs.scale, t, not record.stepped or record.skips_in_row >= 2, record.first_skip,
                                  list(record.scales))
        if found is None and record.stepped:
            found = skip_pattern(s, t, obs.step, obs.scale, record.safe_scale, list(record.scales),
                                 early_startup=owner.early_startup, scaler_config=owner.scaler_config)
        # not record.stepped: every one of its steps skipped so far (while another optimizer's went through): its
        # start-up row, judged when it first steps and its safe scale is known (:meth:`stepped`). Not at once, even
        # where a remedy could lower the scale (``early_startup``): no replay measures the scale that holds here
        # (several optimizers step only in manual optimization, whose training_step is not replayed), and the scaler
        # halves its way down to it on this optimizer's skips anyway
        return None if found is None else Overflow(found.finding, found.onset, {**head, **found.entries})

    def evidence(self, index: int, record: OptimizerSteps) -> dict[str, Any]:
        """``optimizer`` (its index) and a line that says what its steps and the others' did."""
        names = self._owner.optimizer_names

        def name(i: int) -> str:
            return f"optimizer {i}" + (f" ({names[i]})" if 0 <= i < len(names) else "")

        n = record.skips_in_row
        line = f"{name(index)} skipped {'its first ' if not record.stepped else ''}{n} step{'s' if n != 1 else ''}"
        if record.stepped:
            line += " in a row"
        scales = [v for v in record.scales if v is not None]
        if scales:
            top, low = max(scales), min(scales)
            line += f", at {format_pow2(top)}" if top == low else \
                f", at every scale from {format_pow2(top)} down to {format_pow2(low)}"
        since = record.first_skip if record.first_skip is not None else 0
        others = sorted((int(k) for k, r in self._owner.state.optimizers.items()
                         if k != str(index) and r.last_step is not None and r.last_step >= since))
        if others:
            line += ", while " + " and ".join(name(i) for i in others) + " stepped"
        if record.safe_scale is not None:
            line += f"; the largest scale it stepped at is {format_pow2(record.safe_scale)}"
        return {"optimizer": index, "optimizer_skips": line}

    def end_rows(self) -> None:
        """An episode closed by a remedy: no optimizer's row of skips runs on into the next one."""
        for record in self._owner.state.optimizers.values():
            record.skips_in_row = 0
