"""``FabricHost``: what only Fabric knows, for the core's :class:`~lightning_ampwatch.host.Host` protocol; and how
a replay calls the user's ``loss_fn`` the way Fabric runs the model.

Fabric's own ways are taken into account: ``fabric.setup`` runs the module's forward under autocast and casts
float inputs to the precision's dtype, so the FP32 control calls the user's ``loss_fn`` on the unwrapped module
with autocast off; a replay at the run's precision calls it on the unwrapped module dressed the way Fabric calls it
(inputs cast, forward under autocast, outputs cast back), without Fabric's backward hook, which refuses gradients
not taken through ``fabric.backward``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from types import SimpleNamespace
from typing import Any, ContextManager, Sequence

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_ampwatch.core import RunWatcher
from lightning_ampwatch.fabric.loop import LoopLearningRates, LoopOwner, LoopStep, scaler_of
from lightning_ampwatch.fabric.patches import LoopPatches
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.host import user_code_failure
from lightning_ampwatch.probes import tensors_in
from lightning_ampwatch.remedies import RemedyContext
from lightning_ampwatch.signals import PrecisionInfo, resolve_precision
from lightning_ampwatch.trajectory.state import TrainState

#: Fabric's rank-zero info log (its ``rank_zero_info`` writes to whichever of Fabric's and Lightning's loggers was
#: imported last; a Fabric user's lines belong in Fabric's, which shows INFO on the console by default)
_FABRIC_LOG = logging.getLogger("lightning.fabric.utilities.rank_zero")


def named(fn: Any) -> str:
    """A callable's name as the user wrote it (``step_loss``), else its type's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


class FabricHost:
    """What only Fabric knows, for the :class:`~lightning_ampwatch.core.Host` protocol: the run's precision, loggers
    and step count, a micro-batch's loss again (``step_loss``), the state the FP32 trajectory control drives, what a
    remedy acts on; and whether the faulty steps may be replayed at all (:meth:`refuse_replays`). Made at ``attach``
    with what the adapter follows of the loop (:attr:`loop`, a :class:`~lightning_ampwatch.fabric.loop.LoopStep`) and
    what it installs on the run (:attr:`patches`)."""

    automatic = True  # one loss_fn per micro-batch, stepped by the loop: a step replays from its batches alone

    def __init__(self, owner: LoopOwner, model: Any, wrapped_optimizers: list[Any], schedulers: list[Any],
                 clipping: tuple[float | None, str] = (None, "norm")) -> None:
        fabric = owner.fabric
        self.clipping = clipping
        optimizers = [opt.optimizer for opt in wrapped_optimizers]  # the raw torch optimizers
        self.model = model  # what fabric.setup returned, as attach() got them
        self.wrapped_optimizers = wrapped_optimizers
        self._owner = owner
        self._fabric = fabric
        self.module: nn.Module = model.module  # the user's module, unwrapped (under DDP too)
        self.device = fabric.device
        self.is_global_zero = fabric.is_global_zero
        self.world_size = fabric.world_size
        self.inputs_overflowed: str | None = None  # the dtype Fabric's input cast turned a finite input non-finite in
        self._optimizers = optimizers
        self._schedulers = schedulers
        self.loop_lrs = LoopLearningRates.of(optimizers)
        self.loop = LoopStep(owner, optimizers, schedulers, self.loop_lrs)
        self.patches = LoopPatches(fabric, self.module, self.loop, owner.watcher)
        # why no step of this run is replayed (the loop does not hand over every micro-batch); None: they are
        self.refusal: str | None = None
        self._loss_fn_error: Exception | None = None  # loss_fn's exception, as it left a replay's call
        self._state: TrainState | None = None
        self._remedy_target = SimpleNamespace(
            optimizers=optimizers,
            lr_scheduler_configs=[SimpleNamespace(scheduler=s, interval="step", frequency=1) for s in schedulers],
            strategy=_FabricStrategyView(fabric),
        )

    @property
    def watcher(self) -> RunWatcher:
        return self._owner.watcher

    # ------------------------------------------------------------------ Host: what the core reads

    @property
    def global_step(self) -> int:
        return self._owner.steps

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return self._optimizers

    @property
    def loggers(self) -> Sequence[Any]:
        return self._fabric.loggers

    @property
    def log_every(self) -> int:
        return self._owner.log_every_n_steps

    @property
    def log_dir(self) -> str:
        for logger in self._fabric.loggers:
            log_dir = getattr(logger, "log_dir", None)
            if log_dir:
                if self.is_global_zero:
                    # the logger makes its directory before ours goes in it (a CSV logger warns about a directory
                    # it finds not empty); it would make it at its first log anyway
                    with contextlib.suppress(Exception):
                        logger.experiment  # noqa: B018
                return str(log_dir)
        return os.getcwd()

    def precision(self) -> PrecisionInfo:
        """The run's precision now; the backward watch follows the plugin (a bf16 fallback swaps it)."""
        plugin = self._fabric.strategy.precision
        self.patches.follow(plugin)
        return resolve_precision(plugin)

    def forward_context(self) -> ContextManager[Any]:
        return self._fabric.strategy.precision.forward_context()

    def step_loss(self, batch: Any, batch_idx: int) -> Any:
        """``loss_fn`` on a micro-batch again. Under autocast (a replay at the run's precision) the model is called as
        Fabric calls it and the rest of ``loss_fn`` runs outside autocast, as in the loop; with autocast off (the
        FP32 control) the unwrapped model sees the batch as it is, in float32."""
        try:
            precision = self._fabric.strategy.precision
            if torch.is_autocast_enabled(self.device.type) and getattr(precision, "precision", None) == "16-mixed" \
                    and torch.get_autocast_dtype(self.device.type) == torch.bfloat16:
                # the bf16 intervention's replay (investigate's Interventions): the model under the bfloat16 autocast
                # the replay set, not under Fabric's float16 one
                return self._owner.loss_fn(self.module, batch)
            if torch.is_autocast_enabled(self.device.type):
                model: Any = _AsFabricRunsIt(self.module, precision, self)
                with torch.autocast(self.device.type, enabled=False):
                    return self._owner.loss_fn(model, batch)
            return self._owner.loss_fn(self.module, batch)
        except Exception as err:
            # the user's code failed, not the watch: the core turns the failed replay off on every rank alike, as
            # for any failure, and says it as loss_fn's (user_failure)
            self._loss_fn_error = err
            raise

    def outside_modules(self) -> str:
        """Where a replay's fault that no module's output shows is placed: Fabric's cast of the model's inputs to
        the precision's dtype, when that is where a finite input went non-finite; else the user's ``loss_fn``."""
        overflowed, self.inputs_overflowed = self.inputs_overflowed, None
        if overflowed is not None:
            return f"the inputs of {type(self.module).__name__} (cast to {overflowed} by Fabric)"
        name = getattr(self._owner.loss_fn, "__qualname__", None) or type(self._owner.loss_fn).__name__
        return f"{name} (the loss_fn)"

    def train_state(self) -> TrainState:
        unavailable = None
        if any(p.dtype in (torch.float16, torch.bfloat16) for p in self.module.parameters()):
            unavailable = ("the trajectory control is not available: the weights themselves are half precision "
                           "(a '16-true' or 'bf16-true' run), so there is no FP32 run to replay")
        self._state = TrainState(
            module=self.module, optimizers=list(self._optimizers),
            scaler=scaler_of(self._fabric.strategy.precision),
            schedulers=[(s, 1) for s in self._schedulers] + ([(self.loop_lrs, 1)] if self.loop_lrs else []),
            clip_val=self.clipping[0],
            clip_algorithm=self.clipping[1],
            accumulate=self._state.accumulate if self._state is not None else 1,
            device=self.device, forward_context=self.forward_context, unavailable=unavailable,
            step_loss=self.step_loss, replay_unavailable=self.refusal,
        )
        return self._state

    def step_schedulers(self) -> list[Any]:
        return list(self._schedulers)

    def remedy_context(self, scaler: Any, safe_scale: float | None, guards: RecipeGuards) -> RemedyContext:
        return RemedyContext(trainer=self._remedy_target, module=self.module, scaler=scaler, device=self.device,
                             safe_scale=safe_scale, guards=guards, switch_precision=self.switch_precision)

    def switch_precision(self, precision: str) -> None:
        """The bf16 fallback: Fabric's own ``MixedPrecision`` plugin in the strategy, which Fabric's module and
        optimizer wrappers read at every call (regions the loop wraps in ``fabric.autocast()`` keep Fabric's
        original plugin)."""
        from lightning.fabric.plugins import MixedPrecision

        if precision not in ("16-mixed", "bf16-mixed"):
            raise ValueError(f"FabricWatch cannot switch a Fabric run to precision {precision!r}")
        self._fabric.strategy.precision = MixedPrecision(precision, self.device.type)  # type: ignore[arg-type]

    def rollback_to_checkpoint(self, before: int) -> tuple[str | None, int | None]:
        """A Fabric loop saves its checkpoints itself, where the watch cannot know: only snapshots roll back."""
        return None, None

    def log_metrics(self, metrics: dict[str, float]) -> None:
        self._fabric.log_dict(metrics, step=self._owner.steps)

    def stop(self) -> None:
        self._owner.should_stop = True

    def say(self, message: str) -> None:
        if self.is_global_zero:
            _FABRIC_LOG.info(message)

    def say_once(self, message: str) -> None:
        self.watcher.say_once(message)

    # ------------------------------------------------------------------ the adapter's own bookkeeping

    def batch_over(self) -> None:
        """After ``watcher.route.batch_end``: the next forward is the next micro-batch's."""
        self.inputs_overflowed = None
        self.loop.batch_over()

    def accumulated(self, micro_batches: int) -> None:
        """The step being taken in ran on this many micro-batches: the trajectory replay divides each loss by it,
        as the loop did before ``fabric.backward``."""
        if self._state is not None:
            self._state.accumulate = micro_batches

    def replays_refused(self) -> str | None:
        """The core asks before it replays a faulty step: why none may run (see :meth:`refuse_replays`), or None."""
        return self.refusal

    def user_failure(self, err: Exception) -> str | None:
        """The core's failure ``err`` said as the user's ``loss_fn``'s when that is what raised (itself, or a replay's
        error that carries its words); None otherwise."""
        failed, self._loss_fn_error = self._loss_fn_error, None
        return user_code_failure(failed, err, f"loss_fn {named(self._owner.loss_fn)}")

    def batches_missing(self, step: int, calls: int, handed: int) -> None:
        """Step ``step`` ran ``calls`` ``fabric.backward`` calls, but only ``handed`` micro-batches were handed to the
        watch: the loop does not call ``watch.accumulate``. Said once; no faulty step is replayed from here on, since
        the step's batches the watch holds are not all of its batches."""
        if self.refusal is not None:
            return
        updates = self.loop.scaler_updates
        if updates > 1:  # not accumulation: the loop stepped several times between two watch.step calls
            self.refuse_replays(f"step {step} took in {updates} optimizer steps of the loop (watch.step "
                                "was not called after each): a replay would run on batches that are not the step's")
            self.say_once(f"watch.step() came after {updates} optimizer steps of the loop: call "
                          "watch.step(batch, loss) once after every optimizer step. Until the loop does, FabricWatch "
                          "replays no faulty step and runs no FP32 control: they would judge batches that are not "
                          "the step's.")
            return
        self.refuse_replays(f"step {step} ran {calls} fabric.backward calls, but the watch was handed {handed} "
                            f"micro-batch{'es' if handed > 1 else ''} (watch.accumulate was not called for the "
                            "others): a replay would run on batches that are not the step's")
        self.say_once(f"step {step} ran {calls} fabric.backward() calls, but only {handed} micro-batch"
                      f"{'es' if handed > 1 else ''} reached the watch. Under gradient accumulation call "
                      "watch.accumulate(batch) after fabric.backward for every micro-batch but the last one of a "
                      "step (whose batch goes to watch.step). Until the loop does, FabricWatch replays no faulty "
                      "step and runs no FP32 control: they would judge batches that are not the step's.")

    def refuse_replays(self, reason: str) -> None:
        """No step of this run is replayed from now on (the faulty batch's replay and FP32 control, the FP32
        trajectory control, ``replay_episode``'s rerun): ``reason`` goes in the evidence in their place."""
        if self.refusal is not None:
            return
        self.refusal = reason
        if self._state is not None:
            self._state.replay_unavailable = reason
        self.watcher.treatment.replay_episode = False  # a rerun trains on the batches it holds: not the episode's


class _AsFabricRunsIt:
    """The unwrapped module, called the way Fabric's module wrapper calls it: inputs cast by the precision plugin,
    the forward under its autocast, outputs cast back. Without the wrapper's backward hook, which refuses a gradient
    not taken through ``fabric.backward`` (replays take theirs with ``torch.autograd.grad``), and without DDP's
    forward, which would expect an all-reduce the replay never makes. Attributes are the module's."""

    def __init__(self, module: nn.Module, precision: Any, host: FabricHost) -> None:
        self.__dict__["_module"] = module
        self.__dict__["_precision"] = precision
        self.__dict__["_host"] = host

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._precision
        inputs = (args, kwargs)
        args, kwargs = precision.convert_input(inputs)
        overflowed = _cast_overflowed(inputs, (args, kwargs))  # a replay only: a run never pays for this read
        if overflowed is not None:
            self._host.inputs_overflowed = overflowed
        with precision.forward_context():
            output = self._module(*args, **kwargs)
        return precision.convert_output(output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _cast_overflowed(before: Any, after: Any) -> str | None:
    """The dtype a finite float input went non-finite in when Fabric cast it (``"float16"``), or None."""
    pairs = [(b, a) for b, a in zip(tensors_in(before), tensors_in(after))
             if b.is_floating_point() and a.dtype != b.dtype]
    if not pairs:
        return None
    flags = torch.stack([torch.isfinite(b).all() & ~torch.isfinite(a).all() for b, a in pairs]).tolist()
    return next((str(a.dtype).removeprefix("torch.") for (_, a), bad in zip(pairs, flags) if bad), None)


class _FabricStrategyView:
    """``strategy.precision_plugin`` as the remedies read it (the run's precision now): Fabric's strategy's
    ``precision``."""

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric

    @property
    def precision_plugin(self) -> Any:
        return self._fabric.strategy.precision
