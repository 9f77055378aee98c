"""DeepSpeed's own state, as AmpWatch reads it: its fp16 loss scaler, and a ZeRO-1/2 engine's partitioned state for
the snapshots.

Under DeepSpeed the loss scale is not a ``torch.amp.GradScaler``: the engine's ZeRO (or fp16) optimizer keeps a
``DynamicLossScaler`` (or a static ``LossScaler``) of its own, scales the loss inside ``engine.backward``, decides in
``engine.step`` whether the gradients overflowed (agreed across the data-parallel ranks: DeepSpeed all-reduces the
flag and reads it to the host itself), skips the step and counts it in ``engine.skipped_steps``. Every value it keeps
is therefore a plain host-side Python number after the step: reading them costs AmpWatch no host-device
synchronisation at all. The engine's attributes are read through :mod:`~lightning_ampwatch.compat`.

Nothing here imports DeepSpeed or Lightning: the objects are handed in.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Iterator

from lightning_ampwatch import compat
from lightning_ampwatch.errors import RemedyError

#: How the evidence names DeepSpeed's loss scaler (the advice then speaks of DeepSpeed's settings, not GradScaler's).
LOSS_SCALER = "deepspeed"


class DeepSpeedLossScale:
    """A view of a DeepSpeed engine's fp16 loss scaler: the scale, whether the latest step overflowed and how many
    steps the engine skipped, as the engine itself keeps them on the host (and, for the scaler remedies, the
    setters GradScaler has).

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

    # GradScaler's names for what the scaler remedies (``lower_init_scale``, ``slow_growth``) read and set: they
    # act on DeepSpeed's scaler through these. A static loss scale is not changed (it is the user's choice).

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self.scale()

    def get_growth_factor(self) -> float:
        return float(self.config()["growth_factor"])

    def get_backoff_factor(self) -> float:
        return float(self.config()["backoff_factor"])

    def get_growth_interval(self) -> int:
        return int(self.config()["growth_interval"])

    def _dynamic_only(self) -> None:
        if not self.dynamic:
            raise RemedyError("DeepSpeed's loss scale is static in this run (\"loss_scale\" > 0 in its config)")

    def update(self, new_scale: float) -> None:
        """Set the scale (GradScaler's ``update(new_scale=...)``); the clean-step count towards growth restarts."""
        self._dynamic_only()
        compat.deepspeed_set_loss_scale(self.engine, new_scale)

    def set_growth_interval(self, interval: int) -> None:
        self._dynamic_only()
        compat.deepspeed_set_scale_window(self.engine, interval)

    def set_growth_factor(self, factor: float) -> None:
        """DeepSpeed has one factor for growth and backoff: a smaller one also backs off by less."""
        self._dynamic_only()
        compat.deepspeed_set_scale_factor(self.engine, factor)

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


def under_deepspeed(trainer: Any) -> bool:
    """Whether ``trainer`` (a Lightning Trainer, or a Fabric) trains through a DeepSpeed engine."""
    return is_engine(getattr(getattr(trainer, "strategy", None), "model", None))


#: Why each remedy that works through autocast or Lightning's precision plugin does not apply under DeepSpeed.
NOT_UNDER_DEEPSPEED = {
    "bf16_fallback": ("under DeepSpeed the precision is its engine's (the \"fp16\" or \"bf16\" section of its "
                      "config, the module cast to it at start), so it cannot be switched mid-run"),
    "fp32_island": ("under DeepSpeed the module's weights are themselves half precision and there is no autocast "
                    "to turn off, so a float32 island would not compute in float32"),
    "unscale_before_clip": ("DeepSpeed unscales the gradients before it clips them (its \"gradient_clipping\"), so "
                            "there is nothing to switch"),
}


def refuse(trainer: Any, remedy: str) -> None:
    """Raise the remedy's ``RemedyError`` when ``trainer`` runs under DeepSpeed, where it cannot act."""
    if under_deepspeed(trainer):
        raise RemedyError(NOT_UNDER_DEEPSPEED[remedy])


def batch_replay_unavailable(root: Any) -> str | None:
    """Why the faulty batch cannot be replayed (forward and a gradient probe) under this DeepSpeed engine, or None.
    ZeRO stage 3 partitions the parameters themselves: its forward gathers them and its tensor hooks partition each
    gradient as it is computed, also in a replay's backward, into the buckets of the live step, which then fails.
    (ZeRO 1 and 2 reduce a gradient once it is accumulated, which a replay's ``torch.autograd.grad`` never does.)"""
    if is_engine(root) and any(hasattr(p, "ds_id") for p in root.parameters()):
        return ("not run: under DeepSpeed ZeRO stage 3 a replay's backward would run the engine's gradient "
                "partitioning hooks into the live step's buckets")
    return None


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


# --------------------------------------------------------------------------------------------
# Snapshots of a ZeRO stage 1/2 engine's partitioned state
# --------------------------------------------------------------------------------------------
#
# A ZeRO-1/2 engine (``DeepSpeedZeroOptimizer``) keeps, on each rank, this rank's partition of the float32 master
# weights as one flat tensor per parameter group (``single_partition_of_fp32_groups``), and its inner (torch)
# optimizer's state keyed by those flat tensors. The module's half-precision weights are derived from them: after
# each step the engine copies its fp32 partition into its bit16 partition and all-gathers the bit16 partitions
# (``update_lp_params`` does exactly that, as DeepSpeed's own checkpoint loading uses it). So a snapshot is the
# fp32 partitions, the inner optimizer's state over them and the module's buffers: each rank copies its 1/N share;
# a restore copies them back in place (the same tensors: the inner optimizer keys its state by them) and then runs
# ``update_lp_params`` on every rank together, which makes the module's weights whole and equal on every rank.
# Under fp16 the engine's loss scaler (plain numbers) is part of it.

#: Why the trajectory replays do not run under DeepSpeed, while its snapshots and rollbacks do.
REPLAY_UNAVAILABLE = ("the trajectory replay is not available under DeepSpeed: a replayed step would have to run "
                      "through its engine's backward and step (gradient partitioning, its loss scaler), which AmpWatch "
                      "does not drive, and its module computes in half precision, so no replay would be FP32; its "
                      "snapshots are taken and rolled back to")
#: The loss scaler's fields a snapshot keeps (host numbers; DynamicLossScaler's, and a static LossScaler's scale).
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
#: Names of the entries in the state a snapshot reads (see :func:`live_state`).
FP32_PARTITION = "deepspeed.fp32_partition.{}"
LOSS_SCALER_ENTRY = "deepspeed.loss_scaler"


def zero_optimizer(engine: Any) -> Any:
    """The engine's ZeRO stage 1/2 optimizer, or None."""
    optimizer = getattr(engine, "optimizer", None)
    return optimizer if type(optimizer).__name__ == "DeepSpeedZeroOptimizer" else None


def unsupported_reason(engine: Any) -> str | None:
    """Why the snapshots cannot be taken and restored in place for this DeepSpeed engine, or None."""
    optimizer = getattr(engine, "optimizer", None)
    kind = type(optimizer).__name__
    if zero_optimizer(engine) is None:
        return (f"the trajectory control is not available under this DeepSpeed engine: its optimizer "
                f"({kind}) is not ZeRO stage 1 or 2's DeepSpeedZeroOptimizer, whose partitioned state AmpWatch "
                "snapshots (ZeRO stage 3, bf16 with ZeRO stage 1, and engines without ZeRO are not covered)")
    if compat.deepspeed_cpu_offload(optimizer):
        return ("the trajectory control is not available under DeepSpeed with optimizer offload: the offloaded "
                "optimizer keeps its own host buffers, which AmpWatch does not snapshot")
    if compat.deepspeed_fp32_partitions(optimizer) is None or not callable(getattr(optimizer, "update_lp_params",
                                                                                   None)):
        return ("the trajectory control is not available under this DeepSpeed version: its ZeRO optimizer has no "
                "float32 partitions or no update_lp_params to snapshot and restore them with")
    return None


class _ScalerFields(MutableMapping):  # type: ignore[type-arg]
    """The loss scaler's fields, as a mapping whose writes go to the live scaler (a snapshot's restore clears an
    entry and updates it: clearing leaves the fields, which the update then sets)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def __getitem__(self, key: str) -> Any:
        if key not in SCALER_FIELDS or not hasattr(self.scaler, key):
            raise KeyError(key)
        return getattr(self.scaler, key)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self.scaler, key, value)

    def __delitem__(self, key: str) -> None:
        raise KeyError(key)  # a scaler's fields are never removed

    def clear(self) -> None:
        pass

    def __iter__(self) -> Iterator[str]:
        return iter([k for k in SCALER_FIELDS if hasattr(self.scaler, k)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def live_state(engine: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state) of a ZeRO-1/2 engine, in the form of torch's distributed state dicts that
    :class:`~lightning_ampwatch.trajectory.snapshot.Snapshot` copies and puts back in place: this rank's float32 master
    partitions and the module's buffers; per partition, the inner optimizer's own state dict (the live one); and
    the loss scaler's fields (fp16)."""
    optimizer = zero_optimizer(engine)
    partitions = compat.deepspeed_fp32_partitions(optimizer)
    model_sd: dict[str, Any] = {FP32_PARTITION.format(i): p for i, p in enumerate(partitions)}
    model_sd.update({f"buffer.{name}": b for name, b in engine.module.named_buffers()})
    inner = compat.deepspeed_inner_optimizer(optimizer)
    optim_sd: dict[str, Any] = {FP32_PARTITION.format(i): inner.state[p] for i, p in enumerate(partitions)
                                if p in inner.state}
    scaler = compat.deepspeed_loss_scaler(engine)
    if scaler is not None and hasattr(scaler, "cur_scale"):
        optim_sd[LOSS_SCALER_ENTRY] = _ScalerFields(scaler)
    return model_sd, optim_sd


def after_restore(engine: Any) -> None:
    """The float32 partitions were put back: the module's half-precision weights made from them again, as the
    engine does after a step (every rank at once: an all-gather)."""
    import torch

    optimizer = zero_optimizer(engine)
    with torch.no_grad():
        optimizer.update_lp_params()
