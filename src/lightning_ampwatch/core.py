"""``RunWatcher``: the whole watch of one training run, with no Lightning import. Adapters translate their
framework's hooks into its calls and implement :class:`Host` for what only the framework knows.

The contract (what an adapter codes against)
============================================

An adapter (``AmpWatch`` for Lightning, ``FabricWatch`` for Fabric) owns a :class:`RunWatcher` made from a
:class:`~lightning_ampwatch.config.WatchConfig`, and a :class:`Host` object of its own. It calls, in this order:

1. ``watcher.load_state_dict(state)`` (optional, any time before ``start``): a checkpointed state, restored at
   ``start`` part by part.
2. ``watcher.start(host)``: once the model, optimizers and precision exist. Builds the rooms (ledger, machine,
   investigations, guards, treatment, reporters), reapplies restored remedies, checks the recipe set-up.
3. ``watcher.begin_training()``: once the scaler's own checkpointed state is loaded (Lightning:
   ``on_train_start``; Fabric: right after ``start``). One read of the scaler.
4. Per batch (every micro-batch, including accumulation), on ``route = watcher.route`` (the per-step owner's
   :class:`~lightning_ampwatch.steps.route.StepRoute`, made per run: read it from the watcher at each call):

   - ``route.batch_start()`` — before the forward (only needed if ``route.wants_batch_start``; cheap);
   - ``route.before_backward(loss)`` — the tensor backward runs from: under a GradScaler the *scaled* loss
     (``scaler.scale(loss)``; the ledger divides by the scale it mirrors, and the recipe guards step over the
     scaler's multiplication at the top of its graph), otherwise the loss. Never read on a healthy step;
   - ``route.before_optimizer_step(optimizer)`` — each raw optimizer, before it steps (or the scaler steps it);
   - ``route.batch_end(batch, batch_idx)`` — after the batch, once the optimizer step (if any), the scaler's
     update and the step-interval schedulers are done, with ``host.global_step`` already counting that step.
     This is the optimizer-step boundary: steps are taken in, log steps run (every ``host.log_every``
     optimizer steps), and remedies and rollbacks are applied here. ``(batch, batch_idx)`` is what a replay
     hands ``host.step_loss`` again: keep it as the loss function takes it. An adapter whose framework hands the
   batch's loss and its count of optimizer steps to the batch's end may take the lean route
   (``route.take_lean``) and its express lane (``route.express``).

5. ``watcher.finish()`` at the end of training (Lightning: ``on_fit_end``), then ``watcher.close()``
   (always, also after an exception: removes every hook and patch; never raises).
6. ``watcher.state_dict()`` whenever the framework checkpoints.

Every call is safe: an internal failure is warned once and the watch degrades (after ``MAX_FAILURES`` distinct
failures it switches itself off); only :class:`~lightning_ampwatch.taxonomy.AmpWatchError`
(``on_unrecoverable="raise"``) reaches the training loop.

What the adapter reads back: ``diagnoses`` (the journal: every published diagnosis, updated in place when a remedy's
outcome is known), ``applied`` (remedies applied), ``machine``, ``event_log``, ``precision``.

The :class:`Host` protocol
--------------------------
Attribute names follow the Lightning ``Trainer`` where the rooms already read them (``global_step``,
``optimizers``, ``loggers``, ``is_global_zero``), so a host is passed to the rooms where a trainer was. The
watcher drops its host in ``close()``: an adapter that pickles (``ddp_spawn``) holds no framework object after a
run. Under several processes every rank makes the same calls in the same order; the watcher's own collectives
(``torch.distributed``, on anomalous steps only, all through :mod:`lightning_ampwatch.protocol`) are made on all
ranks together.
``hold_lr_on_skip`` is the adapter's to install (the config carries the flag): how schedulers are stepped is
the framework's business; :meth:`RunWatcher.last_step_skipped` answers whether to hold them.

Who changes what: only the route (:class:`~lightning_ampwatch.steps.route.StepRoute`) feeds the machine, the
timeline and the trajectory control (from the records the ledger returns for every step). What follows an alarm
(investigation, decision, remedy, outcome, publication) is the episode owner's
(:class:`~lightning_ampwatch.episode.Episodes`, whose journal ``diagnoses`` is): it decides, and hands the watcher
typed actions (publish, roll back, apply, realign its view, stop) that the watcher applies (:meth:`RunWatcher._act`),
the one place where an episode changes the run. The watcher itself keeps the lifecycle (building the rooms each run,
the fit's end, ``close``), failure containment, and applying those actions.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, TypeVar

from lightning_ampwatch import distributed
from lightning_ampwatch.config import WatchConfig
from lightning_ampwatch.episode import Action, Apply, Episodes, Publish, Realign, Rollback, Stop
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.host import Host
from lightning_ampwatch.investigate import Investigations
from lightning_ampwatch.machine import AmpStateMachine
from lightning_ampwatch.remedies import AppliedRemedy, RemedyContext
from lightning_ampwatch.remedies.treatment import Treatment
from lightning_ampwatch.reporters import Reporters
from lightning_ampwatch.signals import PrecisionInfo, scaler_config
from lightning_ampwatch.state import STATE_VERSION, WatchState  # noqa: F401 - STATE_VERSION: the contract's
from lightning_ampwatch.steps import StepLedger
from lightning_ampwatch.steps.route import StepRoute, realign
from lightning_ampwatch.summary import RunStats
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis
from lightning_ampwatch.trajectory.control import TrajectoryControl

#: Internal failures after which the watch switches itself off for the run (each is warned once).
MAX_FAILURES = 5


F = TypeVar("F", bound=Callable[..., Any])


def _guarded(call: F) -> F:
    """Run a call so that an internal failure is reported once and never reaches the training loop."""

    @functools.wraps(call)
    def wrapper(self: "RunWatcher", *args: Any, **kwargs: Any) -> Any:
        if self.disabled:
            return None
        try:
            return call(self, *args, **kwargs)
        except AmpWatchError:
            raise
        except Exception as err:  # noqa: BLE001 - the point is that nothing escapes
            self.internal_failure(call.__name__, err)
            return None

    return wrapper  # type: ignore[return-value]


def _known_cause(err: Exception) -> str | None:
    """What to do about a failure whose cause lies in how the model was built, when it is known."""
    if "donated buffers" in str(err):
        return ("This is a torch.compile'd module whose backward donates its buffers: it cannot be run backward a "
                "second time, which a replay needs. Set torch._functorch.config.donated_buffer = False before the "
                "module is first compiled to let AmpWatch replay and locate faults in it.")
    return None


class RunWatcher(WatchState):
    """Owns the rooms of one watched run: builds them, contains their failures and applies the episode's actions;
    every step goes through :attr:`route` (see the module docstring)."""

    def __init__(self, config: WatchConfig) -> None:
        self.config = config
        self.host: Host | None = None
        self._loaded_state: dict[str, Any] | None = None
        self._reset()

    def _reset(self) -> None:
        """Per-run state: a second run with the same instance starts afresh (unless it resumes a checkpoint)."""
        self.machine: AmpStateMachine | None = None
        self.reporters: Reporters | None = None
        self.ledger: StepLedger | None = None
        self.trajectory: TrajectoryControl | None = None  # the FP32 trajectory control (snapshots), when on
        self.investigations: Investigations | None = None
        self.guards = RecipeGuards()
        self.treatment = Treatment.for_run(self.config)
        # the episode owner: alarm, investigation, decision, remedy, outcome, publication (``diagnoses`` is its journal)
        # the per-step owner's route: the adapter's per-step calls, the express lane, the log step, the deferral
        self.route = StepRoute(self)
        self.episodes = Episodes(self, self.treatment, act=self._act, probe_changed=self.route.sync_investigations)
        self.world_size = 1
        #: the reporters' timeline, None when none is written (the route and the episode record steps in it)
        self.timeline: Any = None
        self.disabled = False
        self._failures: set[str] = set()
        self._said: set[str] = set()
        # what this rank says to the others outside an anomaly's own agreement: the relay to rank zero, whether the
        # ranks still meet anomalies together, and the bystander this rank becomes if its watch switches off (the
        # route and the episode owner read it)
        self.ranks = distributed.CrossRank(1)

    @property
    def applied(self) -> list[AppliedRemedy]:
        """Every remedy applied in this run, in order (also after a resume)."""
        return self.treatment.applied

    @applied.setter
    def applied(self, value: list[AppliedRemedy]) -> None:
        self.treatment.applied = list(value)

    @property
    def diagnoses(self) -> list[Diagnosis]:
        """The journal: every published diagnosis, updated in place when a remedy's outcome is known."""
        return self.episodes.diagnoses

    @diagnoses.setter
    def diagnoses(self, value: list[Diagnosis]) -> None:
        self.episodes.diagnoses = list(value)

    @property
    def event_log(self) -> Any:
        return self.reporters.event_log if self.reporters is not None else None

    @property
    def log_every(self) -> int:
        """The framework's log interval in optimizer steps (0: no log step)."""
        return self.route.log_every

    def caught_up(self) -> "RunWatcher":
        """The watcher with every clean step taken in (the ledger's :meth:`~StepLedger.settle`): what an adapter reads
        the machine of between log steps (the ledger hands a healthy run's steps over in runs), a checkpoint holds, and
        the fit's end starts from."""
        try:
            if self.ledger is not None:
                self.ledger.settle()
        except Exception as err:  # noqa: BLE001
            self.internal_failure("the machine's catch-up", err)
        return self

    def state_dict(self) -> dict[str, Any]:
        self.caught_up()  # a checkpoint between log steps holds every step taken
        return super().state_dict()

    @property
    def precision(self) -> PrecisionInfo | None:
        return self.ledger.precision if self.ledger is not None else None

    def last_step_skipped(self) -> bool:
        """Whether the optimizer step just taken was skipped by the scaler (a host flag, no device read; fused
        optimizers excepted), for an adapter's ``hold_lr_on_skip``."""
        return self.ledger is not None and self.ledger.last_step_skipped()

    # ------------------------------------------------------------------ lifecycle

    @_guarded
    def start(self, host: Host) -> None:
        loaded, self._loaded_state = self._loaded_state, None
        self._reset()
        self.host = host
        config, thresholds = self.config, self.config.thresholds
        assert thresholds is not None
        info = host.precision()
        self.machine = AmpStateMachine(info.mode, thresholds, scaler_config(info.scaler) if info.scaler else {},
                                       early_startup="lower_init_scale" in config.remedies)
        if loaded is not None:
            self._restore(loaded)
            info = host.precision()  # a restored bf16 fallback swapped the plugin
            self.machine.reconfigure(mode=info.mode)
        self.world_size = host.world_size
        self.ranks = distributed.CrossRank(self.world_size, config.on_unrecoverable)
        self.machine.divergence_opens_episode = self.world_size == 1
        self.reporters = Reporters.for_run(config, host, info.mode.value, self.world_size, say=self._say)
        self.timeline = self.reporters.timeline
        if loaded is not None:
            self.reporters.carry_over(self.diagnoses)
        self.ledger = StepLedger(info, device_type=host.device.type, world_size=self.world_size)
        self.investigations = Investigations.for_run(config, host, self.machine, self.world_size,
                                                     on_failure=self.internal_failure)
        self.route.sync_investigations()
        if info.note:
            self.say_once(info.note)
        self._attach_guards()
        said = self.treatment.across_ranks(self.world_size)  # replay_episode is off under DDP
        if said:
            self.say_once(said)

    @_guarded
    def begin_training(self) -> None:
        """The scaler's checkpointed state is loaded by now: mirror it (one read per run)."""
        host, ledger = self.host, self.ledger
        assert host is not None and ledger is not None
        self.route.begin(host)  # the ledger started, the machine told of its optimizers and scaler
        self._start_trajectory()
        ledger.runs.hand_to_watch(self.machine, self.timeline)  # who takes the clean steps the ledger holds back
        self.route.plan_deferral()

    def _start_trajectory(self) -> None:
        """The FP32 trajectory control, where it is on (again after a remedy swaps the precision: snapshots of the
        old arithmetic replay no more); the ledger hands it the clean steps' batches it holds back."""
        if self.investigations is None or self.host is None or self.ledger is None:
            return
        control = TrajectoryControl.for_run(self.config, self.host, self.ledger, self.say_once, self.internal_failure)
        if control is not None:
            self.trajectory = control

    def _attach_guards(self) -> None:
        assert self.ledger is not None and self.host is not None
        self.guards.attach(self.host, self.host.module, self.ledger.precision, self.episodes.emit,
                           scale_reader=self.ledger.scale.mirrored_scale)

    def finish(self) -> None:
        """The end of training: what is in flight resolved, a watched remedy left unjudged, the summary."""
        self.caught_up()  # every clean step taken in: the relayed diagnoses below are dated after them
        if not self.disabled:
            self._finish()
        # The last exchange, outside the guarded work above: every rank is here and must take part, also one whose
        # watch is off or whose end-of-run work just failed (skipping it would leave the others waiting in it)
        relayed: list[Diagnosis] = []
        try:
            relayed = self.episodes.publish_exchanged(self.ranks.at_end())
        except Exception as err:  # noqa: BLE001
            self.internal_failure("finish", err)
        if not self.disabled:
            self._summarize()
        self.close()
        self.ranks.end_at_fit_end(relayed)  # a rank asked to end the run after the last log step

    @_guarded
    def _finish(self) -> None:
        self.episodes.finish()  # what is in flight resolved; a remedy still watched: its outcome stays unknown

    @_guarded
    def _summarize(self) -> None:
        if self.reporters is not None:
            mirror = self.ledger.mirror if self.ledger is not None else None
            self.reporters.finish(self.diagnoses, RunStats.of_run(self.machine, mirror))

    def close(self) -> None:
        """Leave the run as it was found: optimizer hooks, clipping functions, the scheduler hook, probes; the
        timeline written (a run that crashed keeps the steps that led up to it). Never raises; idempotent."""
        # (the ledger's stop hands the clean steps not taken in yet over first: the timeline and the machine as they
        # would be)
        for undo in (self.ledger.stop if self.ledger is not None else None,
                     self.guards.detach,
                     self.investigations.close if self.investigations is not None else None,
                     self.reporters.close if self.reporters is not None else None):
            if undo is None:
                continue
            try:
                undo()
            except Exception as err:  # noqa: BLE001
                self.internal_failure("clean-up", err)
        # What holds the framework, the model or snapshots goes: the watcher pickles after a run, and small
        self.investigations = None
        self.route.sync_investigations()
        self.trajectory = None
        self.timeline = None
        self.treatment.forget_states()
        self.host = None

    # ------------------------------------------------------------------ the episode's actions, applied

    def _act(self, action: Action) -> Any:
        """Apply what the episode owner decided (:mod:`lightning_ampwatch.episode`), and answer with what was done:
        the only place where an episode changes the run (a rollback, a remedy, a stop) or reaches a sink."""
        if isinstance(action, Publish):
            reporters, diagnosis = self.reporters, action.diagnosis
            if reporters is not None:
                if action.remedy_at is not None:
                    reporters.record_remedy(action.remedy_at, diagnosis.remedy)
                reporters.publish(diagnosis, self.host.loggers if self.host is not None else [])
            return None
        if isinstance(action, Rollback):
            return self.treatment.roll_back(action.diagnosis, now=action.now, control=self.trajectory,
                                            decide=lambda v: self.episodes.decide(lambda: v), host=self.host,
                                            untouched=action.untouched, gather=distributed.gather)
        if isinstance(action, Apply):
            return self.treatment.policy.apply(self.remedy_context(), action.diagnosis, action.choice,
                                               step=action.step)
        if isinstance(action, Realign):  # the watch's own view in line with what a remedy or a rollback changed
            assert self.ledger is not None and self.host is not None and self.machine is not None
            switched = realign(self.ledger, self.machine, self.host, action.effects)
            if switched is not None:  # what was built for the old arithmetic, built again
                if self.investigations is not None:
                    self.investigations.switch_mode(switched.mode)
                self._attach_guards()
                self._start_trajectory()  # snapshots of the old arithmetic replay no more
            return None
        if isinstance(action, Stop):
            diagnosis = action.diagnosis
            if action.raise_error:
                raise AmpWatchError(diagnosis.headline() + "\nFix: " + diagnosis.advice, diagnosis)
            if self.host is not None:
                self.host.stop()
            self.say_once(f"stopping the run after {diagnosis.finding.value} at step {diagnosis.step} "
                          "(on_unrecoverable='stop').", key=f"stop:{diagnosis.step}")
            return None
        raise TypeError(f"not an episode action: {action!r}")  # pragma: no cover - the five above are all

    def remedy_context(self) -> RemedyContext:
        assert self.host is not None
        scaler = self.ledger.precision.scaler if self.ledger is not None else None
        return self.host.remedy_context(scaler, self.machine.max_safe_scale if self.machine is not None else None,
                                        self.guards)

    # ------------------------------------------------------------------ failure containment

    def internal_failure(self, where: str, err: Exception) -> None:
        user = getattr(self.host, "user_failure", None)
        said = user(err) if callable(user) else None  # the user's own code failed under the watch: said as such
        stepped = self.ledger is not None and self.ledger.stepped  # a step taken but never closed: it still counts
        if self.ledger is not None:
            self.ledger.stepped = False  # after any failure: never carry a half-built step into the next one
        if said is not None:
            if said not in self._said:
                self._said.add(said)
                warnings.warn(said, UserWarning, stacklevel=3)
            return
        key = f"{where}:{type(err).__name__}"
        if key not in self._failures:
            self._failures.add(key)
            known = _known_cause(err)
            warnings.warn(f"AmpWatch hit an internal error in {where} and keeps watching without it: "
                          f"{type(err).__name__}: {err}" + (f"\n{known}" if known else ""), RuntimeWarning,
                          stacklevel=3)
        if len(self._failures) >= MAX_FAILURES and not self.disabled:
            # under several ranks it keeps its place where the others still meet it: a bystander
            left = self.treatment.steps_left(self.machine.steps_seen) if self.machine is not None else None
            self.ranks.step_aside(self.ledger, self.reporters, self.host, self.route.log_every, stepped=stepped,
                                  remedy_left=left)
            self.disabled = True
            self.route.wants_batch_start = False
            warnings.warn("AmpWatch has failed repeatedly and switches itself off for this run; training goes on.",
                          RuntimeWarning, stacklevel=3)

    def _say(self, message: str) -> None:
        """The host's line (a method of the watcher, not the host's: the reporters must not hold the host)."""
        if self.host is not None:
            self.host.say(message)

    def say_once(self, message: str, key: str | None = None) -> None:
        key = key or message
        if key not in self._said and self.reporters is not None:
            self._said.add(key)
            self.reporters.say(message)

