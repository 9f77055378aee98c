"""DeepSpeed's own state, as AmpWatch reads it: its fp16 loss scaler.

Under DeepSpeed the loss scale is not a ``torch.amp.GradScaler``: the engine's ZeRO (or fp16) optimizer keeps a
``DynamicLossScaler`` (or a static ``LossScaler``) of its own, scales the loss inside ``engine.backward``, decides in
``engine.step`` whether the gradients overflowed (agreed across the data-parallel ranks: DeepSpeed all-reduces the
flag and reads it to the host itself), skips the step and counts it in ``engine.skipped_steps``. Every value it keeps
is therefore a plain host-side Python number after the step: reading them costs AmpWatch no host-device
synchronisation at all. The engine's attributes are read through :mod:`~lightning_ampwatch.compat`.

Nothing here imports DeepSpeed or Lightning: the objects are handed in.
"""

from __future__ import annotations

from typing import Any

from lightning_ampwatch import compat

#: How the evidence names DeepSpeed's loss scaler (the advice then speaks of DeepSpeed's settings, not GradScaler's).
LOSS_SCALER = "deepspeed"


class DeepSpeedLossScale:
    """A read-only view of a DeepSpeed engine's fp16 loss scaler: the scale, whether the latest step overflowed and
    how many steps the engine skipped, as the engine itself keeps them on the host.

    It maps onto what AmpWatch reads from a GradScaler: a skipped step is one the engine counted in
    ``skipped_steps``; the scale is the scaler's ``cur_scale``; the growth settings are its ``scale_factor``
    (growth, and 1/factor as the backoff) and ``scale_window`` (the growth interval). DeepSpeed's hysteresis (a
    number of overflows the scale survives before it is halved) has no GradScaler counterpart: the scale is read,
    never predicted, so a skip that did not halve the scale is reported as it was."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @classmethod
    def of(cls, engine: Any) -> "DeepSpeedLossScale | None":
        """The view for ``engine`` when it trains in fp16 with a loss scaler AmpWatch can read, else None."""
        if engine is None or not is_engine(engine):
            return None
        if not compat.deepspeed_fp16(engine) or compat.deepspeed_loss_scaler(engine) is None:
            return None
        return cls(engine)

    def scale(self) -> float:
        """The current loss scale (after the latest step's update)."""
        return float(compat.deepspeed_loss_scale(self.engine))

    def skipped_steps(self) -> int:
        """The steps the engine has skipped on an overflow since it began (its own count, checkpointed with it)."""
        return int(compat.deepspeed_skipped_steps(self.engine))

    def overflow(self) -> bool:
        """Whether the latest optimizer step found an overflow (and was skipped)."""
        return bool(compat.deepspeed_overflow(self.engine))

    @property
    def dynamic(self) -> bool:
        return bool(getattr(compat.deepspeed_loss_scaler(self.engine), "dynamic", False))

    def config(self) -> dict[str, Any]:
        """The scaler's growth settings in GradScaler's terms (for the machine and the mirror). A static scale
        never grows nor backs off: factors of 1 and no growth interval to speak of."""
        scaler = compat.deepspeed_loss_scaler(self.engine)
        if not self.dynamic:
            return {"growth_factor": 1.0, "backoff_factor": 1.0, "growth_interval": 2**31 - 1,
                    "loss_scaler": LOSS_SCALER}
        factor = float(getattr(scaler, "scale_factor", 2.0))
        return {"growth_factor": factor, "backoff_factor": 1.0 / factor,
                "growth_interval": int(getattr(scaler, "scale_window", 1000)), "loss_scaler": LOSS_SCALER}


def is_engine(module: Any) -> bool:
    """Whether ``module`` is a DeepSpeed engine (or a subclass: the pipeline engine)."""
    return any(c.__name__ == "DeepSpeedEngine" for c in type(module).__mro__)


def half_module_dtype(root: Any) -> Any:
    """The half-precision dtype a DeepSpeed engine keeps its module's trainable parameters in (fp16 and bf16
    engines cast the module; the float32 master weights live in the engine's optimizer), or None. Under it a
    replay "without autocast" still computes in half precision: it would be no FP32 control."""
    if not is_engine(root):
        return None
    import torch

    for p in root.parameters():
        if p.requires_grad:
            return p.dtype if p.dtype in (torch.float16, torch.bfloat16) else None
    return None
