"""``FabricWatch``: the Fabric adapter. A hand-written Fabric loop's calls become
:class:`~lightning_ampwatch.core.RunWatcher` calls; :class:`FabricHost` answers what only Fabric knows.

Fabric has no hooks of its own to feed a watch, so the adapter takes what the loop does anyway:

- ``fabric.backward(loss)``: the precision plugin's ``backward`` is wrapped on the plugin instance (the one patch;
  put back by :meth:`FabricWatch.close`), so the watch sees the loss exactly as Fabric hands it to autograd,
  scaled by the GradScaler, once per micro-batch, at the user's line;
- ``optimizer.step()``: Fabric's optimizer wrapper steps the raw optimizer through the precision plugin's scaler,
  and the watch's step hook on the raw optimizer learns, without a read (a fused optimizer
  excepted, whose flag is read once it lands), whether the scaler took the step;
- ``watch.step(batch, loss)``: the optimizer-step boundary, once per optimizer step.

Fabric's own ways are taken into account: ``fabric.setup`` runs the module's forward under autocast and casts
float inputs to the precision's dtype, so the FP32 control calls the user's ``loss_fn`` on the unwrapped module
with autocast off; a replay at the run's precision calls it on the unwrapped module dressed the way Fabric calls it
(inputs cast, forward under autocast, outputs cast back), without Fabric's backward hook, which refuses gradients
not taken through ``fabric.backward``.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import weakref
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable, ContextManager, Iterable, Literal, Sequence, Union

import torch
from lightning.fabric import Fabric
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor, nn

from lightning_ampwatch.config import WatchConfig
from lightning_ampwatch.core import RunWatcher
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.host import user_code_failure
from lightning_ampwatch.machine import AmpStateMachine, Thresholds
from lightning_ampwatch.probes import tensors_in, uses_rng
from lightning_ampwatch.remedies import AppliedRemedy, RemedyContext
from lightning_ampwatch.signals import PrecisionInfo, resolve_precision
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch.trajectory.state import TrainState

#: Optimizer steps between two log steps (metrics to ``fabric.loggers``, one packed read), as Lightning's default.
DEFAULT_LOG_EVERY_N_STEPS = 50
#: Fabric's rank-zero info log (its ``rank_zero_info`` writes to whichever of Fabric's and Lightning's loggers was
#: imported last; a Fabric user's lines belong in Fabric's, which shows INFO on the console by default)
_FABRIC_LOG = logging.getLogger("lightning.fabric.utilities.rank_zero")
#: What ``clip_grad_norm_`` says when ``error_if_nonfinite=True`` meets an overflowed step.
_NONFINITE_CLIP_ERROR = "is non-finite, so it cannot be clipped"
#: The attached FabricWatch of each Fabric (by id: a watch holds its Fabric, so the id is not reused while it lives)
_ATTACHED: "weakref.WeakValueDictionary[int, FabricWatch]" = weakref.WeakValueDictionary()


class FabricWatch:
    r"""Watch a Lightning Fabric loop under mixed precision and name the cause when it goes wrong; the same
    diagnoses, remedies, event log and console output as :class:`~lightning_ampwatch.AmpWatch`, from the same core.

    Args:
        fabric: the :class:`~lightning.fabric.Fabric` the loop runs on.
        loss_fn: ``loss_fn(model, batch) -> loss``, how one micro-batch's loss is computed. Replays call it with the
            weights of a faulty step: with the model as Fabric runs it, and for the FP32 control with the unwrapped
            model and autocast off. It must not step an optimizer or call backward.
        log_every_n_steps: optimizer steps between two log steps, where the ``ampwatch/*`` metrics go to
            ``fabric.loggers`` and the timeline is written; ``0``: never.

    Every other keyword is :class:`~lightning_ampwatch.AmpWatch`'s, with the same meaning and the same checks.
    ``log_dir`` defaults to the first logger's ``log_dir``, else the working directory (``./ampwatch/``).
    With ``on_unrecoverable="stop"`` the watch sets :attr:`should_stop`; the loop ends when it sees it.
    ``watch.steps`` counts the optimizer steps taken in (:meth:`step` calls, on from a resumed checkpoint's count);
    ``Diagnosis.step`` counts the same steps from 0.

    Example:
        ```python
        watch = FabricWatch(fabric, loss_fn=step_loss)   # step_loss(model, batch) -> loss
        watch.attach(model, optimizer, scheduler)          # once, after fabric.setup
        for batch in loader:
            loss = step_loss(model, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            watch.step(batch, loss)                        # once per optimizer step, after it
        watch.close()                                      # or: with FabricWatch(...) as watch:
        ```
    """

    def __init__(
        self,
        fabric: Fabric,
        loss_fn: Callable[[Any, Any], Any],
        *,
        remediate: Union[bool, str, Iterable[str]] = False,
        on_unrecoverable: Literal["warn", "stop", "raise"] = "warn",
        control_replay: bool = True,
        localize: bool = True,
        hold_lr_on_skip: bool = False,
        verbose: Union[bool, Literal["full"]] = True,
        thresholds: Thresholds | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        name: str | None = None,
        snapshot_every: Union[int, Literal["auto"]] = "auto",
        snapshot_budget: int | None = None,
        rollback: bool = True,
        replay_episode: bool = False,
        log_every_n_steps: int = DEFAULT_LOG_EVERY_N_STEPS,
    ) -> None:
        config = WatchConfig(remediate, on_unrecoverable, control_replay, localize, hold_lr_on_skip, verbose,
                             thresholds, log_dir, name, snapshot_every, snapshot_budget, rollback, replay_episode)
        if not isinstance(fabric, Fabric):
            raise ValueError(f"fabric={fabric!r} is not valid; use the lightning.fabric.Fabric the loop runs on")
        if not callable(loss_fn):
            raise ValueError(f"loss_fn={loss_fn!r} is not valid; use a function loss_fn(model, batch) -> loss")
        try:
            signature: inspect.Signature | None = inspect.signature(loss_fn)
        except (TypeError, ValueError):  # a callable whose signature Python cannot tell: its first call will
            signature = None
        if signature is not None:
            try:
                signature.bind(None, None)
            except TypeError:
                raise ValueError(f"loss_fn={_named(loss_fn)}({', '.join(signature.parameters)}) is not valid: "
                                 "FabricWatch calls it as loss_fn(model, batch), with two positional arguments"
                                 ) from None
        if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps={log_every_n_steps!r} is not valid; use a whole number of optimizer "
                             "steps (0: never)")
        self.fabric = fabric
        self.loss_fn = loss_fn
        self.config = config
        self.log_every_n_steps = log_every_n_steps
        self.hold_lr_on_skip = hold_lr_on_skip
        # The core's own hold_lr_on_skip stands in for LightningModule.lr_scheduler_step; a Fabric loop steps its
        # schedulers itself, so the adapter holds them (see FabricHost.after_scaler_update).
        self.watcher = RunWatcher(replace(config, hold_lr_on_skip=False))
        self.should_stop = False
        self.steps = 0  # optimizer steps taken in (watch.step calls): Diagnosis.step counts them from 0
        self._resume_steps: int | None = None  # the step count of a checkpoint loaded before attach()
        self._host: FabricHost | None = None
        self._finished = False

    # ------------------------------------------------------------------ what the user reads

    @property
    def diagnoses(self) -> list[Diagnosis]:
        """Every diagnosis of the run, in order; a remedy's outcome updates its record in place."""
        return self.watcher.diagnoses

    @property
    def applied(self) -> list[AppliedRemedy]:
        """Every remedy applied in this run, in order."""
        return self.watcher.applied

    @property
    def machine(self) -> AmpStateMachine | None:
        return self.watcher.caught_up().machine

    @property
    def event_log(self) -> Any:
        """The event log (its ``path`` and ``dir``), or None before :meth:`attach`."""
        return self.watcher.event_log

    # ------------------------------------------------------------------ the loop's calls

    def attach(self, model: Any, optimizer: Any, scheduler: Any = None, *, gradient_clip_val: float | None = None,
               gradient_clip_algorithm: Literal["norm", "value"] = "norm") -> "FabricWatch":
        """Start watching; once, after ``fabric.setup``. ``optimizer`` and ``scheduler`` may be one or a list; the
        schedulers are those the loop steps once per optimizer step (snapshots hold their state, ``reduce_lr``
        lowers their base rates, ``hold_lr_on_skip`` holds them). ``gradient_clip_val`` and
        ``gradient_clip_algorithm`` say how the loop clips (``fabric.clip_gradients(max_norm=...)`` is ``"norm"``,
        ``clip_val=...`` is ``"value"``), so that the FP32 trajectory replay steps the way the loop does."""
        if gradient_clip_val is not None and (isinstance(gradient_clip_val, bool)
                                              or not isinstance(gradient_clip_val, (int, float))
                                              or gradient_clip_val <= 0):
            raise ValueError(f"gradient_clip_val={gradient_clip_val!r} is not valid; use a positive number or None")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not valid; use 'norm' or "
                             "'value'")
        if self._host is not None:
            raise RuntimeError("this FabricWatch is already attached; make one FabricWatch per loop")
        optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        schedulers = [] if scheduler is None else list(scheduler) if isinstance(scheduler, (list, tuple)) \
            else [scheduler]
        if not is_wrapped(model) or not hasattr(model, "module"):
            raise ValueError(f"attach() needs the model fabric.setup returned, got a {type(model).__name__}; call "
                             "model, optimizer = fabric.setup(model, optimizer) first")
        for opt in optimizers:
            if not is_wrapped(opt) or not hasattr(opt, "optimizer"):
                raise ValueError(f"attach() needs the optimizer fabric.setup returned, got a {type(opt).__name__}; "
                                 "call model, optimizer = fabric.setup(model, optimizer) first")
        for sched in schedulers:
            if not all(callable(getattr(sched, name, None)) for name in ("step", "state_dict", "load_state_dict")):
                raise ValueError(f"scheduler={sched!r} is not valid; use the learning-rate scheduler the loop steps "
                                 "once per optimizer step (an object with step(), state_dict() and load_state_dict(), "
                                 "as torch.optim.lr_scheduler's are), a list of them, or None")
        other = _ATTACHED.get(id(self.fabric))
        if other is not None and other is not self and other.attached:
            raise ValueError(f"this Fabric is already watched by another {other!r}, attached and not closed: a "
                             "second one would take over the hooks the first one reads the loop through, and blind "
                             "it. Use one FabricWatch per Fabric (close the other one first to replace it).")
        self._finished = False
        self.should_stop = False
        self.steps, self._resume_steps = self._resume_steps or 0, None  # a resumed run counts on
        host = FabricHost(self, model, optimizers, schedulers, (gradient_clip_val, gradient_clip_algorithm))
        self._host = host
        _ATTACHED[id(self.fabric)] = self
        self.watcher.start(host)
        self.watcher.begin_training()
        try:
            host.install()
        except Exception as err:  # noqa: BLE001 - a watch that cannot install watches less, the loop goes on
            host.uninstall()
            self.watcher.internal_failure("attach", err)
        return self

    def accumulate(self, batch: Any) -> None:
        """Gradient accumulation: a micro-batch whose gradients wait for the next optimizer step. Call it after
        ``fabric.backward`` for every micro-batch but the last one of a step, whose batch goes to :meth:`step`."""
        host = self._need_host()
        host.in_step = True
        try:
            self.watcher.route.batch_end(batch, host.next_batch_index())
        finally:
            host.in_step = False
            host.micro_batches += 1
            host.batch_over()

    def step(self, batch: Any, loss: Tensor | None = None) -> None:
        """The optimizer step is over (after ``optimizer.step()``, ``zero_grad()`` and the schedulers' ``step()``):
        take it in. ``batch`` is what ``loss_fn`` gets again if the step has to be replayed; ``loss`` the loss the
        loop computed (the watch reads the one handed to ``fabric.backward``; this one tells a loop that called
        ``loss.backward()`` instead)."""
        host = self._need_host()
        try:
            if not host.backward_seen and isinstance(loss, Tensor):
                host.unseen_backward(loss)
            if not host.optimizer_stepped():
                host.say_once("watch.step() was called without an optimizer step since the last one; it is taken as "
                              "a micro-batch of gradient accumulation. Call watch.step() once per optimizer step, and "
                              "watch.accumulate(batch) for the micro-batches in between.")
                self.accumulate(batch)
                return
            if not host.backward_seen and not isinstance(loss, Tensor):
                host.say_once("watch.step() got no loss, and fabric.backward() was not called since the last step: "
                              "FabricWatch has no loss to judge such a step by, and does not count it. Pass the loss, "
                              "watch.step(batch, loss), or call fabric.backward(loss).")
            handed = host.micro_batches + 1  # the batches the loop handed over: accumulate()'s and this one
            if host.backward_calls > handed:
                host.batches_missing(self.steps, host.backward_calls, handed)
            host.put_back_held_schedulers()
        except Exception as err:  # noqa: BLE001 - the adapter's own failure never reaches the loop
            self.watcher.internal_failure("watch.step", err)
        watcher = self.watcher
        host.in_step = True
        try:
            watcher.route.before_optimizer_step(host.optimizers[0])
            self.steps += 1
            host.accumulated(host.micro_batches + 1)
            if host.loop_lrs is not None:
                host.loop_lrs.step_index = self.steps - 1  # what a snapshot taken after this step keeps
            watcher.route.batch_end(batch, host.next_batch_index())  # raises only AmpWatchError (on_unrecoverable)
        finally:
            host.in_step = False
            host.micro_batches = 0
            host.backward_calls = 0
            host.lrs_noted = False
            host.batch_over()

    def close(self) -> None:
        """The end of the loop: what is in flight resolved, the summary printed, every hook and patch removed.
        Idempotent; ``with FabricWatch(...) as watch:`` calls it. An :meth:`attach` after it starts a new watch, its
        steps counted from 0 (``watch.load_state_dict(watch.state_dict())`` before it carries on instead)."""
        host = self._host
        if host is None:
            return
        host.batch_over()
        host.in_loop = False  # forwards from here on are replays: no RNG state to keep for them
        try:
            if not self._finished:
                self._finished = True
                self.watcher.finish()  # calls watcher.close()
        finally:
            self.watcher.close()
            host.uninstall()
            self._host = None

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the diagnoses, the machine, the remedies applied and the step count. Put the
        watch in the state ``fabric.save`` writes (``state = {"model": model, ..., "watch": watch}``)."""
        return {**self.watcher.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """From ``fabric.load``, before or after :meth:`attach`: the diagnoses come back, the remedies applied are put
        back on the run (a checkpoint holds weights, not an FP32 island or a swapped precision), the step count
        goes on from where it was. Loaded before :meth:`attach`, the state is kept until ``attach`` puts it back:
        :attr:`diagnoses` and :attr:`steps` show it from then on."""
        steps = state.get("steps") if isinstance(state, dict) else None
        if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
            self._resume_steps = steps
        self.watcher.load_state_dict(state)
        host = self._host
        if host is not None:  # attached already: start the rooms again from the checkpoint's state
            self.watcher.close()
            host.uninstall()
            self._host = None
            self.attach(host.model, host.wrapped_optimizers, host.step_schedulers(), gradient_clip_val=host.clipping[0],
                        gradient_clip_algorithm=host.clipping[1])  # type: ignore[arg-type]

    def __enter__(self) -> "FabricWatch":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        host = self._host
        if host is not None and isinstance(exc, RuntimeError) and _NONFINITE_CLIP_ERROR in str(exc) \
                and host.precision().scaler is not None:
            host.say("fabric.clip_gradients(..., error_if_nonfinite=True) raised on a step whose gradients "
                     "overflowed. Under 16-mixed the GradScaler skips such steps by design: pass "
                     "error_if_nonfinite=False and let it skip them.")
        # the loop failed: leave the run as found, keep what was written; no summary for a run that did not end
        self._finished = True
        try:
            self.watcher.close()
        finally:
            if host is not None:
                host.uninstall()
            self._host = None

    @property
    def attached(self) -> bool:
        """Whether this watch is attached to its loop (``attach`` called, not closed since)."""
        return self._host is not None

    def _need_host(self) -> "FabricHost":
        host = self._host
        if host is None:
            raise RuntimeError("call watch.attach(model, optimizer) once, after fabric.setup, before watch.step()")
        return host

    def __repr__(self) -> str:
        return f"FabricWatch(remediate={sorted(r.value for r in self.config.remedies)}, steps={self.steps})"


class _AsFabricRunsIt:
    """The unwrapped module, called the way Fabric's module wrapper calls it: inputs cast by the precision plugin,
    the forward under its autocast, outputs cast back. Without the wrapper's backward hook, which refuses a gradient
    not taken through ``fabric.backward`` (replays take theirs with ``torch.autograd.grad``), and without DDP's
    forward, which would expect an all-reduce the replay never makes. Attributes are the module's."""

    def __init__(self, module: nn.Module, precision: Any, host: "FabricHost") -> None:
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


class LoopLearningRates:
    """The learning rates each optimizer step ran with, as the loop set them, replayed with the step.

    LitGPT's ``pretrain.py`` sets the learning rate itself at the top of each iteration, with no scheduler to
    replay. The rates are noted at each step's first ``fabric.backward`` (by then the loop has set them, whether
    at the top of the iteration or through a scheduler after the previous step), only when they changed. In the
    snapshots and replays this stands with the step schedulers: a snapshot keeps the step it was taken after, and
    restoring it, or replaying a step, puts back the rates the next step ran with."""

    MAX_CHANGES = 1024

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.step_index = -1  # the optimizer step the live run (or a replay) is after
        self.changes: list[tuple[int, tuple[float, ...]]] = []  # (step, the rates it and the next ones ran with)

    def groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def note(self, step: int) -> bool:
        """Step ``step`` runs with the rates the param groups hold now; True when they changed since the last."""
        lrs = tuple(group["lr"] for group in self.groups())
        if self.changes and self.changes[-1][1] == lrs:
            return False
        self.changes.append((step, lrs))
        if len(self.changes) > self.MAX_CHANGES:
            del self.changes[: len(self.changes) - self.MAX_CHANGES]
        return True

    def rates_for(self, step: int) -> tuple[float, ...] | None:
        """The rates step ``step`` ran with, if it is one the live run has taken; else None."""
        if not self.changes or step > self.changes[-1][0] and step > self.step_index:
            return None
        return next((lrs for at, lrs in reversed(self.changes) if at <= step), None)

    def _apply(self, step: int) -> None:
        lrs = self.rates_for(step)
        groups = self.groups()
        if lrs is not None and len(lrs) == len(groups):
            for group, lr in zip(groups, lrs):
                group["lr"] = lr

    # the scheduler protocol the snapshots and replays use
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_index = int(state["step"])
        self._apply(self.step_index + 1)

    def step(self) -> None:
        self.step_index += 1
        self._apply(self.step_index + 1)


class _FabricStrategyView:
    """``strategy.precision_plugin`` as the remedies read it (the run's precision now): Fabric's strategy's
    ``precision``."""

    def __init__(self, fabric: Fabric) -> None:
        self._fabric = fabric

    @property
    def precision_plugin(self) -> Any:
        return self._fabric.strategy.precision


class FabricHost:
    """What only Fabric knows, for the :class:`~lightning_ampwatch.core.Host` protocol, and what the adapter
    installs on the run: the backward watch on the precision plugin, a look after the scaler's update (the loop's
    optimizer step ran; ``hold_lr_on_skip``) and, for models that draw random numbers, a forward pre-hook that keeps
    the RNG state a replay needs."""

    automatic = True  # one loss_fn per micro-batch, stepped by the loop: a step replays from its batches alone

    def __init__(self, watch: FabricWatch, model: Any, wrapped_optimizers: list[Any], schedulers: list[Any],
                 clipping: tuple[float | None, str] = (None, "norm")) -> None:
        fabric = watch.fabric
        self.clipping = clipping
        optimizers = [opt.optimizer for opt in wrapped_optimizers]  # the raw torch optimizers
        self.model = model  # what fabric.setup returned, as attach() got them
        self.wrapped_optimizers = wrapped_optimizers
        self._watch = watch
        self._fabric = fabric
        self.module: nn.Module = model.module  # the user's module, unwrapped (under DDP too)
        self.device = fabric.device
        self.is_global_zero = fabric.is_global_zero
        self.world_size = fabric.world_size
        self.backward_seen = False
        self.inputs_overflowed: str | None = None  # the dtype Fabric's input cast turned a finite input non-finite in
        self.scaler_updates = 0  # the loop's scaler updates since the last watch.step
        self.in_step = False  # inside watch.step/accumulate: what runs now (replays, remedies) is the watch's own
        self._optimizers = optimizers
        self._schedulers = schedulers
        # plain-number rates only (a tensor rate, as capturable Adam keeps it, is left to the loop's schedulers)
        self.loop_lrs = LoopLearningRates(optimizers) if all(
            isinstance(g.get("lr"), (int, float)) for opt in optimizers for g in opt.param_groups) else None
        self.lrs_noted = False  # this step's rates are noted (at its first fabric.backward)
        self.micro_batches = 0  # handed to accumulate() since the last step
        self.backward_calls = 0  # fabric.backward calls since the last step
        # why no step of this run is replayed (the loop does not hand over every micro-batch); None: they are
        self.refusal: str | None = None
        self._loss_fn_error: Exception | None = None  # loss_fn's exception, as it left a replay's call
        self._batch_index = 0  # micro-batches taken in so far (a replay's batch_idx)
        self._state: TrainState | None = None
        self._patched: list[tuple[Any, str, Any]] = []  # (object, attribute, the wrapper put there)
        self._rng_hook: Any = None
        self._held: tuple[list[tuple[Any, dict[str, Any]]], list[list[Any]]] | None = None
        self._batch_started = False
        self.in_loop = True
        self._remedy_target = SimpleNamespace(
            optimizers=optimizers,
            lr_scheduler_configs=[SimpleNamespace(scheduler=s, interval="step", frequency=1) for s in schedulers],
            strategy=_FabricStrategyView(fabric),
        )

    @property
    def watcher(self) -> RunWatcher:
        return self._watch.watcher

    # ------------------------------------------------------------------ Host: what the core reads

    @property
    def global_step(self) -> int:
        return self._watch.steps

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return self._optimizers

    @property
    def loggers(self) -> Sequence[Any]:
        return self._fabric.loggers

    @property
    def log_every(self) -> int:
        return self._watch.log_every_n_steps

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
        if self._patched and not any(obj is plugin for obj, _, _ in self._patched):
            self._watch_backward(plugin)
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
                return self._watch.loss_fn(self.module, batch)
            if torch.is_autocast_enabled(self.device.type):
                model: Any = _AsFabricRunsIt(self.module, precision, self)
                with torch.autocast(self.device.type, enabled=False):
                    return self._watch.loss_fn(model, batch)
            return self._watch.loss_fn(self.module, batch)
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
        name = getattr(self._watch.loss_fn, "__qualname__", None) or type(self._watch.loss_fn).__name__
        return f"{name} (the loss_fn)"

    def train_state(self) -> TrainState:
        unavailable = None
        if any(p.dtype in (torch.float16, torch.bfloat16) for p in self.module.parameters()):
            unavailable = ("the trajectory control is not available: the weights themselves are half precision "
                           "(a '16-true' or 'bf16-true' run), so there is no FP32 run to replay")
        self._state = TrainState(
            module=self.module, optimizers=list(self._optimizers),
            scaler=getattr(self._fabric.strategy.precision, "scaler", None),
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
        self._fabric.log_dict(metrics, step=self._watch.steps)

    def stop(self) -> None:
        self._watch.should_stop = True

    def say(self, message: str) -> None:
        if self.is_global_zero:
            _FABRIC_LOG.info(message)

    def say_once(self, message: str) -> None:
        self.watcher.say_once(message)

    # ------------------------------------------------------------------ the adapter's own bookkeeping

    def next_batch_index(self) -> int:
        """The micro-batch's index in the run (what a replay passes on as ``batch_idx``)."""
        index = self._batch_index
        self._batch_index += 1
        return index

    def accumulated(self, micro_batches: int) -> None:
        """The step being taken in ran on this many micro-batches: the trajectory replay divides each loss by it,
        as the loop did before ``fabric.backward``."""
        if self._state is not None:
            self._state.accumulate = micro_batches

    def note_lrs(self) -> None:
        """At a step's first backward: the rates it runs with. When the loop changed them since the last step, the
        ledger reads them again, so the step is recorded with the rates it ran with (a loop that sets them at the
        top of each iteration, after the previous step was taken in)."""
        self.lrs_noted = True
        loop_lrs = self.loop_lrs
        if loop_lrs is not None and loop_lrs.note(self._watch.steps):
            ledger = self.watcher.ledger
            if ledger is not None:
                ledger.read_param_groups(self._optimizers, lrs_now=True)

    def replays_refused(self) -> str | None:
        """The core asks before it replays a faulty step: why none may run (see :meth:`refuse_replays`), or None."""
        return self.refusal

    def user_failure(self, err: Exception) -> str | None:
        """The core's failure ``err`` said as the user's ``loss_fn``'s when that is what raised (itself, or a replay's
        error that carries its words); None otherwise."""
        failed, self._loss_fn_error = self._loss_fn_error, None
        return user_code_failure(failed, err, f"loss_fn {_named(self._watch.loss_fn)}")

    def batches_missing(self, step: int, calls: int, handed: int) -> None:
        """Step ``step`` ran ``calls`` ``fabric.backward`` calls, but only ``handed`` micro-batches were handed to the
        watch: the loop does not call ``watch.accumulate``. Said once; no faulty step is replayed from here on, since
        the step's batches the watch holds are not all of its batches."""
        if self.refusal is not None:
            return
        if self.scaler_updates > 1:  # not accumulation: the loop stepped several times between two watch.step calls
            self.refuse_replays(f"step {step} took in {self.scaler_updates} optimizer steps of the loop (watch.step "
                                "was not called after each): a replay would run on batches that are not the step's")
            self.say_once(f"watch.step() came after {self.scaler_updates} optimizer steps of the loop: call "
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
        treatment = getattr(self.watcher, "treatment", None)
        if treatment is not None:
            treatment.replay_episode = False  # a rerun trains on the batches it holds: not the episode's

    def batch_over(self) -> None:
        """After ``watcher.route.batch_end``: the next forward is the next micro-batch's."""
        self.inputs_overflowed = None
        self._batch_started = False
        self.backward_seen = False
        self.scaler_updates = 0

    # ------------------------------------------------------------------ what is installed on the run

    def install(self) -> None:
        self._watch_backward(self._fabric.strategy.precision)
        scaler = getattr(self._fabric.strategy.precision, "scaler", None)
        if scaler is not None:  # the optimizer step Fabric runs ends in the scaler's update, skipped or not
            self._patch(scaler, "update", _AfterScalerUpdate(scaler, self))
        if uses_rng(self.module):  # only a model that draws random numbers needs the RNG state of each batch
            self._rng_hook = self.module.register_forward_pre_hook(self._before_forward)

    def uninstall(self) -> None:
        """Put back everything :meth:`install` changed; a wrapper someone put on top of ours since stays."""
        for obj, name, wrapper in reversed(self._patched):
            if obj.__dict__.get(name) is wrapper:
                del obj.__dict__[name]
        self._patched.clear()
        if self._rng_hook is not None:
            self._rng_hook.remove()
            self._rng_hook = None

    def _patch(self, obj: Any, name: str, wrapper: Any) -> None:
        obj.__dict__[name] = wrapper
        self._patched.append((obj, name, wrapper))

    def _watch_backward(self, plugin: Any) -> None:
        self._patch(plugin, "backward", _WatchedBackward(plugin, self))

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self._batch_started and self.in_loop:
            self._batch_started = True
            route = self._watch.watcher.route
            if route.wants_batch_start:
                route.batch_start()  # catches its own failures

    # ------------------------------------------------------------------ hold_lr_on_skip

    def after_scaler_update(self) -> None:
        """The scaler has just updated: the loop's optimizer step ran (taken or skipped). With ``hold_lr_on_skip``, a
        skipped step's schedulers are held: their state (and the LRs they set) from before the loop steps them is
        kept, to be put back in ``watch.step``. Only skipped steps cost anything; the skip is the step hook's host
        flag, no device read (a fused optimizer excepted: its found-inf flag is read, as under ``AmpWatch``)."""
        if self.in_step:
            return  # a replay's or a remedy's update, not the loop's
        self.scaler_updates += 1
        ledger = self._watch.watcher.ledger
        if not (self._watch.hold_lr_on_skip and self._schedulers) or ledger is None \
                or not ledger.last_step_skipped():
            return
        self._held = ([(s, copy.deepcopy(s.state_dict())) for s in self._schedulers],
                      [[group["lr"] for group in opt.param_groups] for opt in self._optimizers])

    def optimizer_stepped(self) -> bool:
        """Whether the loop ran an optimizer step since the last ``watch.step``: under a scaler its update ran
        (whether it took the step or skipped it); without one the optimizer's step hook saw a step."""
        if getattr(self._fabric.strategy.precision, "scaler", None) is not None:
            return self.scaler_updates > 0
        ledger = self._watch.watcher.ledger
        return ledger is None or ledger.taken.taken

    def put_back_held_schedulers(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        states, lrs = held
        for scheduler, state in states:
            scheduler.load_state_dict(state)
        for opt, group_lrs in zip(self._optimizers, lrs):
            for group, lr in zip(opt.param_groups, group_lrs):
                group["lr"] = lr

    # ------------------------------------------------------------------ a loop without fabric.backward

    def unseen_backward(self, loss: Tensor) -> None:
        """``watch.step`` got a loss that did not go through ``fabric.backward`` (``loss.backward()``, which Fabric
        allows only without a scaler): without a scaler it is the step's loss as it is; with one it cannot be read."""
        if getattr(self._fabric.strategy.precision, "scaler", None) is None:
            if not self.lrs_noted:
                self.note_lrs()
            self._watch.watcher.route.before_backward(loss)
            self.backward_seen = True
        else:
            self.say_once("watch.step() got a loss, but fabric.backward() was not called since the last step; "
                          "under a GradScaler the watch reads each step in fabric.backward, so this step is not "
                          "counted. Call fabric.backward(loss).")


class _WatchedBackward:
    """Stands in for the precision plugin's ``backward`` (on the instance): the loss goes to the watch as Fabric
    hands it to autograd, scaled by the plugin's GradScaler when there is one. The scaler's ``scale`` is looked at
    only for the length of the call."""

    def __init__(self, plugin: Any, host: FabricHost) -> None:
        self.original = type(plugin).backward.__get__(plugin)
        self.__wrapped__ = self.original  # Fabric asks whether the plugin overrides backward: it still does
        self.plugin = plugin
        self.host = host

    def __call__(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        host = self.host
        host.backward_seen = True
        host.backward_calls += 1
        watcher = host.watcher
        if not host.lrs_noted:
            try:
                host.note_lrs()
            except Exception as err:  # noqa: BLE001 - the adapter's own failure never reaches the loop
                watcher.internal_failure("fabric.backward", err)
        scaler = getattr(self.plugin, "scaler", None)
        if scaler is None:
            watcher.route.before_backward(tensor)
            return self.original(tensor, *args, **kwargs)
        seen = _ScaledLoss(scaler, watcher)
        scaler.__dict__["scale"] = seen
        try:
            return self.original(tensor, *args, **kwargs)
        finally:
            scaler.__dict__.pop("scale", None)
            if not seen.seen:  # a plugin that scales some other way: its loss is not the one the ledger can read
                host.say_once(f"{type(self.plugin).__name__} did not scale the loss through its GradScaler's "
                              "scale(); FabricWatch cannot read the loss of this run's steps.")


def _named(fn: Any) -> str:
    """A callable's name as the user wrote it (``step_loss``), else its type's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


class _ScaledLoss:
    """Stands in for the scaler's ``scale`` for the length of one ``backward``: the first scaled loss goes to the
    watch, as Lightning's ``on_before_backward`` hands it over (scaled)."""

    __slots__ = ("scaler", "watcher", "seen")

    def __init__(self, scaler: Any, watcher: RunWatcher) -> None:
        self.scaler, self.watcher, self.seen = scaler, watcher, False

    def __call__(self, outputs: Any) -> Any:
        out = type(self.scaler).scale(self.scaler, outputs)
        if not self.seen and isinstance(out, Tensor):
            self.seen = True
            self.watcher.route.before_backward(out)
        return out


class _AfterScalerUpdate:
    """Stands in for the GradScaler's ``update`` (on the instance; the scaler's ``state_dict`` lists its fields, so a
    checkpoint never holds this): after the real update, the host learns that the loop's optimizer step ran, and
    ``hold_lr_on_skip`` whether it was skipped, before the loop steps its schedulers."""

    def __init__(self, scaler: Any, host: FabricHost) -> None:
        self.original = type(scaler).update.__get__(scaler)
        self.host = host

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.original(*args, **kwargs)
        try:
            self.host.after_scaler_update()
        except Exception as err:  # noqa: BLE001 - the adapter's own failure never reaches the loop
            self.host.watcher.internal_failure("the scaler's update", err)
        return out
