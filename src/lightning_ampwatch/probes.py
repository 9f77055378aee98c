"""Localisation and the FP32 control: replay the batch that faulted, with hooks attached only for the replay.

Nothing here runs on a healthy step. A replay leaves no trace: parameters, ``.grad``, optimizer state, buffers
(BatchNorm statistics), torchmetrics states, the RNG state and ``self.log`` are exactly as they were, because
gradients are taken with ``torch.autograd.grad`` (never accumulated) and :func:`no_trace` puts the rest back.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_ampwatch import compat, distributed, sharding
from lightning_ampwatch.machine.vocabulary import FP16_MAX
from lightning_ampwatch.signals import float_tensors

_STOCHASTIC = compat.STOCHASTIC_MODULES
#: How a rank that stopped at a meeting because another rank's part raised says so (the other's error is said first).
_ABORTED = "(stopped with the others) "


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
    #: the loss scale the gradients were taken at (``grads_finite`` is at this scale)
    grad_scale: float | None = None
    #: whether the same graph's gradients are finite at scale 1; the same as ``grads_finite`` when ``grad_scale`` is 1
    unscaled_grads_finite: bool | None = None
    #: the largest finite |gradient| at scale 1 over all parameters (a safe scale is about 65504 / this)
    grad_absmax: float | None = None
    error: str | None = None
    #: why the gradient probe measured nothing (no gradient reached any parameter); None when it measured
    grads_unavailable: str | None = None

    @property
    def loss_finite(self) -> bool | None:
        return None if self.loss is None else math.isfinite(self.loss)


class ForwardProbe:
    """Forward hooks on every named module, recording on the device whether each output is finite, its largest
    magnitude and whether its inputs, positional and keyword, were finite. Read once, when the probe closes."""

    def __init__(self, root: nn.Module, skip_root: bool = False) -> None:
        self._names = {m: (compat.user_name(n) or sharding.class_name(root)) for n, m in root.named_modules()
                       if not (skip_root and m is root)}
        self._leaves = {name for m, name in self._names.items() if not any(True for _ in m.children())}
        self._records: list[tuple[str, Tensor, bool]] = []  # name, [out_finite, out_absmax, in_finite], fp16
        self._handles: list[Any] = []
        self.order: list[str] = []

    def __enter__(self) -> "ForwardProbe":
        for module in self._names:
            self._handles.append(module.register_forward_hook(self._hook, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        outs = [t for t in tensors_in(output) if t.is_floating_point()]
        if not outs:
            return
        ins = [t for t in tensors_in((args, kwargs)) if t.is_floating_point()]  # keyword tensors are inputs too
        with torch.no_grad():
            out_finite = torch.stack([_all_finite(t) for t in outs]).all()
            out_absmax = torch.stack([_finite_absmax(t) for t in outs]).max()
            in_finite = torch.stack([_all_finite(t) for t in ins]).all() if ins else out_finite.new_ones(())
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


_SPARSE_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def stored_values(t: Tensor) -> Tensor:
    """The values a tensor holds, as a dense tensor: a sparse gradient's (``nn.Embedding(sparse=True)``) stored
    values, coalesced first so that an index the batch repeats counts once, as the sum it stands for (two finite
    halves can sum past the format's range); a dense tensor itself. Checks on these say what they say of the whole
    tensor: the implicit zeros are finite and add nothing to a largest magnitude."""
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout in _SPARSE_COMPRESSED:
        return t.values()
    return t


def _all_finite(t: Tensor) -> Tensor:
    return torch.isfinite(stored_values(t)).all()


def _finite_absmax(t: Tensor) -> Tensor:
    t = stored_values(t)
    if t.numel() == 0:
        return torch.zeros((), device=t.device)
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device)).abs().amax().float()


def tensors_in(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def loss_of(output: Any) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


@contextlib.contextmanager
def no_trace(module: nn.Module) -> Iterator[None]:
    """Run a block that calls the module's own code (``training_step``, a forward) and leave no trace of it.

    Put back on exit, exceptions included: every buffer's values (BatchNorm statistics); every torchmetrics
    ``Metric`` child's states, update count and cached results; each submodule's train/eval mode; the CPU and CUDA
    RNG states. ``log`` and ``log_dict`` do nothing inside. Not put back: parameters, their ``.grad`` and the
    optimizer state; the block must leave those alone (take gradients with ``torch.autograd.grad``) or restore them
    itself.
    """
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    metrics = [(m, _metric_snapshot(m)) for m in module.modules() if isinstance(m, Metric)]
    modes = [(m, m.training) for m in module.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        with silenced_log(module):
            yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        for metric, snapshot in metrics:
            _metric_restore(metric, snapshot)
        for m, training in modes:
            m.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


_METRIC_CACHES = ("_update_count", "_computed", "_forward_cache")


def _metric_snapshot(metric: Metric) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """A metric's states (tensors cloned, since ``update`` adds to them in place; lists copied, since it appends)
    and its caches, which ``update`` replaces rather than changes."""
    states = {name: value.detach().clone() if isinstance(value, Tensor) else list(value)
              for name, value in metric.metric_state.items()}
    return states, tuple(getattr(metric, name) for name in _METRIC_CACHES)


def _metric_restore(metric: Metric, snapshot: tuple[dict[str, Any], tuple[Any, ...]]) -> None:
    states, caches = snapshot
    for name, value in states.items():
        setattr(metric, name, value)
    for name, value in zip(_METRIC_CACHES, caches):
        setattr(metric, name, value)


@contextlib.contextmanager
def silenced_log(module: nn.Module) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing while steps that are not the loop's run ``training_step``."""
    names = [name for name in ("log", "log_dict") if hasattr(module, name)]
    for name in names:
        setattr(module, name, _silent)
    try:
        yield
    finally:
        for name in names:
            module.__dict__.pop(name, None)


def _silent(*args: Any, **kwargs: Any) -> None:
    return None


class Replayer:
    """Runs a step's micro-batches again through ``step_loss`` (by default the module's ``training_step``), under
    autocast or without it (the FP32 control)."""

    def __init__(self, module: Any, autocast: Callable[[], Any], device: torch.device,
                 step_loss: Callable[[Any, int], Any] | None = None, root: Any = None) -> None:
        self.module = module
        self.step_loss = step_loss  # one micro-batch's loss; None: the module's training_step, looked up each time
        self.autocast = autocast  # the precision plugin's forward context factory
        self.device = device
        self._root = root  # the module as the strategy wraps it, or a callable giving it (read at each replay)

    def root_module(self) -> Any:
        root = self._root() if callable(self._root) and not isinstance(self._root, nn.Module) else self._root
        return root if isinstance(root, nn.Module) else self.module

    def _redirected(self) -> bool:
        """Whether ``training_step`` runs through the wrapper's forward, which calls the module's own forward hooks
        with ``training_step``'s output (not a forward's): the probe leaves the root module out then."""
        root = self.root_module()
        return root is not self.module and sharding.redirects(root)

    def _training_step(self, batch: Any, batch_idx: int) -> Any:
        """One micro-batch's loss: the host's ``step_loss`` (the Lightning host's goes through the strategy's
        forward redirection itself), else ``training_step`` as the strategy runs it."""
        if self.step_loss is not None:
            return self.step_loss(batch, batch_idx)
        return sharding.training_step(self.root_module(), self.module, batch, batch_idx)

    def run(self, micro_batches: Sequence[MicroBatch], *, use_autocast: bool, grad_scale: float | None,
            probe: bool) -> ReplayResult:
        """Replay; with ``grad_scale``, take the gradients at that loss scale and, from the same graph, at scale 1."""
        if grad_scale is not None and sharding.replay_needs_all_ranks(self.root_module()) and distributed.world_size() > 1:
            return self._run_sharded(micro_batches, use_autocast=use_autocast, grad_scale=grad_scale, probe=probe)
        result = ReplayResult(autocast=use_autocast)
        params = [(compat.user_name(n), p) for n, p in self.module.named_parameters() if p.requires_grad]
        tensors = [p for _, p in params]
        unscaled_pass = grad_scale is not None and grad_scale != 1.0
        total: Tensor | None = None
        scaled: list[Tensor | None] | None = None
        unscaled: list[Tensor | None] | None = None
        probe_ctx: ForwardProbe | None = ForwardProbe(self.module, skip_root=self._redirected()) if probe else None
        # the FP32 control is FP32 throughout: a frozen half-precision base is computed in float32 meanwhile
        fp32 = contextlib.nullcontext(0) if use_autocast else sharding.fp32_frozen(self.module)
        with no_trace(self.module), (probe_ctx or contextlib.nullcontext()), fp32:
            for loss in self._losses(micro_batches, use_autocast):
                total = loss if total is None else total + loss.detach()
                if grad_scale is not None and loss.requires_grad:
                    step = torch.autograd.grad(loss * grad_scale, tensors, allow_unused=True,
                                               retain_graph=unscaled_pass)
                    scaled = _accumulate(scaled, step)
                    if unscaled_pass:
                        unscaled = _accumulate(unscaled, torch.autograd.grad(loss, tensors, allow_unused=True))
        if total is not None:
            result.loss = float(total.detach().cpu())
        if probe_ctx is not None:
            first, result.headroom = probe_ctx.read()
            result.first_nonfinite_module = first
            result.nonfinite_outside_modules = first is None and result.loss_finite is False
        if scaled is not None:
            present = [(name, s, u) for (name, _), s, u in zip(params, scaled, unscaled or scaled) if s is not None]
            result.grad_scale = grad_scale
            if not present and tensors:
                # autograd reached no parameter (FSDP2 computes with gathered copies, not the sharded parameters
                # it holds): the probe measured nothing, so it says so rather than "finite"
                result.grads_unavailable = ("no gradient reached the parameters in the replay (a sharded model "
                                            "computes with gathered copies of them)")
            if present:
                result.grads_finite, result.unscaled_grads_finite = True, True
                values = torch.stack([torch.stack([_all_finite(s).float(), _all_finite(u).float(),
                                                   _finite_absmax(u)]) for _, s, u in present]).cpu().tolist()
                bad = [name for (name, _, _), (ok, _, _) in zip(present, values) if not ok]
                result.grads_finite = not bad
                result.unscaled_grads_finite = all(ok for _, ok, _ in values)
                result.grad_absmax = max(absmax for _, _, absmax in values)
                result.first_nonfinite_param = _first_in_backward(bad, [n for n, _ in params], probe_ctx)
        return result


    def _losses(self, micro_batches: Sequence[MicroBatch], use_autocast: bool,
                lockstep: distributed.Lockstep | None = None) -> Iterator[Tensor]:
        """Each micro-batch's loss as the training step computes it, with the step's own random numbers, under the
        run's autocast or none (the FP32 control), in float32 and divided by the number of micro-batches (as
        accumulation sums them). A step that returned no loss yields nothing. ``lockstep``: told of each new
        micro-batch (a sharded replay)."""
        for mb in micro_batches:
            if lockstep is not None:
                lockstep.next()
            if mb.rng is not None:
                torch.set_rng_state(mb.rng)
            if mb.cuda_rng is not None:
                torch.cuda.set_rng_state(mb.cuda_rng, self.device)
            with self.autocast() if use_autocast else torch.autocast(self.device.type, enabled=False):
                loss = loss_of(self._training_step(mb.batch, mb.batch_idx))
            if loss is not None:
                yield loss.float() / len(micro_batches)

    def _run_sharded(self, micro_batches: Sequence[MicroBatch], *, use_autocast: bool, grad_scale: float,
                     probe: bool) -> ReplayResult:
        """The replay of a sharded model (FSDP), which every rank runs at the same time. ``torch.autograd.grad``
        reaches no sharded parameter (the forward computes with gathered copies), so gradients come from real
        backward passes, which FSDP reduce-scatters into each rank's shard of ``.grad``: one at ``grad_scale``,
        one at scale 1 (a second forward; a retained graph would outlive FSDP's freed gathers). Each parameter's
        flags (non-finite at the scale, non-finite at 1, largest finite magnitude at 1) are reduced across ranks,
        so every rank reads the same answer. The live ``.grad`` is put back afterwards.

        The ranks agree on the outcome whatever happens on one of them. Each rank's part runs in a
        :class:`~lightning_ampwatch.distributed.Lockstep` (a rank that raises before a micro-batch's forward stops
        every rank there), its own work after the passes is caught, and one gather that every rank enters, raised
        or not, brings every rank's flags or error together: a failure anywhere gives every rank the same
        ``error`` (the rank and its exception), and nothing measured. Not covered, and not coverable from here: a
        rank that raises inside the sharded forward or backward, between FSDP's own collectives, leaves the others
        waiting in FSDP's next one (NCCL waits for its timeout; gloo may abort on the mismatch)."""
        result = ReplayResult(autocast=use_autocast)
        params = [(compat.user_name(n), p) for n, p in self.module.named_parameters() if p.requires_grad]
        live_grads = [p.grad for _, p in params]
        scales = [grad_scale] + ([1.0] if grad_scale != 1.0 else [])
        probe_ctx: ForwardProbe | None = ForwardProbe(self.module, skip_root=self._redirected()) if probe else None
        total: Tensor | None = None
        passes: list[list[Tensor | None]] = []  # each pass's gradient shards, read once every pass is over
        values: list[list[list[float]]] | None = None
        first: str | None = None
        error: str | None = None
        try:
            with no_trace(self.module), distributed.Lockstep(self.root_module()) as lockstep:
                for i, scale in enumerate(scales):
                    for _, p in params:
                        p.grad = None
                    with (probe_ctx if probe_ctx is not None and i == 0 else contextlib.nullcontext()):
                        for loss in self._losses(micro_batches, use_autocast, lockstep):
                            if i == 0:
                                total = loss.detach() if total is None else total + loss.detach()
                            if loss.requires_grad:
                                (loss * scale).backward()
                    passes.append([p.grad for _, p in params])
            # this rank's own work, after every collective of the passes: caught, and agreed on below
            rows = [torch.stack([_grad_flags(g, self.device) for g in grads]) if grads else torch.zeros((0, 3))
                    for grads in passes]
            values = [row.cpu().tolist() for row in rows]
            if total is not None:
                result.loss = float(total.cpu())
            if probe_ctx is not None:
                first, result.headroom = probe_ctx.read()
        except Exception as err:  # noqa: BLE001 - every rank must still reach the gather below
            error = (f"{_ABORTED}{err}" if isinstance(err, distributed.ReplayAborted)
                     else f"rank {distributed.rank()}: {type(err).__name__}: {err}")
        finally:
            for (_, p), grad in zip(params, live_grads):
                p.grad = grad
        gathered = distributed.gather((error, values))  # (passes, params, [present, non-finite, finite absmax])
        # the rank whose part raised first, before those that stopped with it at a meeting (protocol.ReplayAborted)
        errors = sorted((e for e, _ in gathered if e is not None), key=lambda e: e.startswith(_ABORTED))
        if errors:
            result.loss, result.headroom = None, []
            result.error = (f"the replay raised on {errors[0]}; every rank stopped it together, so nothing was "
                            "measured")
            return result
        if probe_ctx is not None:
            result.first_nonfinite_module = first
            result.nonfinite_outside_modules = first is None and result.loss_finite is False
        merged = [[[max(col) for col in zip(*cells)] for cells in zip(*rows)]
                  for rows in zip(*[v for _, v in gathered])]
        result.grad_scale = grad_scale
        present = [i for i, row in enumerate(merged[0]) if row[0]]
        if not present:
            result.grads_unavailable = "no gradient reached the parameters on any rank in the replay"
            return result
        bad = [params[i][0] for i in present if merged[0][i][1]]
        result.grads_finite = not bad
        result.unscaled_grads_finite = not any(merged[-1][i][1] for i in present)
        result.grad_absmax = max(merged[-1][i][2] for i in present)
        result.first_nonfinite_param = _first_in_backward(bad, [n for n, _ in params], probe_ctx)
        return result


def _grad_flags(grad: Tensor | None, device: torch.device) -> Tensor:
    """[present, non-finite, largest finite magnitude] of this rank's shard of a gradient (zeros when absent)."""
    if grad is None:
        return torch.zeros(3, device=device)
    g = stored_values(sharding.local(grad))
    if g.numel() == 0:  # this rank holds no part of it
        return torch.tensor([1.0, 0.0, 0.0], device=g.device)
    return torch.stack([torch.ones((), device=g.device), (~torch.isfinite(g)).any().float(), _finite_absmax(g)])


def _accumulate(total: list[Tensor | None] | None, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Gradients summed over micro-batches; ``None`` (a parameter the loss does not use) counts as zero."""
    if total is None:
        return list(grads)
    return [g if a is None else (a if g is None else a + g) for a, g in zip(total, grads)]


def _first_in_backward(bad: list[str], names: list[str], probe: ForwardProbe | None) -> str | None:
    """Of the parameters whose gradient is non-finite, the one backward reached first: backward runs the modules
    in reverse order of their forward (as the probe saw it), and a module's parameters in registration order."""
    if not bad:
        return None
    rank: dict[str, int] = {}
    if probe is not None:
        for i, module_name in enumerate(probe.order):
            rank.setdefault(module_name, i)
    position = {name: i for i, name in enumerate(names)}

    def backward_key(name: str) -> tuple[int, int]:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        return (-rank.get(owner, -1), position[name])

    return min(bad, key=backward_key)


class LiveProbe:
    """Probes on the next real training step, for when the faulty one cannot be replayed (manual optimization:
    ``training_step`` steps the optimizers itself). Armed before the step's forward; each optimizer's gradients
    are noted at its step (:meth:`optimizer_step`); everything is read once and the hooks removed in
    :meth:`finish`, after the whole ``training_step``, so that a forward run after the first optimizer step (the
    second network of a GAN) is watched too."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._params = {p: compat.user_name(n) for n, p in module.named_parameters()}
        self._grads: list[tuple[list[str], Tensor]] = []  # per optimizer step: names, finite flags (on device)
        self._forward: ForwardProbe | None = ForwardProbe(module).__enter__()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Note the gradients ``optimizer`` is about to apply: its own parameters only, since another optimizer's
        may still hold an earlier step's gradients (not zeroed yet). Kept on the device until :meth:`finish`."""
        self._note([(self._params[p], p.grad) for group in optimizer.param_groups for p in group["params"]
                    if p.grad is not None and p in self._params])

    def _note(self, named_grads: list[tuple[str, Tensor]]) -> None:
        if self._forward is not None and named_grads:
            flags = torch.stack([_all_finite(g) for _, g in named_grads])
            self._grads.append(([n for n, _ in named_grads], flags))

    def finish(self) -> tuple[str | None, str | None, list[tuple[str, float]]]:
        """(first non-finite module, first non-finite gradient's parameter, float16 headroom); hooks removed."""
        probe, self._forward = self._forward, None
        if probe is None:
            return None, None, []
        probe.__exit__(None, None, None)
        first_module, headroom = probe.read()
        noted, self._grads = self._grads, []
        first_param = None
        if noted:
            flags = torch.cat([f for _, f in noted]).cpu().tolist()  # one read for every step's gradients
            names = list(self._params.values())
            for step_names, _ in noted:  # the earliest optimizer step with a non-finite gradient
                step_flags, flags = flags[:len(step_names)], flags[len(step_names):]
                bad = [n for n, ok in zip(step_names, step_flags) if not ok]
                if bad:
                    first_param = _first_in_backward(bad, names, probe)
                    break
        return first_module, first_param, headroom

    def close(self) -> None:
        """Remove the hooks without reading (the fit ended)."""
        if self._forward is not None:
            self._forward.__exit__(None, None, None)
            self._forward = None
        self._grads = []


class ReducedInputs(torch.overrides.TorchFunctionMode):
    """Which of the batches' float tensors enter a reduced-precision op in a replay: a torch function that takes one
    (or a float32 tensor computed from one) and returns a float16/bfloat16 tensor. A target used only in a float32
    loss never does. Alarm-time only (the probe's replay)."""

    def __init__(self, batches: Sequence[MicroBatch]) -> None:
        super().__init__()
        self.paths: dict[int, str] = {}
        self.keep: list[torch.Tensor] = []  # the traced tensors stay alive, so that their ids stay theirs
        for i, mb in enumerate(batches):
            prefix = "batch" if len(batches) == 1 else f"micro_batch[{i}]"
            for path, t in float_tensors(mb.batch, prefix):
                self.paths[id(t)] = path
                self.keep.append(t)
        self.reduced: list[str] = []
        self.seen: set[str] = set()  # the batch paths some op took: none means the batch reached the model copied

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paths:
            return out
        found = {self.paths[id(t)] for t in tensors_in((args, kwargs or {})) if id(t) in self.paths}
        if found:
            self.seen.update(found)
            outs = [t for t in tensors_in(out) if isinstance(t, torch.Tensor)]
            if any(t.dtype in (torch.float16, torch.bfloat16) for t in outs):
                self.reduced.extend(p for p in sorted(found) if p not in self.reduced)
            else:  # a float32 derivation (a normalisation, a slice): followed on
                path = sorted(found)[0]
                for t in outs:
                    if t.is_floating_point():
                        self.paths[id(t)] = path
                        self.keep.append(t)
        return out

    def entered(self) -> list[str] | None:
        """The paths that entered a reduced-precision op; None when no op took any of the batch's own tensors (a
        wrapper copied them on the way, as DDP may): then nothing is known, and nothing is concluded."""
        return list(self.reduced) if self.seen else None
