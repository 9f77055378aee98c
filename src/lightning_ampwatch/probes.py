"""Localisation and the FP32 control: replay the batch that faulted, with hooks attached only for the replay.

Nothing here runs on a healthy step. A replay leaves no trace: parameters, ``.grad``, optimizer state, buffers
(BatchNorm statistics), the RNG state and ``self.log`` are exactly as they were, because gradients are taken with
``torch.autograd.grad`` (never accumulated), buffers and RNG are restored, and logging is silenced while it runs.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor, nn

FP16_MAX = 65504.0
_STOCHASTIC = (nn.modules.dropout._DropoutNd, nn.RReLU)


def uses_rng(module: nn.Module) -> bool:
    """Whether the model draws random numbers in training (dropout...): only then is the RNG captured per step."""
    return any(isinstance(m, _STOCHASTIC) for m in module.modules())


class MicroBatch(NamedTuple):
    """What is needed to run ``training_step`` again exactly as it ran: the batch, its index and the RNG.
    A tuple, since one is made for every batch."""

    batch: Any
    batch_idx: int
    rng: Tensor | None = None
    cuda_rng: Tensor | None = None


def capture_rng(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@dataclass
class ReplayResult:
    """What one replay of a step's batches measured; plain Python values once read."""

    autocast: bool
    loss: float | None = None
    first_nonfinite_module: str | None = None
    nonfinite_outside_modules: bool = False
    headroom: list[tuple[str, float]] = field(default_factory=list)
    first_nonfinite_param: str | None = None
    grads_finite: bool | None = None
    error: str | None = None

    @property
    def loss_finite(self) -> bool | None:
        return None if self.loss is None else math.isfinite(self.loss)


class ForwardProbe:
    """Forward hooks on every named module, recording on the device whether each output is finite, its largest
    magnitude and whether its inputs were finite. Read once, when the probe closes."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._names = {m: (n or type(root).__name__) for n, m in root.named_modules()}
        self._leaves = {name for m, name in self._names.items() if not any(True for _ in m.children())}
        self._records: list[tuple[str, Tensor, bool]] = []  # name, [out_finite, out_absmax, in_finite], fp16
        self._handles: list[Any] = []
        self.order: list[str] = []

    def __enter__(self) -> "ForwardProbe":
        for module in self._names:
            self._handles.append(module.register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        outs = [t for t in _tensors(output) if t.is_floating_point()]
        if not outs:
            return
        ins = [t for t in _tensors(inputs) if t.is_floating_point()]
        with torch.no_grad():
            out_finite = torch.stack([torch.isfinite(t).all() for t in outs]).all()
            out_absmax = torch.stack([_finite_absmax(t) for t in outs]).max()
            in_finite = torch.stack([torch.isfinite(t).all() for t in ins]).all() if ins else out_finite.new_ones(())
            record = torch.stack([out_finite.float(), out_absmax.float(), in_finite.float()])
        name = self._names.get(module, type(module).__name__)
        self._records.append((name, record, any(t.dtype == torch.float16 for t in outs)))
        self.order.append(name)

    def read(self) -> tuple[str | None, list[tuple[str, float]]]:
        """(first module whose output went non-finite from finite inputs, the modules nearest float16's limit)."""
        if not self._records:
            return None, []
        values = torch.stack([r for _, r, _ in self._records]).cpu().tolist()
        first = None
        headroom: dict[str, float] = {}
        for (name, _, fp16), (out_finite, absmax, in_finite) in zip(self._records, values):
            if first is None and not out_finite and in_finite:
                first = name
            if fp16 and out_finite and absmax > 0 and name in self._leaves:
                room = math.log2(FP16_MAX / absmax)
                headroom[name] = min(room, headroom.get(name, math.inf))
        nearest = sorted(headroom.items(), key=lambda kv: kv[1])[:5]
        return first, [(n, round(v, 2)) for n, v in nearest]


def _finite_absmax(t: Tensor) -> Tensor:
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), device=t.device)
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device)).abs().amax().float()


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


@contextlib.contextmanager
def no_trace(module: nn.Module) -> Iterator[None]:
    """Everything a replay could change, put back as it was: buffers, RNG, ``log``, train/eval modes."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    modes = [(m, m.training) for m in module.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    silenced = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in silenced:
        setattr(module, name, _silent)
    try:
        yield
    finally:
        for name in silenced:
            module.__dict__.pop(name, None)
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        for m, training in modes:
            m.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def _silent(*args: Any, **kwargs: Any) -> None:
    return None


class Replayer:
    """Runs ``training_step`` again on a step's micro-batches, under autocast or without it (the FP32 control)."""

    def __init__(self, module: Any, autocast: Callable[[], Any], device: torch.device) -> None:
        self.module = module
        self.autocast = autocast  # the precision plugin's forward context factory
        self.device = device

    def run(self, micro_batches: Sequence[MicroBatch], *, use_autocast: bool, grad_scale: float | None,
            probe: bool) -> ReplayResult:
        result = ReplayResult(autocast=use_autocast)
        params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        total: Tensor | None = None
        grads: list[Tensor | None] | None = None
        probe_ctx: ForwardProbe | None = ForwardProbe(self.module) if probe else None
        with no_trace(self.module), (probe_ctx or contextlib.nullcontext()):
            for mb in micro_batches:
                if mb.rng is not None:
                    torch.set_rng_state(mb.rng)
                if mb.cuda_rng is not None:
                    torch.cuda.set_rng_state(mb.cuda_rng, self.device)
                ctx = self.autocast() if use_autocast else torch.autocast(self.device.type, enabled=False)
                with ctx:
                    loss = _loss_of(self.module.training_step(mb.batch, mb.batch_idx))
                if loss is None:
                    continue
                loss = loss.float() / len(micro_batches)
                total = loss if total is None else total + loss.detach()
                if grad_scale is not None and loss.requires_grad:
                    step_grads = torch.autograd.grad(loss * grad_scale, [p for _, p in params], allow_unused=True)
                    if grads is None:
                        grads = list(step_grads)
                    else:
                        grads = [g if a is None else (a if g is None else a + g) for a, g in zip(grads, step_grads)]
        if total is not None:
            result.loss = float(total.detach().cpu())
        if probe_ctx is not None:
            first, result.headroom = probe_ctx.read()
            result.first_nonfinite_module = first
            result.nonfinite_outside_modules = first is None and result.loss_finite is False
        if grads is not None:
            result.grads_finite, result.first_nonfinite_param = first_nonfinite_grad(params, grads, probe_ctx)
        return result


def first_nonfinite_grad(params: list[tuple[str, Tensor]], grads: list[Tensor | None],
                    probe: ForwardProbe | None) -> tuple[bool, str | None]:
    """The first parameter, in backward order, whose gradient is non-finite (one device read for all)."""
    present = [(name, g) for (name, _), g in zip(params, grads) if g is not None]
    if not present:
        return True, None
    flags = torch.stack([torch.isfinite(g).all() for _, g in present]).cpu().tolist()
    bad = [name for (name, _), ok in zip(present, flags) if not ok]
    if not bad:
        return True, None
    # backward runs modules in reverse order of their forward execution
    rank: dict[str, int] = {}
    if probe is not None:
        for i, module_name in enumerate(probe.order):
            rank.setdefault(module_name, i)
    def backward_key(name: str) -> tuple[int, int]:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        return (-rank.get(owner, -1), [n for n, _ in params].index(name))
    return False, min(bad, key=backward_key)


class LiveProbe:
    """Probes on the next real training step, for when the faulty one cannot be replayed (manual optimization:
    ``training_step`` steps the optimizer itself). Armed before the step's forward, read once after its backward,
    and removed then."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._forward: ForwardProbe | None = ForwardProbe(module).__enter__()

    def finish(self, with_grads: bool) -> tuple[str | None, str | None, list[tuple[str, float]]]:
        """(first non-finite module, first non-finite gradient's parameter, float16 headroom); hooks removed."""
        probe, self._forward = self._forward, None
        if probe is None:
            return None, None, []
        probe.__exit__(None, None, None)
        first_module, headroom = probe.read()
        first_param = None
        if with_grads:
            params = [(n, p) for n, p in self.module.named_parameters() if p.grad is not None]
            if params:
                _, first_param = first_nonfinite_grad(params, [p.grad for _, p in params], probe)
        return first_module, first_param, headroom

    def close(self) -> None:
        """Remove the hooks without reading (the fit ended)."""
        if self._forward is not None:
            self._forward.__exit__(None, None, None)
            self._forward = None

