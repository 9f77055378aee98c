"""``AmpWatch``: the Lightning glue. Reads signals in hooks, feeds the core, hands results to reporters.

Kept thin on purpose (the way ``ThroughputMonitor`` sits on ``Throughput``): the decisions live in
:mod:`lightning_ampwatch.machine`, the plugin knowledge in :mod:`lightning_ampwatch.signals`.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Callable, Literal, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from rich.console import Console
from torch import Tensor
from torchmetrics.aggregation import RunningMean, SumMetric

from lightning_ampwatch import distributed
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.investigate import LIVE_PROBED, Investigator, located_live
from lightning_ampwatch.machine import AmpStateMachine, Observation, Thresholds
from lightning_ampwatch.signals import ScaleMirror
from lightning_ampwatch.probes import LiveProbe, MicroBatch, capture_rng, uses_rng
from lightning_ampwatch.remedies import (
    AppliedRemedy,
    HoldLrOnSkip,
    RemedyContext,
    RemedyPolicy,
    ladder_for,
    parse_remediate,
    reapply_structural,
)
from lightning_ampwatch.report import EventLog, print_diagnosis, write_text
from lightning_ampwatch.signals import (
    DeferredRead,
    LossTape,
    PrecisionInfo,
    StepTaken,
    current_lrs,
    inspect_batch,
    read_scale,
    resolve_precision,
    scaler_config,
)
from lightning_ampwatch.summary import RunStats, summary_lines
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis
from lightning_ampwatch.timeline import TIMELINE_NAME, Timeline

UNRECOVERABLE_MODES = ("warn", "stop", "raise")

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


class _OpenStep:
    """An optimizer step whose outcome needs more than the fast path: a skip, a flag or a loss still in flight,
    or an episode in progress. Queued until it can be resolved in order."""

    __slots__ = ("step", "scale", "lrs", "tape", "batches", "skipped", "found_inf", "loss")

    def __init__(self, step: int, scale: float | None, lrs: tuple[float, ...], tape: LossTape,
                 batches: list[MicroBatch]) -> None:
        self.step, self.scale, self.lrs, self.tape, self.batches = step, scale, lrs, tape, batches
        self.skipped = False
        self.found_inf: DeferredRead | None = None  # fused optimizers: the scaler's flag, read once landed
        self.loss: DeferredRead | None = None  # no scaler: the loss, read once landed


class AmpWatch(Callback):
    r"""Watch a mixed-precision run and name the cause when it goes wrong.

    Every optimizer step it learns, at no extra host-device synchronisation, whether the GradScaler skipped the
    step, the scale and its growth, and the learning rate; on an anomaly it reads the loss and the batch,
    classifies the episode into the AMP failure taxonomy and reports it once.

    Args:
        remediate: ``False`` (diagnose only), ``True`` (every remedy except ``reduce_lr``), or one remedy name or
            an iterable of them: ``lower_init_scale``, ``slow_growth``, ``fp32_island``, ``bf16_fallback``,
            ``reduce_lr``, ``unscale_before_clip``.
        on_unrecoverable: what to do about an alarm no allowed remedy fixes: ``"warn"`` (report and go on),
            ``"stop"`` (set ``trainer.should_stop`` for a clean end) or ``"raise"`` (:class:`AmpWatchError`).
        control_replay: replay the offending batch without autocast (the FP32 control) on the first alarm.
        localize: name the first module or parameter that overflowed.
        hold_lr_on_skip: a step the scaler skipped does not advance the LR scheduler either.
        verbose: print each diagnosis once on the console (rank zero).
        thresholds: when patterns become alarms; the defaults suit a default GradScaler.
        log_dir: where ``ampwatch/diagnoses.jsonl`` goes; defaults to the trainer's log directory.
    """

    def __init__(
        self,
        remediate: Union[bool, str, Iterable[str]] = False,
        on_unrecoverable: Literal["warn", "stop", "raise"] = "warn",
        control_replay: bool = True,
        localize: bool = True,
        hold_lr_on_skip: bool = False,
        verbose: bool = True,
        thresholds: Thresholds | None = None,
        log_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.remedies = parse_remediate(remediate)
        if on_unrecoverable not in UNRECOVERABLE_MODES:
            raise ValueError(f"on_unrecoverable={on_unrecoverable!r} is not valid; use one of {UNRECOVERABLE_MODES}")
        for name, value in (("control_replay", control_replay), ("localize", localize),
                            ("hold_lr_on_skip", hold_lr_on_skip), ("verbose", verbose)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is not valid; use True or False")
        if thresholds is not None and not isinstance(thresholds, Thresholds):
            raise ValueError(f"thresholds={thresholds!r} is not valid; use lightning_ampwatch.Thresholds(...) or None")
        self.on_unrecoverable = on_unrecoverable
        self.control_replay = control_replay
        self.localize = localize
        self.hold_lr_on_skip = hold_lr_on_skip
        self.verbose = verbose
        self.thresholds = thresholds or Thresholds()
        self.log_dir = log_dir

        self.diagnoses: list[Diagnosis] = []
        self.machine: AmpStateMachine | None = None
        self.precision: PrecisionInfo | None = None
        self.event_log: EventLog | None = None
        self.timeline: Timeline | None = None  # rank zero's per-step series for `ampwatch report --plot`
        self._mirror: ScaleMirror | None = None
        self._steps = StepTaken()
        self._stepped = False  # an optimizer step ran in this batch and is not taken in yet
        self._lrs: tuple[float, ...] = ()  # the LRs the next step will run with
        self._pending: deque[_OpenStep] = deque()
        self._tape = LossTape()
        self._batches: list[MicroBatch] = []
        self._investigator: Investigator | None = None
        self._evidence: tuple[int, dict[str, Any] | None] | None = None  # (step, replay record) awaiting an alarm
        self._awaiting_probe: list[Diagnosis] = []  # manual optimization: alarms waiting for the next step's probe
        self._probe_next = False  # arm the forward probe at the next batch start
        self._batch_rng: tuple[Tensor, Tensor | None] | None = None  # RNG state at this batch's start (dropout)
        self._live_probe: LiveProbe | None = None
        self._capture_rng = False
        self._loss_reads: deque[float] = deque(maxlen=8)  # recent healthy losses: the run's loss level
        self._last_tape: LossTape | None = None
        self._loaded_state: dict[str, Any] | None = None
        self._guards = RecipeGuards()
        self._policy = RemedyPolicy(self.remedies)
        self.applied: list[AppliedRemedy] = []  # every remedy applied in this run, in order (also after resume)
        self._due: list[Diagnosis] = []  # alarms waiting for the next optimizer-step boundary to be treated
        self._step_index = 0  # trainer.global_step at the step being opened
        self._param_groups: list[dict[str, Any]] = []  # every optimizer's param groups, for the per-step LR read
        self._float_lrs = True  # every LR a Python number (not a tensor): read them inline
        self._log_every = 0  # trainer.log_every_n_steps
        self._fast_path = False  # see _update_fast_path
        self._host_loss = False  # see _update_fast_path
        self._device_type = "cpu"
        self._world_size = 1
        self._disabled = False
        self._failures: set[str] = set()
        self._said: set[str] = set()
        self._log_steps = 0
        self._log_skipped = 0
        self._log_nonfinite = 0
        self._skip_rate: RunningMean | None = None
        self._nonfinite_sum: SumMetric | None = None
        self._console: Console | None = None  # made on first use: a Console does not pickle (ddp_spawn)

    # ------------------------------------------------------------------ lifecycle

    @_guarded
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loaded_state is not None:
            # a checkpoint carries neither forward hooks nor a swapped precision plugin: put them back first
            reapply_structural(RemedyContext(trainer=trainer, module=pl_module, scaler=None, device=pl_module.device),
                               [AppliedRemedy.from_dict(a) for a in self._loaded_state.get("applied", ())])
        self.precision = info = resolve_precision(trainer.precision_plugin)
        self._mirror = None  # made in on_train_start, once Lightning has restored the scaler's own state
        self._fast_path = False
        self.machine = AmpStateMachine(info.mode, self.thresholds, scaler_config(info.scaler) if info.scaler else {})
        if self._loaded_state is not None:
            self._restore(self._loaded_state)
            self._loaded_state = None
        self.event_log = EventLog(self.log_dir or trainer.log_dir or trainer.default_root_dir)
        self.timeline = Timeline(self.event_log.dir / TIMELINE_NAME if trainer.is_global_zero else None,
                                 precision=info.mode.value)
        self._steps.attach(trainer.optimizers)
        self._capture_rng = uses_rng(pl_module)  # replays must redraw the same dropout masks
        self._investigator = Investigator(
            pl_module, lambda: trainer.precision_plugin.forward_context(), pl_module.device, info.mode,
            localize=self.localize, control=self.control_replay, automatic=pl_module.automatic_optimization,
        )
        self._skip_rate = RunningMean(window=4).to(pl_module.device)
        self._nonfinite_sum = SumMetric().to(pl_module.device)
        if info.note:
            self._say_once(info.note)
        self._attach_guards(trainer, pl_module)
        if "unscale_before_clip" in {r.name for r in self.applied}:
            self._guards.rescale_clipping = True
        if self.hold_lr_on_skip:
            HoldLrOnSkip.install(pl_module, self._last_step_skipped, lambda: [
                c.scheduler for c in trainer.lr_scheduler_configs if c.interval == "step"])

    @_guarded
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The scaler's checkpointed state is loaded by now: mirror it (one read per fit)."""
        self._step_index = trainer.global_step
        self._device_type = pl_module.device.type
        self._read_param_groups(trainer)
        self._lrs = current_lrs(trainer.optimizers)
        self._log_every = max(int(trainer.log_every_n_steps), 0)
        self._world_size = distributed.world_size()
        self._mirror_scaler()
        self._update_fast_path()

    def _mirror_scaler(self) -> None:
        """Read the scaler once (scale, tracker, growth settings) into the host mirror and the machine."""
        scaler = self.precision.scaler if self.precision is not None else None
        if scaler is None:
            return
        config = scaler_config(scaler)
        scale, tracker = read_scale(scaler)
        self._mirror = ScaleMirror(scale, tracker=tracker, **config)
        if self.machine is not None:
            self.machine.reconfigure(scaler_config=config)

    def _read_param_groups(self, trainer: pl.Trainer) -> None:
        """The param groups whose LRs are read every step, and whether they are all plain numbers."""
        self._param_groups = [g for opt in trainer.optimizers for g in opt.param_groups]
        self._float_lrs = all(isinstance(g.get("lr"), (int, float)) for g in self._param_groups)

    def _attach_guards(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.precision is not None
        self._guards.attach(trainer, pl_module, self.precision, lambda diagnosis: self._emit(trainer, diagnosis),
                            scale_reader=lambda: self._mirror.scale if self._mirror is not None else 1.0)

    def _last_step_skipped(self) -> bool:
        """Whether the optimizer step that just ran was skipped by the scaler (for ``hold_lr_on_skip``)."""
        if not self._scaler_active:
            return False
        if self._steps.found_inf is not None:
            return bool(self._steps.found_inf.item())  # fused optimizer: the user asked for this read
        return not self._steps.taken

    # The four per-step hooks below catch their own failures inline rather than through ``_guarded``: on a
    # healthy step they run a few dozen bytecodes, and an extra wrapper call would be a good part of that.

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Only a model that draws random numbers needs anything here (the RNG state, for an exact replay); every
        other batch is kept from ``on_train_batch_end``, which receives it too."""
        if self._disabled or not (self._capture_rng or self._probe_next):
            return
        try:
            if self._probe_next:
                self._arm_live_probe(pl_module)
            if self._capture_rng:
                self._batch_rng = capture_rng(pl_module.device)
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_train_batch_start", err)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._disabled:
            return
        try:
            mirror = self._mirror
            self._tape.append((loss.detach(), mirror.scale if mirror is not None else 1.0))  # no read
            if self._guards.wants_loss:
                self._guards.on_before_backward(loss)
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_before_backward", err)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._disabled:
            return
        try:
            if self._stepped:  # manual optimization: a second step in the same batch
                self._close_step(trainer, pl_module)
            self._stepped = True  # the step itself is read when it is over, in on_train_batch_end
            if self._live_probe is not None:
                self._finish_live_probe(trainer, pl_module, with_grads=True)
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_before_optimizer_step", err)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._disabled:
            return
        try:
            # The batch joins its step's batches (kept by reference, read only if the step turns out faulty).
            batches = self._batches
            if len(batches) >= 64:  # a run whose steps never come: keep memory bounded
                del batches[:-32]
            batches.append((batch, batch_idx) if self._batch_rng is None else (batch, batch_idx, *self._batch_rng))
            if not self._stepped:
                return  # mid-accumulation: no optimizer step in this batch
            self._close_step(trainer, pl_module)
            if self._log_every and self._step_index % self._log_every == 0:
                self._at_log_step(trainer, pl_module)
            if self._due:
                self._treat_due(trainer, pl_module)  # an optimizer-step boundary: safe to change the run
        except AmpWatchError:
            raise
        except Exception as err:  # noqa: BLE001
            self._internal_failure("on_train_batch_end", err)

    def _at_log_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Once per ``log_every_n_steps`` optimizer steps: resolve what is in flight, read the scale, log, flush."""
        self._step_index = trainer.global_step  # re-synchronise (cheap here, once per log interval)
        self._read_param_groups(trainer)  # groups added since?
        self._drain(trainer, force=True)
        self._log_metrics(trainer, pl_module)
        self._flush_timeline()

    @_guarded
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drain(trainer, force=True)
        if self._awaiting_probe or self._live_probe is not None:
            self._finish_live_probe(trainer, pl_module, with_grads=False)  # the fit ended before the next step
        if self._due:
            self._treat_due(trainer, pl_module)
        self._steps.detach()
        self._guards.detach()
        stats = self._run_stats()
        if self.timeline is not None and stats is not None:
            self.timeline.record_end(stats.steps, stats.skipped, stats.nonfinite, stats.scale)
        self._flush_timeline()
        if trainer.is_global_zero and self.verbose and stats is not None:
            self._print_summary(stats)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning skips the teardown hook when fit raises; this is the one hook that still runs.
        self._steps.detach()
        self._guards.detach()
        HoldLrOnSkip.uninstall(pl_module)
        if self.timeline is not None:
            try:
                self.timeline.close()  # the steps that led up to the crash are the interesting ones
            except OSError as err:
                self._internal_failure("on_exception", err)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._live_probe is not None:
            self._live_probe.close()
            self._live_probe = None
        self._steps.detach()  # leave the optimizers as we found them
        self._guards.detach()  # ... and torch.nn.utils's clipping functions
        HoldLrOnSkip.uninstall(pl_module)  # ... and the module's lr_scheduler_step
        try:
            if self.timeline is not None:
                self.timeline.close()  # a run that crashed keeps the steps that led up to it
        except OSError as err:
            self._internal_failure("teardown", err)
        self._stepped = False
        self._pending.clear()
        self._batches = []
        self._tape = LossTape()

    # ------------------------------------------------------------------ the per-step path

    def _close_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """This batch's optimizer step is over (the scaler has updated, the scheduler has stepped): take it in."""
        self._stepped = False
        tape, batches = self._tape, self._batches
        self._tape, self._batches = LossTape(), []
        step = self._step_index
        self._step_index = step + 1  # trainer.global_step kept locally: the property costs more than the watch
        lrs = self._lrs  # the LRs this step ran with, read when the previous step was taken in ...
        groups = self._param_groups
        if not self._float_lrs:  # ... and the next step's (a tensor LR is never read on a device)
            self._lrs = current_lrs(trainer.optimizers)
        elif len(groups) == 1:
            self._lrs = (groups[0]["lr"],)
        else:
            self._lrs = tuple([g["lr"] for g in groups])
        steps, mirror = self._steps, self._mirror
        taken, found_inf = steps.taken, steps.found_inf
        steps.taken, steps.found_inf = False, None
        if not tape:
            return  # backward never ran (training_step returned None): Lightning did not step
        scale = mirror.scale if mirror is not None else None
        machine = self.machine
        if self._fast_path and taken and not self._pending and machine.quiet:  # type: ignore[union-attr]
            # The fast path, nearly every step of a healthy run: the scaler took the step and nothing is in
            # progress. Host-side bookkeeping only; no Observation, no device read.
            machine.observe_clean(step, scale, mirror.update(False), lrs)  # type: ignore[union-attr]
            self._last_tape = tape
            self._log_steps += 1
            timeline = self.timeline
            if timeline is not None:
                timeline.record_clean(step, scale, lrs)
            if not self._loss_reads:
                self._loss_reads.append(tape.read())  # once per fit: a first loss level for the control
            return
        if self._host_loss and not self._pending and machine.quiet:  # type: ignore[union-attr]
            # No scaler, and the loss lives on the host (CPU): reading it is no synchronisation, so a finite loss
            # takes the fast path too. On an accelerator the loss goes the deferred way below.
            loss = tape.read()
            if math.isfinite(loss):
                machine.observe_clean(step, None, False, lrs)  # type: ignore[union-attr]
                self._last_tape = tape
                self._log_steps += 1
                self._loss_reads.append(loss)
                if self.timeline is not None:
                    self.timeline.record_step(step, skipped=False, loss=loss, loss_finite=True, lrs=lrs)
                return
        opened = _OpenStep(step, scale, lrs, tape, batches)
        if self._scaler_active:
            if found_inf is not None:  # fused optimizer: called whether or not it skipped
                opened.found_inf = DeferredRead(found_inf)
            else:
                opened.skipped = not taken
        else:
            # Without a scaler the loss is the only signal: copy it to the host without waiting.
            opened.loss = DeferredRead(opened.tape.total())
        self._pending.append(opened)
        # Under DDP a skipped step is agreed across ranks by a collective, so every rank must resolve it at the
        # same point: wait for an in-flight flag there rather than let ranks resolve it at different steps.
        self._drain(trainer, force=self._world_size > 1)

    @property
    def _scaler_active(self) -> bool:
        return self.precision is not None and self.precision.scaler is not None

    def _update_fast_path(self) -> None:
        """Whether a clean step can take the fast path: a scaler whose skips the step hook reports (not fused)
        and a host mirror of its scale; or no scaler and a model on the CPU, whose loss is read for free."""
        self._host_loss = bool(not self._scaler_active and self.machine is not None and self._device_type == "cpu")
        self._fast_path = bool(self._scaler_active and self._mirror is not None and self.machine is not None
                               and not self._steps.fused)

    def _drain(self, trainer: pl.Trainer, force: bool) -> None:
        """Resolve queued steps in order; with ``force`` wait for copies still in flight (log steps, fit end)."""
        while self._pending:
            head = self._pending[0]
            deferred = head.found_inf or head.loss
            if deferred is not None and not force and not deferred.ready():
                return
            self._pending.popleft()
            self._resolve(trainer, head)

    def _resolve(self, trainer: pl.Trainer, opened: _OpenStep) -> None:
        assert self.machine is not None
        skipped = bool(opened.found_inf.value()) if opened.found_inf is not None else opened.skipped
        grew = self._mirror.update(skipped) if self._mirror is not None else False
        loss: float | None = opened.loss.value() if opened.loss is not None else None
        if skipped and loss is None:
            # Under a scaler a non-finite loss always shows up as a skip, so only skipped steps are read.
            loss = opened.tape.read()
        if loss is None and not skipped and not self._loss_reads:
            self._loss_reads.append(opened.tape.read())  # once per fit: a first loss level for the control
        loss_finite = None if loss is None else math.isfinite(loss)
        self._last_tape = opened.tape
        self._log_steps += 1
        self._log_skipped += int(skipped)
        batch_stats = None
        fault_ranks = [distributed.rank()]
        if skipped or loss_finite is False:
            batch_stats = inspect_batch([mb[0] for mb in opened.batches])
            self._log_nonfinite += int(loss_finite is False)
            if skipped and self._world_size > 1:
                # every rank skipped this step together: agree on one view of it (the only collective we make)
                records = distributed.gather({"loss": loss, "loss_finite": loss_finite, "batch": batch_stats})
                loss, loss_finite, batch_stats, fault_ranks = distributed.merge_step(records)
        elif loss is not None:
            self._loss_reads.append(loss)
        obs = Observation(step=opened.step, skipped=skipped, loss=loss, loss_finite=loss_finite,
                          scale=opened.scale, grew=grew, lrs=opened.lrs, batch=batch_stats)
        if self.timeline is not None:
            self.timeline.record_step(obs.step, skipped=obs.skipped, scale=obs.scale, loss=obs.loss,
                                      loss_finite=obs.loss_finite, lrs=obs.lrs)
        investigator = self._investigator
        if investigator is not None and self._evidence is not None and \
                self._evidence[0] < opened.step - self.thresholds.window:
            self._evidence = None  # a suspicion that never became an alarm
        if investigator is not None and skipped and self.machine.episode is None and self._evidence is None \
                and self.machine.streak == self.thresholds.startup_streak - 1:
            # Enough skips in a row for an alarm: replay now, while the weights are still those of the faulty
            # step; the alarm itself may only be decided later (when the streak ends), after the optimizer moved.
            self._evidence = (opened.step, self._collect(opened, fault_ranks, weights_stepped=False))
        for diagnosis in self.machine.observe(obs):
            if diagnosis.is_alarm and investigator is not None:
                diagnosis = self._investigate(diagnosis, opened, batch_stats, fault_ranks, skipped)
                if self._wants_live_probe(diagnosis):
                    self._awaiting_probe.append(diagnosis)  # published after the next step, with its location
                    self._probe_next = True
                    continue
            self._emit(trainer, diagnosis)

    def _wants_live_probe(self, diagnosis: Diagnosis) -> bool:
        """Manual optimization cannot be replayed (training_step steps the optimizer itself), so the probes
        watch the next real step instead; single process only (the ranks would have to agree on it)."""
        return (self._investigator is not None and not self._investigator.automatic and self.localize
                and diagnosis.location is None and diagnosis.finding in LIVE_PROBED and self._world_size == 1)

    def _arm_live_probe(self, pl_module: pl.LightningModule) -> None:
        self._probe_next = False
        self._live_probe = LiveProbe(pl_module)

    def _finish_live_probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, with_grads: bool) -> None:
        """The armed step's backward is done: publish the diagnoses that waited for its probe."""
        probe, self._live_probe = self._live_probe, None
        seen = probe.finish(with_grads) if probe is not None else (None, None, [])
        waiting, self._awaiting_probe = self._awaiting_probe, []
        for diagnosis in waiting:
            self._emit(trainer, located_live(diagnosis, *seen))

    def _investigate(self, diagnosis: Diagnosis, opened: _OpenStep, batch_stats: Any, fault_ranks: list[int],
                     skipped: bool) -> Diagnosis:
        """Localise and run the FP32 control for a new alarm (at most once per episode); the control may
        rename the finding."""
        assert self.machine is not None
        if self._evidence is not None:
            record = self._evidence[1]
        elif skipped or not self._scaler_active:
            record = self._collect(opened, fault_ranks, weights_stepped=not skipped)
        else:
            record = None  # decided on a clean step with nothing replayed while the fault was fresh
        self._evidence = None
        if self._investigator is None:  # the replay failed just now: the plain diagnosis still goes out
            return replace(diagnosis, evidence={**diagnosis.evidence, "replay": "failed (see the warning)"})
        refined, renamed = self._investigator.apply(diagnosis, record, batch=batch_stats)
        if renamed is not None:
            self.machine.revise(renamed)
        return refined

    def _collect(self, opened: _OpenStep, fault_ranks: list[int], weights_stepped: bool) -> dict[str, Any] | None:
        """Replay the step; a failure switches replays off for the rest of the run, on every rank alike."""
        if self._investigator is None:
            return None
        try:
            return self._investigator.collect(opened.batches, scale=opened.scale, fault_ranks=fault_ranks,
                                              weights_stepped=weights_stepped, loss_level=self._loss_level())
        except Exception as err:  # noqa: BLE001 - degrade to watching, never to a crash
            self._investigator = None
            self._internal_failure("the replay of the faulty batch", err)
            return None

    def _loss_level(self) -> float | None:
        """The run's usual loss: the smallest of the last few healthy losses read (first step, log steps)."""
        finite = [x for x in self._loss_reads if math.isfinite(x)]
        return min(finite) if finite else None

    # ------------------------------------------------------------------ results

    def _emit(self, trainer: pl.Trainer, diagnosis: Diagnosis) -> None:
        """Publish a diagnosis, or hold an alarm that has a remedy on its ladder until the step boundary."""
        if diagnosis.is_alarm and self.remedies and any(r in self.remedies for r in ladder_for(diagnosis)):
            self._due.append(diagnosis)
            return
        self._publish(trainer, diagnosis)

    def _treat_due(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Pick and apply a remedy for each waiting alarm, then publish it (with the remedy, or unrecoverable)."""
        due, self._due = self._due, []
        for diagnosis in due:
            self._publish(trainer, self._remediate(trainer, pl_module, diagnosis))

    def _remediate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, diagnosis: Diagnosis) -> Diagnosis:
        choice = self._policy.choose(diagnosis)
        if self._world_size > 1 and not diagnosis.finding.is_recipe:
            # Under a scaler every rank skips the same steps, so every rank reaches the same alarms; without one
            # the ranks see anomalies at different steps and no single decision can be agreed on.
            if not self._scaler_active:
                self._say_once("Without a GradScaler the ranks do not see anomalies together, so AmpWatch does "
                               "not remedy them under DDP; it reports them.")
                return diagnosis
            choice = trainer.strategy.broadcast(choice, src=0)  # decided once, on rank zero
        ctx = RemedyContext(trainer=trainer, module=pl_module,
                            scaler=self.precision.scaler if self.precision is not None else None,
                            device=pl_module.device,
                            safe_scale=self.machine.max_safe_scale if self.machine is not None else None)
        diagnosis, applied = self._policy.apply(ctx, diagnosis, choice, step=trainer.global_step)
        if applied is not None:
            self._after_remedy(trainer, pl_module, applied.name)
            self.applied.append(applied)
            if self.timeline is not None:
                self.timeline.record_remedy(applied.step, applied.name)
        return diagnosis

    def _after_remedy(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> None:
        """Bring AmpWatch's own view in line with what the remedy changed."""
        assert self.machine is not None
        self.machine.close_episode(trainer.global_step, f"remedy {name}")
        if name == "unscale_before_clip":
            self._guards.rescale_clipping = True
        if name == "bf16_fallback":
            self._switched_precision(trainer, pl_module)
        elif name in ("lower_init_scale", "slow_growth"):
            self._mirror_scaler()

    def _switched_precision(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.precision = resolve_precision(trainer.precision_plugin)
        self._mirror = None
        self._update_fast_path()
        assert self.machine is not None
        self.machine.reconfigure(mode=self.precision.mode, scaler_config={})
        if self._investigator is not None:
            self._investigator.mode = self.precision.mode
        self._attach_guards(trainer, pl_module)

    def _publish(self, trainer: pl.Trainer, diagnosis: Diagnosis) -> None:
        self.diagnoses.append(diagnosis)
        if trainer.is_global_zero:
            if self.event_log is not None:
                self.event_log.append(diagnosis)
            if self.timeline is not None:
                self.timeline.record_diagnosis(diagnosis)
            if self.verbose:
                if self._console is None:
                    self._console = Console(highlight=False)
                print_diagnosis(diagnosis, self._console)
            write_text(trainer.loggers, diagnosis)
        if diagnosis.is_alarm and diagnosis.remedy is None:
            self._unrecoverable(trainer, diagnosis)

    def _unrecoverable(self, trainer: pl.Trainer, diagnosis: Diagnosis) -> None:
        if self.on_unrecoverable == "stop":
            trainer.should_stop = True
            self._say_once(f"AmpWatch stops the run after {diagnosis.finding.value} at step {diagnosis.step} "
                           "(on_unrecoverable='stop').", key=f"stop:{diagnosis.step}")
        elif self.on_unrecoverable == "raise":
            raise AmpWatchError(diagnosis.headline() + "\nFix: " + diagnosis.advice, diagnosis)

    def _flush_timeline(self) -> None:
        """Write the buffered timeline rows; samples the latest loss (a log step already synchronises)."""
        if self.timeline is not None:
            self.timeline.flush(read_last_loss=self._last_tape.read if self._last_tape else None)

    def _run_stats(self) -> RunStats | None:
        if self.machine is None:
            return None
        return RunStats(steps=self.machine.steps_seen, skipped=self.machine.skipped_total,
                        nonfinite=self.machine.nonfinite_total,
                        scale=self._mirror.scale if self._mirror is not None else None,
                        precision=self.machine.mode.value)

    def _print_summary(self, stats: RunStats) -> None:
        """A few lines on what happened in the fit, or one saying it was healthy."""
        log_dir = self.event_log.dir.parent if self.event_log is not None else None
        if self._console is None:
            self._console = Console(highlight=False)
        for line in summary_lines(self.diagnoses, stats, log_dir):
            self._console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _log_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At Lightning's own log steps only: one scale read (it keeps the host mirror honest), then the metrics
        straight to the loggers through Lightning's logger connector, at the step Lightning logs at.

        Not ``pl_module.log``: its bookkeeping costs milliseconds per call, more than all healthy steps between
        two log steps together. The windowed skip rate and the cross-rank sum are torchmetrics, computed (and,
        under DDP, synchronised) only when there is a logger to receive them.
        """
        info = self.precision
        scale = None
        if info is not None and info.scaler is not None and self._mirror is not None:
            scale, tracker = read_scale(info.scaler)
            self._mirror.reconcile(scale, tracker)
        steps, skipped, nonfinite = self._log_steps, self._log_skipped, self._log_nonfinite
        self._log_steps = self._log_skipped = self._log_nonfinite = 0
        if not trainer.loggers:
            return
        assert self.machine is not None and self._skip_rate is not None and self._nonfinite_sum is not None
        if steps:
            flags = torch.zeros(steps, device=pl_module.device)
            flags[:skipped] = 1.0
            self._skip_rate.update(flags)
        self._nonfinite_sum.update(torch.tensor(float(nonfinite), device=pl_module.device))
        metrics: dict[str, float] = {
            "ampwatch/skipped_steps": float(self.machine.skipped_total),
            "ampwatch/nonfinite_losses": float(self._nonfinite_sum.compute()),
            "ampwatch/skip_rate": float(self._skip_rate.compute()),
        }
        if scale is not None:
            metrics["ampwatch/scale"] = scale
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and hasattr(connector, "log_metrics"):
            connector.log_metrics(metrics)  # Lightning's own step for the x-axis, and trainer.logged_metrics
        else:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "diagnoses": [d.to_dict() for d in self.diagnoses],
            "machine": None if self.machine is None else self.machine.state_dict(),
            "applied": [r.to_dict() for r in self.applied],
            "policy": self._policy.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.machine is None:
            self._loaded_state = dict(state_dict)  # on_fit_start builds the machine, then restores
        else:
            self._restore(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        self.diagnoses = [Diagnosis.from_dict(d) for d in state.get("diagnoses", ())]
        self.applied = [AppliedRemedy.from_dict(a) for a in state.get("applied", ())]
        self._policy.load_state_dict(state.get("policy", {}))
        if self.machine is not None and state.get("machine"):
            self.machine.load_state_dict(state["machine"])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_console"] = None
        return state

    # ------------------------------------------------------------------ failure containment

    def _internal_failure(self, where: str, err: Exception) -> None:
        key = f"{where}:{type(err).__name__}"
        if key not in self._failures:
            self._failures.add(key)
            warnings.warn(f"AmpWatch hit an internal error in {where} and keeps watching without it: "
                          f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
        self._stepped = False  # never carry a half-built step into the next one
        if len(self._failures) >= 5:
            self._disabled = True
            warnings.warn("AmpWatch has failed repeatedly and switches itself off for this run; training goes on.",
                          RuntimeWarning, stacklevel=3)

    def _say_once(self, message: str, key: str | None = None) -> None:
        key = key or message
        if key not in self._said:
            self._said.add(key)
            rank_zero_info(f"AmpWatch: {message}")
