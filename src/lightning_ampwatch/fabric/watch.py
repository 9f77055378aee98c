"""``FabricWatch``: the public front of the Fabric adapter. A hand-written Fabric loop's calls become
:class:`~lightning_ampwatch.core.RunWatcher` calls: ``fabric.backward(loss)`` and the optimizer step reach the watch
through what :class:`~lightning_ampwatch.fabric.patches.LoopPatches` installs on the run; ``watch.step(batch, loss)``
is the optimizer-step boundary, once per optimizer step; ``watch.accumulate(batch)`` hands over the micro-batches in
between. :class:`~lightning_ampwatch.fabric.host.FabricHost` answers what only Fabric knows.
"""

from __future__ import annotations

import inspect
import os
import weakref
from dataclasses import replace
from typing import Any, Callable, Iterable, Literal, Union

from lightning.fabric import Fabric
from lightning.fabric.wrappers import is_wrapped
from torch import Tensor

from lightning_ampwatch.config import WatchConfig
from lightning_ampwatch.core import RunWatcher
from lightning_ampwatch.fabric.host import FabricHost, named
from lightning_ampwatch.machine import AmpStateMachine, Thresholds
from lightning_ampwatch.remedies import AppliedRemedy
from lightning_ampwatch.taxonomy import Diagnosis

#: Optimizer steps between two log steps (metrics to ``fabric.loggers``, one packed read), as Lightning's default.
DEFAULT_LOG_EVERY_N_STEPS = 50
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
                raise ValueError(f"loss_fn={named(loss_fn)}({', '.join(signature.parameters)}) is not valid: "
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
            host.patches.install()
        except Exception as err:  # noqa: BLE001 - a watch that cannot install watches less, the loop goes on
            host.patches.uninstall()
            self.watcher.internal_failure("attach", err)
        return self

    def accumulate(self, batch: Any) -> None:
        """Gradient accumulation: a micro-batch whose gradients wait for the next optimizer step. Call it after
        ``fabric.backward`` for every micro-batch but the last one of a step, whose batch goes to :meth:`step`."""
        host = self._need_host()
        loop = host.loop
        loop.in_step = True
        try:
            self.watcher.route.batch_end(batch, loop.next_batch_index())
        finally:
            loop.in_step = False
            loop.micro_batches += 1
            host.batch_over()

    def step(self, batch: Any, loss: Tensor | None = None) -> None:
        """The optimizer step is over (after ``optimizer.step()``, ``zero_grad()`` and the schedulers' ``step()``):
        take it in. ``batch`` is what ``loss_fn`` gets again if the step has to be replayed; ``loss`` the loss the
        loop computed (the watch reads the one handed to ``fabric.backward``; this one tells a loop that called
        ``loss.backward()`` instead)."""
        host = self._need_host()
        loop = host.loop
        try:
            if not loop.backward_seen and isinstance(loss, Tensor):
                loop.unseen_backward(loss)
            if not loop.optimizer_stepped():
                host.say_once("watch.step() was called without an optimizer step since the last one; it is taken as "
                              "a micro-batch of gradient accumulation. Call watch.step() once per optimizer step, and "
                              "watch.accumulate(batch) for the micro-batches in between.")
                self.accumulate(batch)
                return
            if not loop.backward_seen and not isinstance(loss, Tensor):
                host.say_once("watch.step() got no loss, and fabric.backward() was not called since the last step: "
                              "FabricWatch has no loss to judge such a step by, and does not count it. Pass the loss, "
                              "watch.step(batch, loss), or call fabric.backward(loss).")
            handed = loop.micro_batches + 1  # the batches the loop handed over: accumulate()'s and this one
            if loop.backward_calls > handed:
                host.batches_missing(self.steps, loop.backward_calls, handed)
            loop.put_back_held_schedulers()
        except Exception as err:  # noqa: BLE001 - the adapter's own failure never reaches the loop
            self.watcher.internal_failure("watch.step", err)
        watcher = self.watcher
        loop.in_step = True
        try:
            watcher.route.before_optimizer_step(host.optimizers[0])
            self.steps += 1
            host.accumulated(loop.micro_batches + 1)
            if loop.loop_lrs is not None:
                loop.loop_lrs.step_index = self.steps - 1  # what a snapshot taken after this step keeps
            watcher.route.batch_end(batch, loop.next_batch_index())  # raises only AmpWatchError (on_unrecoverable)
        finally:
            loop.in_step = False
            loop.step_over()
            host.batch_over()

    def close(self) -> None:
        """The end of the loop: what is in flight resolved, the summary printed, every hook and patch removed.
        Idempotent; ``with FabricWatch(...) as watch:`` calls it. An :meth:`attach` after it starts a new watch, its
        steps counted from 0 (``watch.load_state_dict(watch.state_dict())`` before it carries on instead)."""
        host = self._host
        if host is None:
            return
        host.batch_over()
        host.loop.in_loop = False  # forwards from here on are replays: no RNG state to keep for them
        try:
            if not self._finished:
                self._finished = True
                self.watcher.finish()  # calls watcher.close()
        finally:
            self.watcher.close()
            host.patches.uninstall()
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
            host.patches.uninstall()
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
                host.patches.uninstall()
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
