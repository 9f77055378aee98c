"""Reading the run: where each precision plugin keeps its scaler, and how to learn scale, skipped steps,
loss and learning rate without adding a host-device synchronisation to a healthy step.

Where the precision plugins keep their scalers is learned here; the scaler's private tensors are read through
:mod:`~lightning_ampwatch.compat`. It hands the core plain numbers.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from lightning_ampwatch import compat
from lightning_ampwatch.deepspeed_state import DeepSpeedLossScale, is_engine
from lightning_ampwatch.machine import BatchStats, PrecisionMode


@dataclass
class PrecisionInfo:
    """What the trainer's precision plugin does, learned once at fit start."""

    mode: PrecisionMode
    scaler: Any = None  # torch.amp.GradScaler (or ShardedGradScaler) when one is active
    note: str | None = None  # said once to the user when there is something we cannot watch
    #: DeepSpeed fp16: the engine's own loss scaler, read on the host (a DeepSpeedLossScale); ``scaler`` is None
    loss_scale: Any = None
    #: DeepSpeed: its engine, whose ``step()`` takes an optimizer step only at a gradient-accumulation boundary
    engine: Any = None


def resolve_precision(plugin: Any, engine: Any = None) -> PrecisionInfo:
    """Map a Lightning precision plugin to a :class:`PrecisionMode` and its scaler, if any. ``engine``: the
    strategy's model (a DeepSpeed engine keeps its fp16 loss scaler there)."""
    name = type(plugin).__name__
    precision = str(getattr(plugin, "precision", "32-true"))
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "is_enabled") and not scaler.is_enabled():
        scaler = None
    if "deepspeed" in name.lower():
        engine = engine if is_engine(engine) else None
        if not precision.startswith("16"):
            return PrecisionInfo(PrecisionMode.BF16 if precision.startswith("bf16") else PrecisionMode.FP32, None,
                                 "DeepSpeed in bf16 or full precision keeps no loss scale: loss finiteness is "
                                 "watched.", engine=engine)
        loss_scale = DeepSpeedLossScale.of(engine)
        if loss_scale is None:
            return PrecisionInfo(PrecisionMode.FP16, None,
                                 "DeepSpeed's fp16 loss scaler could not be found on its engine; only loss "
                                 "finiteness is watched.", engine=engine)
        return PrecisionInfo(PrecisionMode.FP16, None, None, loss_scale, engine)
    if precision.startswith("16-mixed") or precision == "16":
        if scaler is None:
            return PrecisionInfo(PrecisionMode.FP16, None,
                                 "float16 autocast without a GradScaler: no loss scale to watch.")
        return PrecisionInfo(PrecisionMode.FP16, scaler)
    if precision.startswith("bf16"):
        return PrecisionInfo(PrecisionMode.BF16, None, "bf16 needs no loss scaler: there is no scale to watch.")
    if precision.startswith("16-true"):
        return PrecisionInfo(PrecisionMode.HALF, None, "16-true has no loss scaler: there is no scale to watch.")
    return PrecisionInfo(PrecisionMode.FP32, None,
                         "The run is in full precision: there is no loss scaler to watch; loss finiteness is watched.")


def scaler_config(scaler: Any) -> dict[str, Any]:
    """The scaler's growth settings: plain Python attributes, no device read."""
    return {
        "growth_factor": float(scaler.get_growth_factor()),
        "backoff_factor": float(scaler.get_backoff_factor()),
        "growth_interval": int(scaler.get_growth_interval()),
    }


def read_scale(scaler: Any) -> tuple[float, int]:
    """The scaler's current scale and growth tracker. A device read: only at log steps, anomalies or start."""
    scale_t = compat.scale_tensor(scaler)
    if scale_t is None:  # lazily initialised: nothing scaled yet (or just resumed)
        return compat.initial_scale(scaler)
    tracker = compat.growth_tracker_tensor(scaler)
    values = torch.stack([scale_t.reshape(()).float(), tracker.reshape(()).float()]).tolist()  # type: ignore[union-attr]
    return float(values[0]), int(values[1])


class StepTaken:
    """Learns whether each optimizer step ran, without a sync.

    GradScaler calls the real ``optimizer.step`` only when no inf was found, after it has already synchronised
    to decide; a step post-hook therefore tells us "not skipped" for free. Fused optimizers are always called
    and skip internally: for those the pre-hook keeps the ``found_inf`` tensor to read when a read is due.
    """

    def __init__(self) -> None:
        self.taken = False
        self.found_inf: Tensor | None = None
        self.fused = False  # some optimizer unscales in its own kernel: its skips need the found_inf read
        self._handles: list[Any] = []

    def attach(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.detach()
        self.fused = False
        for opt in optimizers:
            if not hasattr(opt, "register_step_post_hook"):
                # not a torch optimizer (DeepSpeed's ZeRO optimizers): its steps are not seen here, and there
                # is no GradScaler whose skips this hook would tell (DeepSpeed keeps its own loss scaler)
                continue
            if compat.unscales_in_kernel(opt):  # fused: only these need the pre-hook
                self.fused = True
                self._handles.append(opt.register_step_pre_hook(self._pre))
            self._handles.append(opt.register_step_post_hook(self._post))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        found_inf = getattr(optimizer, "found_inf", None)
        if isinstance(found_inf, Tensor):
            self.found_inf = found_inf

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.taken = True


class LossTape(list):  # type: ignore[type-arg]
    """The losses handed to backward since the last optimizer step, unread: a list of ``(loss, scale)`` pairs, a
    plain list subclass because one is filled every step. Each loss is a device tensor, or on the CPU (where reading
    it is no synchronisation) its value as a Python float, taken as it came (``StepLedger.backward``).

    Under a scaler, Lightning hands the callback the *scaled* loss; the scale it was multiplied by is stored
    beside it so the read gives the user's loss. Several entries mean gradient accumulation or several manual
    backward calls: the step's loss is their sum (Lightning already divides by the accumulation count).

    A float loss reads exactly as its tensor would: the float32 values the tensor's arithmetic below works in (a
    float64 loss rounded as ``.float()`` rounds it), and the same ops where there is arithmetic.
    """

    __slots__ = ()

    def total(self) -> Tensor:
        """The step's (unscaled) loss as a device scalar; no read."""
        if len(self) == 1:
            loss, scale = self[0]
            if type(loss) is float:  # its value, as the tensor below would hold it (float64 keeps every loss exact)
                return torch.tensor(loss, dtype=torch.float32) / scale if scale != 1.0 else \
                    torch.tensor(loss, dtype=torch.float64)
            loss = loss.detach()
            return loss.float().reshape(()) / scale if scale != 1.0 else loss.reshape(())
        return torch.stack([_float32(loss) / scale for loss, scale in self]).sum()

    def read(self) -> float:
        """The step's loss as a float: one device read (none for a loss taken as a float, unscaled: the CPU's fast
        path without a scaler, every step)."""
        if len(self) == 1:
            loss, scale = self[0]
            if type(loss) is float and scale == 1.0:
                return array("f", (loss,))[0]  # ``float(tensor.float())``: rounded to float32 as ``.float()`` rounds
        return float(self.total().float().cpu())


def _float32(loss: Tensor | float) -> Tensor:
    """A tape's loss as a float32 0-d tensor (a float as the tensor it was taken from gives it)."""
    if type(loss) is float:
        return torch.tensor(loss, dtype=torch.float32)
    return loss.detach().float().reshape(())  # type: ignore[union-attr]


class DeferredRead:
    """A device scalar copied to the host without waiting; read once the copy has landed.

    On CUDA the copy goes to pinned memory behind an event, so ``ready`` is a non-blocking query; on the CPU
    the value is already on the host and ready at once.
    """

    def __init__(self, tensor: Tensor) -> None:
        t = tensor.detach().reshape(())
        self._event: Any = None
        if t.device.type == "cuda":
            self._host = torch.empty((), dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t.cpu()

    def ready(self) -> bool:
        return self._event is None or bool(self._event.query())

    def value(self) -> float:
        if self._event is not None:
            self._event.synchronize()
        return float(self._host)


def current_lrs(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[float, ...]:
    """The learning rate of every param group, as Python floats (a tensor LR is read only if on the CPU)."""
    out: list[float] = []
    for opt in optimizers:
        for group in opt.param_groups:
            lr = group.get("lr", 0.0)
            if isinstance(lr, Tensor):
                if lr.device.type != "cpu":
                    continue
                lr = float(lr)
            out.append(float(lr))
    return tuple(out)


def float_tensors(obj: Any, path: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield path, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from float_tensors(value, f"{path}[{key!r}]")
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        for i, value in enumerate(obj):
            yield from float_tensors(value, f"{path}[{i}]")
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from float_tensors(getattr(obj, name), f"{path}.{name}")


def inspect_batch(batches: Sequence[Any], max_rows: int = 8) -> BatchStats:
    """Non-finite values and the largest magnitude in the step's batches. Reads the device: anomalies only."""
    nonfinite_where: list[str] = []
    absmax, absmax_where = 0.0, None
    for i, batch in enumerate(batches):
        prefix = "batch" if len(batches) == 1 else f"micro_batch[{i}]"
        for path, tensor in float_tensors(batch, prefix):
            t = tensor.detach()
            if t.numel() == 0:
                continue
            bad = ~torch.isfinite(t)
            finite_abs = torch.where(bad, torch.zeros((), dtype=t.dtype, device=t.device), t).abs()
            stats = torch.stack([bad.any().float(), finite_abs.amax().float()]).tolist()
            if stats[0]:
                rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()[:max_rows].tolist() \
                    if t.dim() > 0 else []
                nonfinite_where.append(f"{path} rows {rows}" if rows else path)
            if stats[1] > absmax:
                absmax, absmax_where = float(stats[1]), path
    return BatchStats(
        nonfinite=bool(nonfinite_where),
        nonfinite_where="; ".join(nonfinite_where) or None,
        absmax=absmax if math.isfinite(absmax) else float("inf"),
        absmax_where=absmax_where,
    )


class ScaleMirror:
    """A host-side copy of GradScaler's scale arithmetic.

    ``torch._amp_update_scale_`` is deterministic given whether each step found an inf, and the step hook
    tells us that for free; so the scale, the growth tracker and every growth event are known on the host
    without reading the device. The adapter reconciles with the real value when it reads it anyway.
    """

    def __init__(self, scale: float, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, tracker: int = 0) -> None:
        self.scale = float(scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.tracker = int(tracker)

    def update(self, found_inf: bool) -> bool:
        """Advance one step; returns True when the scale grew."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.tracker = 0
            return False
        self.tracker += 1
        if self.tracker >= self.growth_interval:
            grown = self.scale * self.growth_factor
            self.tracker = 0
            if math.isfinite(grown):
                self.scale = grown
                return True
        return False

    def reconcile(self, scale: float, tracker: int | None = None) -> None:
        self.scale = float(scale)
        if tracker is not None:
            self.tracker = int(tracker)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "tracker": self.tracker}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> "ScaleMirror":
        return cls(**state)
