"""``AmpWatch``: the Lightning adapter. Hooks in, wiring between the rooms, checkpoint state; little else.

Kept thin on purpose (the way ``ThroughputMonitor`` sits on ``Throughput``): the step bookkeeping lives in
:mod:`~lightning_ampwatch.steps`, the decisions in :mod:`~lightning_ampwatch.machine`, when and how to look in
:mod:`~lightning_ampwatch.investigate`, the fixes in :mod:`~lightning_ampwatch.remedies` and everything people
read in :mod:`~lightning_ampwatch.reporters`.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterable
from typing import Any, Callable, Literal, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_ampwatch import distributed
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.investigate import Investigations, Investigator, TrajectoryControl
from lightning_ampwatch.machine import AmpStateMachine, Thresholds
from lightning_ampwatch.probes import uses_rng
from lightning_ampwatch.remedies import (
    AppliedRemedy,
    Effect,
    HoldLrOnSkip,
    RemedyContext,
    RemedyPolicy,
    parse_remediate,
    reapply_all,
)
from lightning_ampwatch.remedies.treatment import Site, Treatment
from lightning_ampwatch.reporters import VERBOSE_MODES, Reporters
from lightning_ampwatch.signals import resolve_precision, scaler_config
from lightning_ampwatch.steps import ResolvedStep, StepLedger
from lightning_ampwatch.summary import RunStats
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis
from lightning_ampwatch.trajectory import SnapshotRing, TrainState

UNRECOVERABLE_MODES = ("warn", "stop", "raise")
#: The checkpoint state's layout; a state of another version is set aside with a warning, never half-read.
STATE_VERSION = 2
#: Internal failures after which AmpWatch switches itself off for the run (each is warned once).
MAX_FAILURES = 5

F = TypeVar("F", bound=Callable[..., Any])


def _guarded(hook: F) -> F:
    """Run a hook so that an internal failure is reported once and never reaches the training loop."""

    @functools.wraps(hook)
    def wrapper(self: "AmpWatch", *args: Any, **kwargs: Any) -> Any:
        if self._disabled:
            return None
        try:
            return hook(self, *args, **kwargs)
        except AmpWatchError:
            raise
        except Exception as err:  # noqa: BLE001 - the point is that nothing escapes
            self._internal_failure(hook.__name__, err)
            return None

    return wrapper  # type: ignore[return-value]


class _ForwardContext:
    """The trainer's current forward context (autocast), looked up at each replay: a bf16 fallback swaps the
    plugin mid-run. A small object rather than a lambda so that the callback pickles."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def __call__(self) -> Any:
        return self.trainer.precision_plugin.forward_context()


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
            `0` turns snapshots off.
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
        snapshot_every: int = 20,
        snapshot_budget: int | None = None,
        rollback: bool = True,
        replay_episode: bool = False,
    ) -> None:
        super().__init__()
        self.remedies = parse_remediate(remediate)
        if on_unrecoverable not in UNRECOVERABLE_MODES:
            raise ValueError(f"on_unrecoverable={on_unrecoverable!r} is not valid; use one of {UNRECOVERABLE_MODES}")
        for flag, value in (("control_replay", control_replay), ("localize", localize),
                            ("hold_lr_on_skip", hold_lr_on_skip), ("rollback", rollback),
                            ("replay_episode", replay_episode)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag}={value!r} is not valid; use True or False")
        if not any(verbose is mode or (isinstance(mode, str) and verbose == mode) for mode in VERBOSE_MODES):
            raise ValueError(f"verbose={verbose!r} is not valid; use True or False, or \"full\" (every evidence row "
                             "on the console)")
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise ValueError(f"thresholds={thresholds!r} is not valid; use lightning_ampwatch.Thresholds(...) or None")
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"log_dir={log_dir!r} is not valid; use a path (str or os.PathLike) or None")
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"name={name!r} is not valid; use a non-empty string or None")
        if not isinstance(snapshot_every, int) or isinstance(snapshot_every, bool) or snapshot_every < 0:
            raise ValueError(f"snapshot_every={snapshot_every!r} is not valid; use a whole number of steps (0: off)")
        if snapshot_budget is not None and (not isinstance(snapshot_budget, int) or isinstance(snapshot_budget, bool)
                                            or snapshot_budget <= 0):
            raise ValueError(f"snapshot_budget={snapshot_budget!r} is not valid; use a positive number of bytes or "
                             "None (a tenth of the host's RAM, at most 8 GiB)")
        self.on_unrecoverable = on_unrecoverable
        self.control_replay = control_replay
        self.localize = localize
        self.hold_lr_on_skip = hold_lr_on_skip
        self.verbose = verbose
        self.thresholds = thresholds or Thresholds()
        self.log_dir = None if log_dir is None else os.path.expanduser(os.fspath(log_dir))
        self.name = name
        self.snapshot_every = snapshot_every
        self.snapshot_budget = snapshot_budget
        self.rollback = rollback
        self.replay_episode = replay_episode

        self.diagnoses: list[Diagnosis] = []
        self.machine: AmpStateMachine | None = None
        self.reporters: Reporters | None = None
        self._loaded_state: dict[str, Any] | None = None
        self._reset()
        distributed.carry_spawn_results(AmpWatch, AmpWatch._spawn_results, AmpWatch._take_spawn_results)

    def _reset(self) -> None:
        """Per-fit state: a second ``fit`` with the same instance starts afresh (unless it resumes a checkpoint)."""
        self.diagnoses = []
        self.machine = None
        self.reporters = None
        self._ledger: StepLedger | None = None
        self._investigations: Investigations | None = None
        self._guards = RecipeGuards()
        self._treatment = Treatment(RemedyPolicy(self.remedies), recovery_steps=self.thresholds.recovery_steps,
                                    rollback=self.rollback, replay_episode=self.replay_episode)
        self._log_every = 0
        self._world_size = 1
        self._disabled = False
        self._failures: set[str] = set()
        self._said: set[str] = set()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # a ddp_spawn worker unpickles the callback: its launcher must send the results home
        distributed.carry_spawn_results(AmpWatch, AmpWatch._spawn_results, AmpWatch._take_spawn_results)

    def _spawn_results(self) -> dict[str, Any]:
        return {"diagnoses": [d.to_dict() for d in self.diagnoses], "applied": [a.to_dict() for a in self.applied]}

    def _take_spawn_results(self, results: dict[str, Any]) -> None:
        self.diagnoses = [Diagnosis.from_dict(d) for d in results["diagnoses"]]
        self.applied = [AppliedRemedy.from_dict(a) for a in results["applied"]]

    @property
    def state_key(self) -> str:
        # Not the default (which includes the arguments): a resume with other flags keeps its state.
        return "AmpWatch" if self.name is None else f"AmpWatch[{self.name}]"

    @property
    def applied(self) -> list[AppliedRemedy]:
        """Every remedy applied in this run, in order (also after a resume)."""
        return self._treatment.applied

    @applied.setter
    def applied(self, value: list[AppliedRemedy]) -> None:
        self._treatment.applied = list(value)

    @property
    def event_log(self) -> Any:
        """The event log of the current fit (its ``path`` and ``dir``), or None before the first fit."""
        return getattr(self.reporters, "event_log", None)

    @property
    def precision(self) -> Any:
        return self._ledger.precision if self._ledger is not None else None

    # ------------------------------------------------------------------ lifecycle

    @override
    @_guarded
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loaded, self._loaded_state = self._loaded_state, None
        self._reset()
        info = resolve_precision(trainer.precision_plugin)
        self.machine = AmpStateMachine(info.mode, self.thresholds, scaler_config(info.scaler) if info.scaler else {},
                                       early_startup="lower_init_scale" in self.remedies)
        if loaded is not None:
            self._restore(loaded, trainer, pl_module)
            info = resolve_precision(trainer.precision_plugin)  # a restored bf16 fallback swapped the plugin
            self.machine.reconfigure(mode=info.mode)
        machine = self.machine
        self._world_size = distributed.world_size()
        self.reporters = reporters = Reporters(self.log_dir or trainer.log_dir or trainer.default_root_dir,
                                               is_global_zero=trainer.is_global_zero, verbose=self.verbose,
                                               precision=info.mode.value, device=pl_module.device,
                                               world_size=self._world_size, remedies=self.remedies)
        self._ledger = StepLedger(machine, info, reporters.timeline, device_type=pl_module.device.type,
                                  world_size=self._world_size)
        investigator = Investigator(pl_module, _ForwardContext(trainer), pl_module.device, info.mode,
                                    localize=self.localize, control=self.control_replay,
                                    automatic=pl_module.automatic_optimization)
        self._investigations = Investigations(
            investigator, machine, window=self.thresholds.window, world_size=self._world_size,
            capture_rng=uses_rng(pl_module), on_failure=self._internal_failure)
        if info.note:
            self._say_once(info.note)
        self._attach_guards(trainer, pl_module)
        if self.replay_episode and self._world_size > 1:
            # a rerun outside the loop has no gradient all-reduce: the ranks' weights would drift apart
            self._treatment.replay_episode = False
            self._say_once("replay_episode is off under DDP (a rerun of the episode would not all-reduce its "
                           "gradients); the episode's batches are skipped after a rollback.")
        if self.hold_lr_on_skip:
            HoldLrOnSkip.install(pl_module, self._ledger.last_step_skipped, _StepSchedulers(trainer))

    @override
    @_guarded
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The scaler's checkpointed state is loaded by now: mirror it (one read per fit)."""
        self._log_every = max(int(trainer.log_every_n_steps), 0)
        assert self._ledger is not None
        self._ledger.start(trainer, self._log_every)
        self._start_trajectory(trainer, pl_module)

    def _start_trajectory(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The snapshot ring and what a replay drives (again after a remedy swaps the precision plugin)."""
        investigations = self._investigations
        if not (self.snapshot_every and self.control_replay and investigations is not None):
            return
        control = TrajectoryControl(SnapshotRing(self.snapshot_budget, self.snapshot_every),
                                    TrainState.from_trainer(trainer, pl_module), self.thresholds.divergence_ratio,
                                    self._say_once)
        investigations.trajectory = self._ledger.trajectory = control  # type: ignore[union-attr]

    def _attach_guards(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._ledger is not None
        self._guards.attach(trainer, pl_module, self._ledger.precision, functools.partial(self._emit, trainer),
                            scale_reader=self._mirrored_scale)

    def _mirrored_scale(self) -> float:
        mirror = self._ledger.mirror if self._ledger is not None else None
        return mirror.scale if mirror is not None else 1.0

    # The four per-step hooks below catch their own failures inline rather than through ``_guarded``: on a
    # healthy step they run a few dozen bytecodes, and an extra wrapper call would be a good part of that.

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Only a model that draws random numbers needs anything here (the RNG state, for an exact replay), or a
        live probe waiting to be armed; every other batch is kept from ``on_train_batch_end``."""
        investigations = self._investigations
        if self._disabled or investigations is None or not investigations.wants_batch_start:
            return
        try:
            investigations.batch_start(pl_module, pl_module.device)
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_train_batch_start", err)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._disabled or self._ledger is None:
            return
        try:
            self._ledger.backward(loss)
            if self._guards.wants_loss:
                self._guards.on_before_backward(loss)
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_before_backward", err)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        ledger = self._ledger
        if self._disabled or ledger is None:
            return
        try:
            if ledger.stepped:  # manual optimization: a second step in the same batch
                self._take(trainer, ledger.close(trainer))
            ledger.stepped = True  # the step itself is read when it is over, in on_train_batch_end
            if self._investigations is not None and self._investigations.probing:
                self._investigations.optimizer_step(optimizer)
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_before_optimizer_step", err)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ledger = self._ledger
        if self._disabled or ledger is None:
            return
        try:
            investigations = self._investigations
            ledger.keep_batch(investigations.micro_batch(batch, batch_idx) if investigations is not None
                              else (batch, batch_idx))
            if investigations is not None and investigations.probing:
                for diagnosis in investigations.finish_probe():  # the armed training_step is over
                    self._emit(trainer, diagnosis)
            if not ledger.stepped:
                return  # mid-accumulation: no optimizer step in this batch
            resolved = ledger.close(trainer)
            if resolved:
                self._take(trainer, resolved)
            if self._log_every and ledger.step_index % self._log_every == 0:
                self._at_log_step(trainer)
            treatment = self._treatment
            if treatment.due or treatment.watch is not None:  # an optimizer-step boundary: safe to change the run
                treatment.at_step_boundary(self._site(trainer, pl_module))
        except AmpWatchError:
            raise
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_train_batch_end", err)

    def _at_log_step(self, trainer: pl.Trainer) -> None:
        """Once per ``log_every_n_steps`` optimizer steps: resolve what is in flight, one packed read, log, flush."""
        ledger, reporters, machine = self._ledger, self.reporters, self.machine
        assert ledger is not None and reporters is not None and machine is not None
        resolved = ledger.drain_at_log_step(trainer)
        self._take(trainer, resolved)
        steps, skipped, nonfinite = ledger.take_log_counts()
        metrics = reporters.metric_tensors(trainer, steps=steps, skipped=skipped, nonfinite=nonfinite)
        scale, values = ledger.read_at_log_step(metrics)  # the one device-to-host read of the log step
        reporters.log_metrics(trainer, values, skipped_total=machine.skipped_total, scale=scale)
        loss = ledger.last_loss  # read just now with the others; a step with no loss read records none
        reporters.flush(None if loss is None else lambda: loss)

    @override
    @_guarded
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ledger is not None:
            self._take(trainer, self._ledger.drain(force=True))
            self._ledger.read_losses()
        if self._investigations is not None:
            for diagnosis in self._investigations.finish_probe():  # the fit ended before the armed step
                self._emit(trainer, diagnosis)
        if self._treatment.due or self._treatment.watch is not None:
            self._treatment.at_step_boundary(self._site(trainer, pl_module))
        self._treatment.finish()  # still watched: its outcome stays unknown, never assumed
        if self.reporters is not None:
            self.reporters.finish(self.diagnoses, self._run_stats())
        self._detach(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hook when fit raises; this is the one hook that still runs.
        self._detach(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach(pl_module)

    def _detach(self, pl_module: pl.LightningModule) -> None:
        """Leave the run as it was found: optimizer hooks, clipping functions, ``lr_scheduler_step``, probes; the
        timeline written (a run that crashed keeps the steps that led up to it). Never raises."""
        for undo in (self._ledger.stop if self._ledger is not None else None,
                     self._guards.detach,
                     functools.partial(HoldLrOnSkip.uninstall, pl_module),
                     self._investigations.close if self._investigations is not None else None,
                     self.reporters.close if self.reporters is not None else None):
            if undo is None:
                continue
            try:
                undo()
            except Exception as err:  # noqa: BLE001
                self._internal_failure("clean-up", err)
        # What holds the trainer, the model or snapshots goes: the instance pickles after fit, and small (ddp_spawn)
        self._investigations = None
        if self._ledger is not None:
            self._ledger.trajectory = None
        self._treatment.forget_states()

    # ------------------------------------------------------------------ steps -> machine -> diagnoses

    def _take(self, trainer: pl.Trainer, resolved: list[ResolvedStep]) -> None:
        """Feed resolved steps to the machine; a new alarm is investigated before it is published."""
        machine, investigations, ledger = self.machine, self._investigations, self._ledger
        assert machine is not None and ledger is not None
        for step in resolved:
            if investigations is not None:
                investigations.before_observe(step, ledger.scaler_active)
            for diagnosis in machine.observe(step.obs):
                if diagnosis.is_alarm and investigations is not None:
                    refined = investigations.investigate(diagnosis, step, ledger.scaler_active)
                    if refined is None:
                        continue  # published after the next step, with what its live probe saw
                    diagnosis = refined
                self._emit(trainer, diagnosis)

    def _emit(self, trainer: pl.Trainer, diagnosis: Diagnosis) -> None:
        """Publish a diagnosis, or hold an alarm that has a remedy on its ladder until the step boundary."""
        if self._treatment.wants(diagnosis):
            self._treatment.due.append(diagnosis)
        else:
            self._publish(trainer, diagnosis)

    @property
    def _scaler_active(self) -> bool:
        return self._ledger is not None and self._ledger.scaler_active

    def _site(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Site:
        """What a treatment acts on at this step boundary, and how it reports back."""
        assert self._ledger is not None
        return Site(trainer=trainer, ctx=self._remedy_context(trainer, pl_module), machine=self.machine,
                    ledger=self._ledger, on_effects=functools.partial(self._after_remedy, trainer, pl_module),
                    decide=functools.partial(self._decide, trainer), agreed=self._world_size == 1 or
                    self._scaler_active, publish=functools.partial(self._publish, trainer),
                    update=functools.partial(self._update, trainer),
                    unrecoverable=functools.partial(self._unrecoverable, trainer), say=self._say_once)

    def _decide(self, trainer: pl.Trainer, value: Any) -> Any:
        """Rank zero's value on every rank (only on steps every rank is in: an alarm under a scaler)."""
        return trainer.strategy.broadcast(value, src=0) if self._world_size > 1 else value

    def _remedy_context(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> RemedyContext:
        scaler = self._ledger.precision.scaler if self._ledger is not None else None
        return RemedyContext(trainer=trainer, module=pl_module, scaler=scaler, device=pl_module.device,
                             safe_scale=self.machine.max_safe_scale if self.machine is not None else None,
                             guards=self._guards)

    def _after_remedy(self, trainer: pl.Trainer, pl_module: pl.LightningModule, effects: frozenset[Effect]) -> None:
        """Bring AmpWatch's own view in line with what a remedy or a rollback changed (each declares it)."""
        assert self._ledger is not None
        for effect in effects:
            if effect is Effect.PRECISION:
                info = resolve_precision(trainer.precision_plugin)
                self._ledger.switch_precision(info)
                if self._investigations is not None and self._investigations.investigator is not None:
                    self._investigations.investigator.mode = info.mode
                self._attach_guards(trainer, pl_module)
                self._start_trajectory(trainer, pl_module)  # snapshots of the old arithmetic replay no more
            elif effect is Effect.SCALER:
                self._ledger.mirror_scaler()
            elif effect is Effect.OPTIMIZERS:
                self._ledger.read_param_groups(trainer.optimizers, lrs_now=True)

    def _publish(self, trainer: pl.Trainer, diagnosis: Diagnosis) -> None:
        """Every sink gets it (each fails alone); the decision that follows never depends on a sink. A withdrawal
        replaces the record it takes back; the event log gets one more line saying so."""
        if diagnosis.withdrawn:
            self.diagnoses = [d for d in self.diagnoses
                              if not (d.finding is diagnosis.finding and d.step == diagnosis.step)]
        self.diagnoses.append(diagnosis)
        if diagnosis.remedy is not None and self.reporters is not None and self._treatment.applied:
            self.reporters.record_remedy(self._treatment.applied[-1].step, diagnosis.remedy)
        if self.reporters is not None:
            self.reporters.publish(diagnosis, trainer.loggers)
        if diagnosis.is_alarm and diagnosis.remedy is None:
            self._unrecoverable(trainer, diagnosis)

    def _update(self, trainer: pl.Trainer, old: Diagnosis, new: Diagnosis) -> None:
        """A later fact changed a diagnosis (a remedy's outcome, the next rung): ``diagnoses`` holds the updated
        record, and the sinks get it once more."""
        at = next((i for i, d in enumerate(self.diagnoses) if d is old), None)
        if at is None:
            self.diagnoses.append(new)
        else:
            self.diagnoses[at] = new
        if new.remedy is not None and new.remedy != old.remedy and self.reporters is not None:
            self.reporters.record_remedy(self._treatment.applied[-1].step, new.remedy)
        if self.reporters is not None:
            self.reporters.publish(new, trainer.loggers)

    def _unrecoverable(self, trainer: pl.Trainer, diagnosis: Diagnosis) -> None:
        if self.on_unrecoverable == "stop":
            trainer.should_stop = True
            self._say_once(f"stopping the run after {diagnosis.finding.value} at step {diagnosis.step} "
                           "(on_unrecoverable='stop').", key=f"stop:{diagnosis.step}")
        elif self.on_unrecoverable == "raise":
            raise AmpWatchError(diagnosis.headline() + "\nFix: " + diagnosis.advice, diagnosis)

    def _run_stats(self) -> RunStats | None:
        machine, ledger = self.machine, self._ledger
        if machine is None:
            return None
        mirror = ledger.mirror if ledger is not None else None
        return RunStats(steps=machine.steps_seen, skipped=machine.skipped_total, nonfinite=machine.nonfinite_total,
                        scale=mirror.scale if mirror is not None else None, precision=machine.mode.value)

    # ------------------------------------------------------------------ checkpoints

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "diagnoses": [d.to_dict() for d in self.diagnoses],
            "machine": None if self.machine is None else self.machine.state_dict(),
            "applied": [r.to_dict() for r in self.applied],
            "policy": self._treatment.policy.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning loads callback states before on_fit_start builds the rooms; they are restored there.
        self._loaded_state = state_dict if isinstance(state_dict, dict) else {"invalid": state_dict}

    def _restore(self, state: dict[str, Any], trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Put back what a checkpoint holds, part by part: a part that cannot be read is warned about once, by name,
        and left out; the watch goes on with what could be read."""
        if "invalid" in state and len(state) == 1:
            self._warn_state(f"it is a {type(state['invalid']).__name__}, not a dict", None)
            return
        version = state.get("version", 1)
        if version not in (1, STATE_VERSION):
            self._warn_state(f"it has version {version!r}; this AmpWatch reads versions 1 and {STATE_VERSION}", None)
            return
        parts: list[tuple[str, Callable[[], None]]] = [
            ("diagnoses", lambda: setattr(self, "diagnoses",
                                          [Diagnosis.from_dict(d) for d in state.get("diagnoses", ())])),
            ("applied", lambda: setattr(self, "applied",
                                        [AppliedRemedy.from_dict(a) for a in state.get("applied", ())])),
            ("policy", lambda: self._treatment.policy.load_state_dict(state.get("policy", {}))),
            ("machine", lambda: self.machine.load_state_dict(state["machine"])  # type: ignore[union-attr]
             if state.get("machine") else None),
        ]
        for part, load in parts:
            try:
                load()
            except Exception as err:  # noqa: BLE001 - a bad part must not cost the watch
                self._warn_state(f"its {part!r} entry cannot be read ({type(err).__name__}: {err})", part)
        if self.applied:
            # a checkpoint carries neither forward hooks nor a swapped precision plugin: put them back first
            try:
                reapply_all(self._remedy_context(trainer, pl_module), self.applied)
            except Exception as err:  # noqa: BLE001
                self._warn_state(f"a remedy it records cannot be applied again ({type(err).__name__}: {err})",
                                 "applied")

    def _warn_state(self, why: str, part: str | None) -> None:
        if part == "machine" and self.machine is not None:
            self.machine = AmpStateMachine(self.machine.mode, self.thresholds, self.machine.scaler_config,
                                           early_startup=self.machine.early_startup)
        warnings.warn(f"AmpWatch could not use the checkpoint's {self.state_key!r} state: {why}. "
                      + ("It keeps watching without it." if part is None else
                         f"It keeps watching without the {part!r} part."), RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ failure containment

    def _internal_failure(self, where: str, err: Exception) -> None:
        key = f"{where}:{type(err).__name__}"
        if key not in self._failures:
            self._failures.add(key)
            warnings.warn(f"AmpWatch hit an internal error in {where} and keeps watching without it: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
        if self._ledger is not None:
            self._ledger.stepped = False  # never carry a half-built step into the next one
        if len(self._failures) >= MAX_FAILURES:
            self._disabled = True
            warnings.warn("AmpWatch has failed repeatedly and switches itself off for this run; training goes on.",
                          RuntimeWarning, stacklevel=3)

    def _say_once(self, message: str, key: str | None = None) -> None:
        key = key or message
        if key not in self._said and self.reporters is not None:
            self._said.add(key)
            self.reporters.say(message)


class _StepSchedulers:
    """The step-interval LR schedulers of the trainer (for ``hold_lr_on_skip``); picklable, unlike a lambda."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer

    def __call__(self) -> list[Any]:
        return [c.scheduler for c in self.trainer.lr_scheduler_configs if c.interval == "step"]
