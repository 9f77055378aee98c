"""The loss scale as the host mirrors it: one read of the scaler at train start (and after a remedy changed it), then
followed step by step on the host (the scaler's skips as the step hook reports them, its growth by its interval), and
reconciled with the real values at each log step's one read."""

from __future__ import annotations

from typing import Any

from lightning_ampwatch import compat
from lightning_ampwatch.signals import PrecisionInfo, ScaleMirror, StepTaken, read_scale, scaler_config


class _Unscaled:
    """The tape's scale when the loss handed to backward is not scaled (no GradScaler; DeepSpeed scales inside its
    engine): read like a mirror's, so ``StepLedger.backward`` does not branch on it."""

    __slots__ = ()
    scale = 1.0


UNSCALED = _Unscaled()


class ScaleTracking:
    """The scaler's host mirror, and what tells a step the scaler ran from one it did not (its per-optimizer table;
    DeepSpeed's skipped-step count)."""

    def __init__(self) -> None:
        self.mirror: ScaleMirror | None = None  # made at train start, once the framework has restored the scaler
        self.tape_mirror: ScaleMirror | _Unscaled = UNSCALED  # whose scale the losses handed to backward carry
        self.skipped_seen = 0  # DeepSpeed: its engine's skipped-step count when the last step was taken in
        # A GradScaler's per-optimizer table when the last step was taken in: its update() makes a new one after every
        # step it runs, skipped or not; the same table means the framework ran no scaler step (see StepLedger.close)
        self.states_seen: Any = None
        self.table_scaler: Any = None  # the GradScaler whose per-optimizer table is read (one C call), when it has one
        self.loss_scale: Any = None  # DeepSpeed: its loss scaler's view (precision.loss_scale), once mirrored
        self.engine: Any = None  # DeepSpeed: its engine, asked whether its coming step() is an optimizer step
        self.config: dict[str, Any] = {}  # the scaler's growth settings, as last mirrored

    def read(self, precision: PrecisionInfo) -> None:
        """Read the scaler once (scale, tracker, growth settings) into the host mirror (``config``: the growth
        settings, for the machine)."""
        scaler, loss_scale = precision.scaler, precision.loss_scale
        if scaler is not None:
            config = scaler_config(scaler)
            scale, tracker = read_scale(scaler)
            self.mirror = ScaleMirror(scale, tracker=tracker, **config)
            self.config = config
            self.states_seen = compat.per_optimizer_states(scaler)
        elif loss_scale is not None:  # DeepSpeed: host values, read again after every step (see StepLedger.close)
            config = loss_scale.config()
            self.mirror = ScaleMirror(loss_scale.scale(), **{k: v for k, v in config.items() if k != "loss_scaler"})
            self.config = config
            self.skipped_seen = loss_scale.skipped_steps()
        else:
            self.mirror = None
            self.config = {}
        # the loss handed to backward carries the GradScaler's scale; DeepSpeed scales inside its engine's backward
        self.tape_mirror = self.mirror if scaler is not None and self.mirror is not None else UNSCALED
        self.loss_scale = loss_scale if self.mirror is not None else None
        self.table_scaler = scaler if scaler is not None and self.states_seen is not None else None
        self.engine = precision.engine

    def mirrored_scale(self) -> float:
        """The scale as the host mirrors it now, without a device read (1.0 without a scaler): what the recipe guards
        read when they find a mistake."""
        mirror = self.mirror
        return mirror.scale if mirror is not None else 1.0

    def held(self, scaler: Any) -> bool:
        """Whether the scaler's last update kept (or grew) its scale: it ran the step. One read, only after the
        optimizers changed under the step hook."""
        scale_t = compat.scale_tensor(scaler)
        mirror = self.mirror
        if scale_t is None or mirror is None:
            return False
        return float(scale_t) >= mirror.scale

    def last_step_skipped(self, precision: PrecisionInfo, taken: StepTaken) -> bool:
        """Whether the optimizer step that just ran was skipped by the scaler (for ``hold_lr_on_skip``)."""
        if precision.scaler is None and precision.loss_scale is None:
            return False
        if precision.loss_scale is not None:  # DeepSpeed's flag for its latest step (a host value)
            return precision.loss_scale.overflow()
        if taken.found_inf is not None:
            return bool(taken.found_inf.item())  # fused optimizer: the user asked for this read
        return not taken.taken
