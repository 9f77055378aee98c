"""The replay: the window's steps again from a snapshot (:func:`replay_trajectory`, :func:`retrain`), then the live
state back exactly, so that the run continues bit-identically."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat, sharding, snapshot_copy
from lightning_ampwatch.probes import MicroBatch, loss_of, no_trace, silenced_log, tensors_in
from lightning_ampwatch.remedies.hold_lr import LrCeiling, clamp_lrs, param_groups
from lightning_ampwatch.remedies.island import ISLAND_ATTR, attach_island, detach_island
from lightning_ampwatch.trajectory.snapshot import Snapshot, _as_micro_batches
from lightning_ampwatch.trajectory.state import PRECISIONS, TrainState
from lightning_ampwatch.verdicts import TrajectoryResult


def replay_trajectory(state: TrainState, snapshot: Snapshot, steps: Sequence[tuple[int, Sequence[Any]]], *,
                      precision: str, lr_factor: float = 1.0, scale: float | None = None,
                      island: Sequence[str] = (), watch: Sequence[str] = (),
                      stop_on_fault: bool = False, skips_allowed: int = 0, count_from: int | None = None,
                      lr_cap: float | None = None, ready: Callable[[], None] | None = None,
                      before_micro_batch: Callable[[], None] | None = None) -> TrajectoryResult:
    """Restore ``snapshot`` in place, run ``steps`` (``(step, micro-batches)`` following the snapshot's step, as
    ``SnapshotRing.batches`` gives them) as Lightning's automatic optimization would, then put the live state back
    exactly (``lr_cap``: no learning rate above it on any replayed step). ``precision="fp32"``: autocast off and no
    scaler (the control); ``"amp"``: the run's forward context
    and a scaler restored from the snapshot (does the fault reproduce?); ``"bf16"``: bfloat16 autocast and no scaler.
    ``lr_factor``: every learning rate (and the step schedulers' base rates) times this for the replay: the lower-LR
    counterfactual. ``scale``: the amp replay's scaler starts at this scale instead of the snapshot's (the growth
    tracker at zero). ``island``: these submodules run in float32 with autocast off for the replay (the FP32 island,
    taken off again after). ``watch``: submodules whose largest finite output magnitude is kept per step
    (``TrajectoryResult.absmax``: how close they come to float16's limit). ``stop_on_fault``: the replay ends at the
    first non-finite step or at the skip after ``skips_allowed`` of them (one host read per step: replays run on
    alarms only), skips before step ``count_from`` left out (the run's own before the fault's onset). One host read at
    the end
    otherwise (and one per step for a Fabric loop's ``ReduceLROnPlateau``, stepped on each replayed step's loss).
    ``ready``: the ranks' meeting, passed to the snapshot's restore (after every check of this replay and of the
    restore, before its first collective). ``before_micro_batch``: called before each replayed micro-batch (a
    sharded model's :class:`~lightning_ampwatch.distributed.Lockstep`: its ``next``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    if state.unavailable is not None:
        raise ValueError(state.unavailable)
    if state.replay_unavailable is not None:
        raise ValueError(state.replay_unavailable)
    if precision == "fp32" and state.fp32_unavailable is not None:
        raise ValueError(state.fp32_unavailable)
    indices = [s for s, _ in steps]
    expected = list(range(snapshot.step + 1, snapshot.step + 1 + len(steps)))
    if not steps or indices != expected:
        raise ValueError(f"steps {indices} do not follow the snapshot taken after step {snapshot.step}: expected "
                         f"consecutive steps from {snapshot.step + 1}")
    amp = precision != "fp32"
    if state.device.type == "cuda":
        snapshot_copy.finish()  # the snapshot's host copies are complete (they run on a side stream)
        torch.cuda.current_stream(state.device).synchronize()
    scaler = None
    if precision == "amp" and snapshot.scaler is not None:
        scaler = sharding.replay_scaler(state.scaler, state.device.type)
        saved = snapshot.scaler_state_dict()
        if scale is not None:
            saved = {**saved, "scale": float(scale), "_growth_tracker": 0}
        scaler.load_state_dict(saved)
    context = state.forward_context if precision == "amp" else (
        functools.partial(torch.autocast, state.device.type, dtype=torch.bfloat16))
    live = Snapshot.take(state, -1, grads=True)
    losses: list[Tensor | None] = []
    skipped: list[Tensor] = []
    peaks: list[Tensor] = []
    seen_skips = 0
    module = state.module
    with_island = [name for name in island if getattr(module.get_submodule(name), ISLAND_ATTR, None) is None]
    watcher = _OutputPeaks(module, watch, state.device, every_float=not amp)
    try:
        with no_trace(state.module), _without_step_hooks(state.optimizers), \
                (contextlib.nullcontext(0) if amp else sharding.fp32_frozen(state.module)), watcher:
            for name in with_island:
                attach_island(module, name, state.device.type)
            snapshot.restore(state, ready)
            if lr_factor != 1.0:
                scale_learning_rates(state.optimizers, [s for s, _ in state.schedulers], lr_factor)
            ran = state.lr_log.at if state.lr_log is not None else None
            for step, micro_batches in steps:
                if ran is not None:
                    _run_at(state, ran(step), lr_factor)
                if lr_cap is not None:  # the counterfactual "without the rise": no group above the LR before it
                    groups = param_groups(state.optimizers)
                    clamp_lrs(groups, [lr_cap] * len(groups))
                loss, skip = _replay_step(state, _as_micro_batches(micro_batches), scaler, amp, context,
                                          before_micro_batch)
                losses.append(loss)
                skipped.append(skip)
                peaks.append(watcher.step_peak())
                if stop_on_fault:
                    seen_skips += int(bool(skip)) if count_from is None or step >= count_from else 0
                    if seen_skips > skips_allowed or (loss is not None and not bool(torch.isfinite(loss).all())):
                        break
            # the root's parameters: under FSDP1 without use_orig_params the module itself holds none
            finite = torch.stack([torch.isfinite(sharding.local(p)).all() for p in state.root.parameters()]).all()
            present = [t.float().reshape(()) for t in losses if t is not None]
            read = torch.stack([*present, finite.float(), *(s.float() for s in skipped),
                                *(p.float() for p in peaks)]).tolist()  # the one read
    finally:
        for name in with_island:
            detach_island(module, name)
        live.restore(state)
    values = iter(read[:len(present)])
    n = len(skipped)
    flags = read[len(present) + 1:len(present) + 1 + n]
    return TrajectoryResult(
        precision=precision, from_step=snapshot.step, steps=indices[:n],
        losses=[None if t is None else next(values) for t in losses],
        params_finite=bool(read[len(present)]), skipped=[bool(v) for v in flags],
        absmax=[float(v) for v in read[len(present) + 1 + n:]] if watch else [],
    )


class _OutputPeaks:
    """Keeps, per replayed step, the largest finite magnitude of every half-precision tensor computed inside the
    ``names`` submodules (their functional ops included: an ``exp()`` of raw scores is no module of its own), on the
    device, read with the replay's one read. Their ``forward`` is wrapped on the instance for the replay only (as the
    FP32 island wraps it) and put back on exit."""

    def __init__(self, module: Any, names: Sequence[str], device: torch.device, every_float: bool = False) -> None:
        self.modules = [module.get_submodule(n) for n in names]
        self.seen: list[Tensor] = []
        self.device = device
        self.replaced: list[tuple[Any, Any]] = []
        # FP32: every float tensor (what float16 would have had to hold); else the half-precision ones only
        self.dtypes = (torch.float16, torch.bfloat16, torch.float32) if every_float else (torch.float16, torch.bfloat16)

    def __enter__(self) -> "_OutputPeaks":
        for m in self.modules:
            before = m.__dict__.get("forward")
            self.replaced.append((m, before))
            m.forward = functools.partial(self._forward, m, before)
        return self

    def __exit__(self, *exc: Any) -> None:
        for m, before in self.replaced:
            if before is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = before
        self.replaced.clear()

    def _forward(self, module: Any, before: Any, *args: Any, **kwargs: Any) -> Any:
        with _HalfPeaks(self.seen, self.dtypes):
            return before(*args, **kwargs) if before is not None else type(module).forward(module, *args, **kwargs)

    def step_peak(self) -> Tensor:
        seen, self.seen = self.seen, []
        if not seen:
            return torch.zeros((), device=self.device)
        return torch.stack([s.to(self.device) for s in seen]).max()


class _HalfPeaks(torch.overrides.TorchFunctionMode):
    """Each torch function's outputs of ``dtypes``: their largest finite magnitude, appended to ``seen``."""

    def __init__(self, seen: list[Tensor], dtypes: tuple[torch.dtype, ...]) -> None:
        super().__init__()
        self.seen = seen
        self.dtypes = dtypes

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        with torch.no_grad():  # (inside its own handler the mode is off: these calls are not seen)
            for t in tensors_in(out):
                if isinstance(t, Tensor) and t.dtype in self.dtypes and t.numel():
                    d = t.detach()
                    self.seen.append(torch.where(torch.isfinite(d), d, torch.zeros((), dtype=d.dtype,
                                                                                   device=d.device)).abs().amax().float())
        return out


def _run_at(state: TrainState, lrs: tuple[float, ...] | None, factor: float) -> None:
    """A replayed step runs at the LRs the run recorded for it (times ``factor``, the lower-LR counterfactual's), where
    the restored schedulers give others: an LR set outside a scheduler (a callback, a hand-written warmup) is replayed
    as the run had it. Nothing when none was recorded that far back, or the groups are not those the LRs were read
    from (a group added, a tensor LR)."""
    if lrs is None:
        return
    groups = [g for opt in state.optimizers for g in opt.param_groups]
    if len(groups) != len(lrs):
        return
    for group, lr in zip(groups, lrs):
        now = group.get("lr")
        if isinstance(now, (int, float)) and not isinstance(now, bool):
            target = lr * factor
            if now != target and not math.isclose(now, target, rel_tol=1e-12, abs_tol=0.0):
                group["lr"] = target


def scale_learning_rates(optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any],
                         factor: float) -> None:
    """Every learning rate times ``factor``: the param groups' (and the bounds a scheduler keeps in them) and the
    schedulers' base rates, so that a scheduler's next step keeps the lower level instead of undoing it."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["lr"] * factor
            for key in ("initial_lr", "max_lr", "min_lr"):
                if isinstance(group.get(key), (int, float)):
                    group[key] = group[key] * factor
    for sched in schedulers:
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]
        compat.scale_last_lr(sched, factor)


def retrain(state: TrainState, steps: Sequence[tuple[int, Sequence[Any]]]) -> list[float | None]:
    """Train on ``steps`` again, for real (after a rollback, the episode's batches with the remedy in effect): the
    run's own precision and scaler, as Lightning's automatic optimization steps. ``self.log`` is silenced and the
    optimizer step hooks are hidden, since these are not the loop's steps; what they change stays. Returns the
    losses, read once at the end."""
    losses: list[Tensor | None] = []
    with silenced_log(state.module), _without_step_hooks(state.optimizers):
        for _, micro_batches in steps:
            losses.append(_replay_step(state, _as_micro_batches(micro_batches), state.scaler, True)[0])
    present = [t.float().reshape(()) for t in losses if t is not None]
    values = iter(torch.stack(present).tolist() if present else [])
    return [None if t is None else next(values) for t in losses]


def _replay_step(state: TrainState, micro_batches: list[MicroBatch], scaler: Any,
                 amp: bool, context: Callable[[], Any] | None = None,
                 before_micro_batch: Callable[[], None] | None = None) -> tuple[Tensor | None, Tensor]:
    """One optimizer step as Lightning's automatic optimization runs it: (the step's loss, whether the scaler
    skipped it), both left on the device."""
    for opt in state.optimizers:
        opt.zero_grad()
    total: Tensor | None = None
    for mb in micro_batches:
        if before_micro_batch is not None:
            before_micro_batch()
        if mb.rng is not None:
            torch.set_rng_state(mb.rng)
        if mb.cuda_rng is not None:
            torch.cuda.set_rng_state(mb.cuda_rng, state.device)
        with (context or state.forward_context)() if amp else torch.autocast(state.device.type, enabled=False):
            loss = loss_of((state.step_loss or state.module.training_step)(mb.batch, mb.batch_idx))
        if loss is None:
            continue
        loss = loss / state.accumulate
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    skipped = torch.zeros((), dtype=torch.bool, device=state.device)
    if total is not None:  # a step whose training_step returned None has no gradients to step with
        scale_before = compat.scale_tensor(scaler).clone() if scaler is not None else None  # type: ignore[union-attr]
        for opt in state.optimizers:
            if scaler is not None:
                scaler.unscale_(opt)
            _clip(state, opt)
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
        if scaler is not None:
            scaler.update()
            skipped = compat.scale_tensor(scaler) < scale_before  # the scale backs off exactly when the step was skipped
    last_batch_idx = micro_batches[-1].batch_idx if micro_batches else 0
    for scheduler, frequency in state.schedulers:
        if (last_batch_idx + 1) % frequency == 0:  # Lightning's rule for step-interval schedulers
            # the class's hook (the user's override, if any), not an instance-level stand-in such as
            # hold_lr_on_skip's, which answers for the live run's last step
            step = getattr(type(state.module), "lr_scheduler_step", None)
            if step is None:  # a plain module (a Fabric loop): the loop steps its schedulers itself
                if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    # stepped on a metric, which a loop that steps it every optimizer step takes from the step's
                    # loss: the replayed step's (read here: a replay's cost, never the live run's)
                    if total is not None:
                        type(scheduler).step(scheduler, total)
                else:
                    type(scheduler).step(scheduler)  # the class's, not an instance-level stand-in
            else:
                step(state.module, scheduler, None)
    if state.schedulers:
        _hold_ceiling(state)
    return total, skipped


def _hold_ceiling(state: TrainState) -> None:
    """``reduce_lr``'s ceiling, where the live run holds one: a replayed step's learning rates are those the live
    run's would be (the ceiling answers for every step, unlike ``hold_lr_on_skip``)."""
    ceiling = LrCeiling.installed(state.module)
    if ceiling is not None:
        clamp_lrs(param_groups(state.optimizers), ceiling.caps)
        for scheduler, _ in state.schedulers:
            compat.held_last_lr(scheduler)


def _clip(state: TrainState, optimizer: torch.optim.Optimizer) -> None:
    """Clip as the Trainer's ``gradient_clip_val`` / ``gradient_clip_algorithm`` do, with torch's own functions
    (unwrapped from AmpWatch's clipping guard, which watches the live run's clipping only)."""
    if not state.clip_val or state.clip_val <= 0:
        return
    name = "clip_grad_value_" if state.clip_algorithm == "value" else "clip_grad_norm_"
    clip = getattr(torch.nn.utils, name)
    getattr(clip, "__ampwatch_original__", clip)(list(_params_of(optimizer)), state.clip_val)


_without_step_hooks = compat.without_step_hooks  # replayed steps stay unseen by the live run's step hooks


def _params_of(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]
