"""``AmpWatch``: the Lightning adapter. Lightning's hooks become :class:`~lightning_ampwatch.core.RunWatcher` calls;
:class:`LightningHost` answers what only the Trainer knows; the checkpoint state is the watcher's. Little else.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any, Callable, ContextManager, Literal, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_ampwatch import compat, distributed, sharding
from lightning_ampwatch.config import UNRECOVERABLE_MODES, WatchConfig  # noqa: F401 - re-exported
from lightning_ampwatch.core import RunWatcher
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.host import user_code_failure
from lightning_ampwatch.machine import AmpStateMachine, Thresholds
from lightning_ampwatch.remedies import AppliedRemedy, HoldLrOnSkip, LrCeiling, RemedyContext
from lightning_ampwatch.signals import PrecisionInfo, resolve_precision
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch.trajectory.snapshot import Snapshot
from lightning_ampwatch.trajectory.state import TrainState


#: Lightning hooks called at every training step that AmpWatch has no use for. During a fit they are ``None`` on the
#: instance, where Lightning passes over a hook that is not callable (:func:`compat.skips_uncallable_hooks`): each
#: hook Lightning dispatches to a callback costs a profiler context and a call, per step, whether the hook does
#: anything or not (about 2 us on a 2-core CPU, more than AmpWatch's own work in most of its hooks).
#: Why the hooks are idled on the instance at all: the figures measured against one route are beside
#: ``StepRoute.take_lean`` (steps/route.py).
IDLE_STEP_HOOKS = ("on_after_backward", "on_before_zero_grad")
#: Per-step hooks AmpWatch needs only at times, in the order of ``StepRoute.wanted_calls``: idle (``None``) while the
#: watcher wants no call there. ``on_train_batch_start``: an RNG state to keep, a probe to arm. On the lean route
#: (``StepRoute.take_lean``): ``on_before_backward`` while the recipe guard reads the loss's graph (the first backward),
#: ``on_before_optimizer_step`` while a probe is armed.
WANTED_STEP_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step")
_ABSENT = object()


class LightningHost:
    """What only the Trainer knows, for the :class:`~lightning_ampwatch.core.Host` protocol. Made at fit start,
    dropped at its end (it holds the trainer)."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        self.module = pl_module
        self.device = pl_module.device
        self.automatic = bool(pl_module.automatic_optimization)
        self.is_global_zero = trainer.is_global_zero
        self.world_size = distributed.world_size()
        # the default snapshot budget is the node's, shared by the processes training on it
        self.processes_per_node = max(1, int(getattr(trainer, "num_devices", 1) or 1))
        self._metrics: compat.StepMetrics | None = None
        # the checkpoint files in the folders now are not this fit's to roll back to (only the one it resumed from)
        self._checkpoints = compat.FitCheckpoints(trainer)
        self._step_error: Exception | None = None  # what training_step raised in a replay, for user_failure

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        return self.trainer.optimizers

    @property
    def loggers(self) -> Sequence[Any]:
        return self.trainer.loggers

    @property
    def log_every(self) -> int:
        return int(self.trainer.log_every_n_steps)

    @property
    def log_dir(self) -> str:
        return self.trainer.log_dir or self.trainer.default_root_dir

    def precision(self) -> PrecisionInfo:
        return resolve_precision(self.trainer.precision_plugin, getattr(self.trainer.strategy, "model", None))

    def forward_context(self) -> ContextManager[Any]:
        # looked up at each replay: a bf16 fallback swaps the plugin mid-run
        return self.trainer.precision_plugin.forward_context()

    def wrapped_module(self) -> torch.nn.Module:
        """The module as the strategy wraps it (DDP, FSDP1's root wrapper, an FSDP2 module), looked up each time."""
        model = self.trainer.strategy.model
        return model if isinstance(model, torch.nn.Module) else self.module

    def step_loss(self, batch: Any, batch_idx: int) -> Any:
        # through a root FSDP1 wrapper's forward, so that its parameters are gathered (Lightning's own forward
        # redirection); a plain call everywhere else
        try:
            return sharding.training_step(self.wrapped_module(), self.module, batch, batch_idx)
        except Exception as err:
            self._step_error = err  # the user's code failed under a replay, not the watch (user_failure)
            raise

    def user_failure(self, err: Exception) -> str | None:
        failed, self._step_error = self._step_error, None
        return user_code_failure(failed, err, f"{type(self.module).__name__}.training_step")

    def train_state(self) -> TrainState:
        return TrainState.from_trainer(self.trainer, self.module)

    def step_schedulers(self) -> list[Any]:
        return [c.scheduler for c in self.trainer.lr_scheduler_configs if c.interval == "step"]

    def remedy_context(self, scaler: Any, safe_scale: float | None, guards: RecipeGuards) -> RemedyContext:
        if scaler is None:  # DeepSpeed fp16: the scaler remedies act on its own loss scaler, through its view
            scaler = self.precision().loss_scale
        return RemedyContext(trainer=self.trainer, module=self.module, scaler=scaler, device=self.module.device,
                             safe_scale=safe_scale, guards=guards, lightning_module=self.module)

    def rollback_unavailable(self) -> str | None:
        """Why no checkpoint can be rolled back to in this fit, or None. Every strategy Lightning loads checkpoints
        for can roll back now: a sharded one (FSDP1, FSDP2) loads a checkpoint into the live model before its step
        can be checked, and the live state, kept on the host meanwhile, is put back when it turns out too new."""
        return None

    def rollback_to_checkpoint(self, before: int, ready: Callable[[int], None] | None = None
                               ) -> tuple[str | None, int | None]:
        """Only a file this fit wrote, or the one it resumed from, holding the whole training state
        (:class:`~lightning_ampwatch.compat.FitCheckpoints`). A sharded strategy loads a checkpoint (a sharded
        directory included) into the live model before it can be checked: the live state is kept on the host
        meanwhile and put back when it turns out too new, or unfit. ``ready``: see ``FitCheckpoints.roll_back``."""
        if self.rollback_unavailable() is not None:
            return None, None
        state = TrainState.from_trainer(self.trainer, self.module)
        if not sharding.replay_needs_all_ranks(state.root):
            return self._checkpoints.roll_back(before, ready=ready)

        def keep_live() -> Any:
            live = Snapshot.take(state, -1)
            return lambda: live.restore(state)

        return self._checkpoints.roll_back(before, keep_live=keep_live, ready=ready)

    def rollback_passed_over(self) -> str | None:
        """The checkpoint files the latest rollback passed over, and why (None: none was)."""
        return self._checkpoints.passed_over_sentence()

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Through Lightning's logger connector, in the same call as the step's own ``self.log`` values."""
        connector = compat.logger_connector(self.trainer)
        if self._metrics is None or self._metrics.connector is not connector:
            self._metrics = compat.StepMetrics(connector)
        self._metrics.hold(compat.batches_that_stepped(self.trainer), metrics)

    def release_metrics(self) -> None:
        metrics, self._metrics = self._metrics, None
        if metrics is not None:
            metrics.detach()

    def stop(self) -> None:
        self.trainer.should_stop = True

    def say(self, message: str) -> None:
        rank_zero_info(message)


class AmpWatch(Callback):
    r"""Watch a mixed-precision run and name the cause when it goes wrong.

    Every optimizer step it learns, at no extra host-device synchronisation, whether the GradScaler skipped the
    step, the scale and its growth, the loss and the learning rate; on an anomaly it reads the loss and the batch,
    replays the faulty step (with probes, and in float32 as a control), classifies the episode into the AMP
    failure taxonomy and reports it once: a console panel (rank zero), a JSON line in
    `<log_dir>/ampwatch/diagnoses.jsonl`, text for the loggers that take it. With `remediate` it also fixes the
    run mid-training and verifies that it recovered.

    Args:
        remediate: `False` (diagnose only), `True` (every remedy except `reduce_lr`), `"all"` (every remedy,
            `reduce_lr` included), or one remedy name or an iterable of them: `lower_init_scale`, `slow_growth`,
            `fp32_island`, `bf16_fallback`, `reduce_lr`, `unscale_before_clip`.
        on_unrecoverable: what to do about an alarm that no allowed remedy fixes: `"warn"` (report and go on),
            `"stop"` (set `trainer.should_stop` for a clean end) or `"raise"` (`AmpWatchError`, with the
            diagnosis as `.diagnosis`).
        control_replay: on the first alarm of an episode, replay the offending batch without autocast (the FP32
            control). `False` also turns off the FP32 trajectory control and the snapshots it keeps, so a
            rollback can then only go back to a `ModelCheckpoint` file.
        localize: name the first module or parameter that overflowed (probes armed for the replay only).
        hold_lr_on_skip: a step the scaler skipped does not advance a step-interval LR scheduler either.
        verbose: `True` prints each diagnosis once on the console (rank zero) as a compact panel with the
            evidence rows its finding rests on, and the end-of-fit summary; `"full"` prints every evidence row;
            `False` prints nothing (the event log and the loggers still get everything).
        thresholds: when patterns become alarms (streak lengths, windows, the input limit, the loss trend);
            `None` means `Thresholds()`, which suits a default GradScaler.
        log_dir: where `ampwatch/diagnoses.jsonl` and `ampwatch/timeline.jsonl` go; `None` means the trainer's
            log directory (`default_root_dir` without a logger). A leading `~` is expanded.
        name: tells two AmpWatch instances in one Trainer apart (their checkpoint state is filed under
            `AmpWatch[name]`); leave it `None` for one instance (state under `AmpWatch`).
        snapshot_every: keep an in-memory snapshot (weights, buffers, optimizer, scaler, step schedulers, RNG)
            every this many optimizer steps, the newest two, for the FP32 trajectory control and for rollback;
            `0` turns snapshots off. `"auto"` (the default): every 20 steps at first; once the first snapshots
            have been timed, as often as keeps their copies within 0.25% of the training time (said once when that
            lengthens the interval; under DDP it stays at 20, since the ranks snapshot at the same steps).
        snapshot_budget: the host memory, in bytes, that snapshots and the batches since them may hold together;
            `None` means a tenth of the host's RAM, at most 8 GiB. When one snapshot does not fit, snapshots are
            off for the run, and AmpWatch says so once.
        rollback: before a remedy is applied, go back to the newest snapshot from before the step that may have
            done the damage (else the newest `ModelCheckpoint` file from before it) and skip the episode's
            batches; `False` applies remedies in place.
        replay_episode: after a rollback to a snapshot, train on the episode's batches again with the remedy in
            effect, instead of skipping them (the usual practice after a loss spike is to skip them).

    Attributes:
        diagnoses: every `Diagnosis` of the current fit, in the order they were made; a diagnosis updated later
            (a remedy's outcome, a withdrawn `NORMAL_SCALING`) is replaced in place by its newer record. Under
            `ddp_spawn` it is filled from rank zero when the fit returns.
        applied: every remedy applied in this run, in order, as `AppliedRemedy(name, step, finding, details)`
            (kept across a resume).

    Raises:
        ValueError: at construction, for an invalid argument, naming the value and the valid ones.
        AmpWatchError: from `trainer.fit`, with `on_unrecoverable="raise"`, when an alarm is left without a
            remedy that recovered.

    Example:
        ```python
        import torch
        from lightning.pytorch import Trainer
        from lightning.pytorch.plugins.precision import MixedPrecision
        from lightning_ampwatch import AmpWatch

        watch = AmpWatch(remediate="all", on_unrecoverable="stop")
        trainer = Trainer(precision="16-mixed", callbacks=[watch])  # on a GPU
        # on a CPU, real float16 needs the plugin (precision="16-mixed" there means bf16):
        trainer = Trainer(accelerator="cpu", callbacks=[watch],
                          plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
        trainer.fit(model)
        for d in watch.diagnoses:
            print(d.finding, d.step, d.location, d.advice, d.remedy, d.outcome)
        ```
    """

    def __init__(
        self,
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
    ) -> None:
        super().__init__()
        config = WatchConfig(remediate, on_unrecoverable, control_replay, localize, hold_lr_on_skip, verbose,
                             thresholds, log_dir, name, snapshot_every, snapshot_budget, rollback, replay_episode)
        self.config = config
        self.remedies = config.remedies
        self.on_unrecoverable, self.control_replay, self.localize = on_unrecoverable, control_replay, localize
        self.hold_lr_on_skip, self.verbose, self.thresholds = hold_lr_on_skip, verbose, config.thresholds
        self.log_dir, self.name = config.log_dir, name
        self.snapshot_every, self.snapshot_budget = snapshot_every, snapshot_budget
        self.rollback, self.replay_episode = rollback, replay_episode
        self.watcher = RunWatcher(config)
        self._host: LightningHost | None = None
        # the per-step hooks made idle for a fit (instance attributes set to None); the WANTED_STEP_HOOKS as they
        # were before the fit (the instance's own attribute, or _ABSENT for the class's method; empty: not managed)
        self._idled: list[str] = []
        self._saved_hooks: dict[str, Any] = {}
        self._wanted_seen: Any = None  # the route's ``wanted_calls`` the hooks were last set from
        self._lean = False  # the lean route: the loss and the step count handed over at the batch's end
        compat.carry_spawn_results(AmpWatch, AmpWatch._spawn_results, AmpWatch._take_spawn_results)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # a ddp_spawn worker unpickles the callback: its launcher must send the results home
        compat.carry_spawn_results(AmpWatch, AmpWatch._spawn_results, AmpWatch._take_spawn_results)

    def _spawn_results(self) -> dict[str, Any]:
        return {"diagnoses": [d.to_dict() for d in self.diagnoses], "applied": [a.to_dict() for a in self.applied]}

    def _take_spawn_results(self, results: dict[str, Any]) -> None:
        self.diagnoses = [Diagnosis.from_dict(d) for d in results["diagnoses"]]
        self.applied = [AppliedRemedy.from_dict(a) for a in results["applied"]]

    @functools.cached_property
    def state_key(self) -> str:  # type: ignore[override]
        # Not the default (which includes the arguments): a resume with other flags keeps its state. Cached: Lightning
        # reads it for every hook it calls on every callback (its profiler's name), a dozen times a step.
        return self.config.state_key

    @property
    def diagnoses(self) -> list[Diagnosis]:
        """Every diagnosis of the run, in order; a remedy's outcome updates its record in place."""
        return self.watcher.diagnoses

    @diagnoses.setter
    def diagnoses(self, value: list[Diagnosis]) -> None:
        self.watcher.diagnoses = list(value)

    @property
    def applied(self) -> list[AppliedRemedy]:
        """Every remedy applied in this run, in order (also after a resume)."""
        return self.watcher.applied

    @applied.setter
    def applied(self, value: list[AppliedRemedy]) -> None:
        self.watcher.applied = value

    @property
    def machine(self) -> AmpStateMachine | None:
        return self.watcher.caught_up().machine

    @property
    def event_log(self) -> Any:
        """The event log of the current fit (its ``path`` and ``dir``), or None before the first fit."""
        return self.watcher.event_log

    @property
    def precision(self) -> Any:
        return self.watcher.precision

    # ------------------------------------------------------------------ hooks -> watcher calls

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._host = host = LightningHost(trainer, pl_module)
        self.watcher.start(host)
        if self.hold_lr_on_skip and not self.watcher.disabled:
            HoldLrOnSkip.install(pl_module, self.watcher.last_step_skipped, host.step_schedulers)
        self._idle_hooks()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        watcher = self.watcher
        watcher.begin_training()
        self._lean = bool(self._saved_hooks) and self._host is not None and watcher.route.take_lean(
            self._host, compat.optimizer_steps_done(trainer))
        self._sync_hooks()

    # The per-step hooks call straight through to the watcher's route (``watcher.route``: an attribute read, no call
    # added), whose calls catch their own failures.

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        route = self.watcher.route
        if route.wants_batch_start:
            route.batch_start()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self.watcher.route.before_backward(loss)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        self.watcher.route.before_optimizer_step(optimizer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        route = self.watcher.route
        if self._lean:  # Lightning's own detached copy of the loss, and its count of optimizer steps
            loss = outputs.get("loss") if isinstance(outputs, dict) else None
            if loss is not None and route.express(loss, batch, batch_idx):
                return  # a healthy step in one call (nothing about the hooks can have changed)
            route.batch_end(batch, batch_idx, loss, compat.optimizer_steps_done(trainer))
        else:
            route.batch_end(batch, batch_idx)
        if route.wanted_calls is not self._wanted_seen:  # (see _sync_hooks)
            self._sync_hooks()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._release_metrics()
        self.watcher.finish()
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hook when fit raises; this is the one hook that still runs.
        self._close()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        self._release_metrics()
        self._wake_hooks()
        self.watcher.close()
        if self._host is not None:
            try:
                HoldLrOnSkip.uninstall(self._host.module)
                LrCeiling.uninstall(self._host.module)  # reduce_lr's, put back by reapply on a resume
            except Exception as err:  # noqa: BLE001 - clean-up never raises
                self.watcher.internal_failure("clean-up", err)
        self._host = None
        # Lightning binds the module's self.log and self.log_dict onto every callback at fit start, and leaves them:
        # an instance kept (or pickled for a ddp_spawn fit) after the fit would hold the model through them
        for name in ("log", "log_dict"):
            bound = self.__dict__.get(name)
            if bound is not None and isinstance(getattr(bound, "__self__", None), torch.nn.Module):
                del self.__dict__[name]

    # ------------------------------------------------------------------ hooks Lightning need not call

    def _idle_hooks(self) -> None:
        """At fit start: the per-step hooks AmpWatch has no use for are made ``None`` on the instance (unless a
        subclass or the instance gives them a body), and the ones it needs only at times are managed by
        :meth:`_sync_hooks`; only where Lightning passes over hooks that are not callable."""
        self._wake_hooks()
        if not compat.skips_uncallable_hooks():
            return
        for name in IDLE_STEP_HOOKS:
            if name not in self.__dict__ and getattr(type(self), name) is getattr(Callback, name):
                setattr(self, name, None)
                self._idled.append(name)
        # only the class's own methods, or what the instance put there (a timer's wrapper), are ever idled
        self._saved_hooks = {name: self.__dict__.get(name, _ABSENT) for name in WANTED_STEP_HOOKS
                             if getattr(type(self), name) is getattr(AmpWatch, name)}
        self._sync_hooks()

    def _sync_hooks(self) -> None:
        """Each hook of ``WANTED_STEP_HOOKS`` callable exactly while the watcher wants that call
        (``StepRoute.wanted_calls``), ``None`` on the instance otherwise. Checked after every batch, where the
        wishes change, and at train start."""
        self._wanted_seen = wanted = self.watcher.route.wanted_calls
        for name, on in zip(WANTED_STEP_HOOKS, wanted):
            saved = self._saved_hooks.get(name)
            if saved is None:
                continue  # not managed this fit
            if on:
                self._put_back(name, saved)
            else:
                setattr(self, name, None)

    def _wake_hooks(self) -> None:
        """Every hook callable again, as before the fit (its end, an exception, a second fit)."""
        for name in self._idled:
            if self.__dict__.get(name, _ABSENT) is None:
                del self.__dict__[name]
        self._idled = []
        saved, self._saved_hooks = self._saved_hooks, {}
        for name, before in saved.items():
            if self.__dict__.get(name, _ABSENT) is None:
                self._put_back(name, before)
        self._wanted_seen = None
        self._lean = False

    def _put_back(self, name: str, before: Any) -> None:
        """A managed hook as it was before the fit: the instance's own attribute, or (``_ABSENT``) the class's."""
        if before is _ABSENT:
            self.__dict__.pop(name, None)
        else:
            setattr(self, name, before)

    def _release_metrics(self) -> None:
        host, reporters = self._host, self.watcher.reporters
        if host is not None and reporters is not None:  # a broken logger costs the metrics, never the run
            reporters.sink("loggers", host.release_metrics)

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.watcher.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning loads callback states before on_fit_start builds the rooms; they are restored there.
        self.watcher.load_state_dict(state_dict)
