"""The step route: what every step goes through, from the adapter's per-step calls to the ledger and on.

:class:`StepRoute` owns the hooks' hot path: ``batch_start``, ``before_backward``, ``before_optimizer_step`` and
``batch_end`` (an adapter calls them on ``watcher.route``), the lean route and its express lane, the log step (the
metrics, the one packed read, the log cadence), and the plan of how far the ledger may hold clean steps back. It
hands each record the ledger closes to the trajectory control, the machine and the timeline, and the resolved
steps to the episode owner. Everything else (the lifecycle, failure containment, applying the episode's actions) is
the front's (:class:`~lightning_ampwatch.core.RunWatcher`, ``watch`` here), whose rooms the route reads by their
public names: built per run by the front, so read through it rather than copied. :func:`realign` brings the
per-step view (the ledger, the machine it feeds) in line with what a remedy or a rollback changed, where the front
applies the episode's ``Realign`` action.

The per-step calls catch their own failures inline and hand them to the front's ``internal_failure`` rather than
going through the front's guard decorator: on a healthy step they run a few dozen bytecodes, and a wrapper call would
be a good part of that. Every one of them still reaches the same containment: nothing but an ``AmpWatchError``
(``on_unrecoverable="raise"``) leaves them.

The adapter binds nothing: it reads ``watcher.route`` and calls the method, as it called the front's before (no
call added on a step). The state the hot path reads (the lean route, the probe, the step count, the express lane's
state, the log intervals) is this object's plain attributes.
"""

from __future__ import annotations

from time import perf_counter as _clock  # the log cadence's clock (a name of its own: tests script it)
from typing import Any

import torch

from lightning_ampwatch.remedies.base import Effect
from lightning_ampwatch.signals import PrecisionInfo
from lightning_ampwatch.steps.cadence import LogCadence
from lightning_ampwatch.steps.losses import LOSS_RING_MAX_STEPS
from lightning_ampwatch.steps.records import ClosedStep
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis

#: Why a run whose batches step several optimizers, each on a loss of its own, has no healthy loss level.
LOSSES_APART = ("each batch steps several optimizers, each on a loss of its own (a GAN's discriminator and "
                "generator), so the losses are not one series to take a level or a climb from")

#: The most clean steps taken in later at once (a run with no log steps still hands them over this often). Taking a
#: held step in costs about 1 us, nearly all of it reading objects the training steps since pushed out of the cache,
#: so a run's hand-over costs in proportion to its length wherever it happens. Measured for issue 29 on the toy: with
#: the runs (and, on the CPU, the losses' reads) stretched to the log cadence's interval (150 steps; nine pairs of
#: runs at a load of 0.3 to 3.9), a log step added 501 to 555 us, over its budget of 400; held to 64 steps, 281 to
#: 387 us, and the step where a run of 64 is handed over between two log steps adds 269 to 336 us, once in 86
#: (``overhead.py`` prints it as a kind of step of its own).
MAX_DEFERRED = 64


class StepRoute:
    """The route of every step of one run, from the adapter's per-step calls on (see the module docstring)."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch  # the front: its rooms (ledger, machine, treatment, ...) and its failure containment
        #: whether the adapter need call ``batch_start``: what the investigations want, as a plain attribute
        #: refreshed whenever their state can change (:meth:`sync_investigations`; read on every step)
        self.wants_batch_start = False
        self.probing = False  # a live probe is armed for this training step
        # The lean route (:meth:`take_lean`): the adapter hands each batch's loss and the framework's count of
        # optimizer steps to ``batch_end``, and calls ``before_backward`` / ``before_optimizer_step`` only while wanted.
        self.lean = False
        #: what the adapter reads after each batch to know which per-step calls are wanted (``batch_start``,
        #: ``before_backward``, ``before_optimizer_step``): a new tuple whenever one of them may have changed (compared
        #: by identity, one compare per batch)
        self.wanted_calls: tuple[bool, bool, bool] = (False, True, True)
        self.steps_done = -1  # the lean route: the framework's optimizer-step count at the last batch end
        self.lane_failed = False  # the express lane raised once: closed for the rest of the run
        self.log_every = 0  # the framework's log interval in optimizer steps (0: no log step)
        # the log step's work runs every ``judge_every`` steps while the run is quiet (a multiple of ``log_every``,
        # lengthened once by the log cadence when that work would take more than its share of a fast step)
        self.judge_every = 0
        self.log_cadence: LogCadence | None = None
        self.steady_last: tuple[int, float] | None = None  # (step, end) of the last steady snapshot step timed

    def begin(self, host: Any) -> None:
        """At train start: the framework's log interval, the log cadence (one process only: under DDP the log step is
        where the ranks meet, so every rank must run it at once), the ledger started on the host, and the machine
        told of what the ledger found (the optimizers' names, the scaler's growth settings)."""
        watch = self.watch
        ledger, machine = watch.ledger, watch.machine
        self.log_every = self.judge_every = log_every = max(int(host.log_every), 0)
        self.log_cadence = LogCadence(log_every) if log_every and watch.world_size == 1 else None
        self.steady_last = None
        ledger.start(host, log_every)
        machine.optimizer_names = ledger.optimizer_names  # (several optimizers)
        if ledger.scaler_active:
            machine.reconfigure(scaler_config=ledger.scaler_config)

    def sync_investigations(self) -> None:
        """Refresh :attr:`wants_batch_start` and the probing flag from the investigations (after a call that can
        arm or finish a probe; never on a healthy step)."""
        watch = self.watch
        investigations = watch.investigations
        self.wants_batch_start = bool(not watch.disabled and investigations is not None
                                      and investigations.wants_batch_start)
        self.probing = investigations is not None and investigations.probing
        self.sync_wanted()

    def sync_wanted(self) -> None:
        """The per-step calls the adapter must make (see :attr:`wanted_calls`)."""
        lean = self.lean and not self.watch.disabled
        self.wanted_calls = (self.wants_batch_start, not lean or self.watch.guards.wants_loss,
                             not lean or self.probing)

    # Why the lean route and its express lane stay beside the full route (one route would be simpler to follow):
    # measured for issue 29 on the toy (``benchmarks/step_counts.py`` and ``overhead.py --quick``, interleaved runs
    # on the shared 2-core CPU, load 3 to 5), an ordinary step once the cadences have decided takes, with the lean
    # route, its express lane and the hooks idled, 12 Python calls and 6.0 to 8.8 us (after the ledger's split, the
    # lane called through the ledger: 13 calls and 5.8 to 7.7 us, load 0.3 to 3.9); with one route for every step,
    # 24 calls and 12.8 to 25.0 us. The budget is 25 calls and 8 us: one route meets the calls, not the time, so the
    # three stay together (the lean route needs the hooks idled: it is what spares Lightning's calls). The earlier
    # measurements, route by route, are in git's history of this comment and in ``benchmarks/FINDINGS.md``.
    def take_lean(self, host: Any, steps_done: int) -> bool:
        """Take the lean route from now on, where it holds the same information as the full one: an adapter whose
        framework hands each batch's (unscaled) loss to the batch's end and counts the optimizer steps it runs,
        skipped ones included (Lightning's automatic optimization), in one process (a DDP rank whose watch switched
        itself off keeps its place through ``before_optimizer_step``), without DeepSpeed (whose engine decides
        what a step is). Then ``before_backward`` is wanted only while the recipe guard reads the loss's graph (the
        first backward) and ``before_optimizer_step`` only while a probe is armed: two framework hooks fewer per
        step. ``steps_done``: the framework's count of optimizer steps now. Returns whether the route is taken."""
        watch = self.watch
        ledger = watch.ledger
        self.lean = bool(not watch.disabled and ledger is not None and watch.world_size == 1
                         and ledger.precision.engine is None and getattr(host, "automatic", False))
        self.steps_done = steps_done
        self.sync_wanted()
        return self.lean

    # ------------------------------------------------------------------ the per-step calls

    def batch_start(self) -> None:
        """Before a batch's forward: the RNG state (for an exact replay), or a live probe waiting to be armed."""
        watch = self.watch
        investigations, host = watch.investigations, watch.host
        if watch.disabled or investigations is None or host is None or not investigations.wants_batch_start:
            return
        try:
            investigations.batch_start(host.module, host.device)
            self.sync_investigations()
        except Exception as err:  # noqa: BLE001
            watch.internal_failure("batch_start", err)

    def before_backward(self, loss: torch.Tensor) -> None:
        watch = self.watch
        if watch.disabled or watch.ledger is None:
            return
        try:
            if not self.lean:  # (the lean route takes the loss at the batch's end)
                watch.ledger.backward(loss)
            guards = watch.guards
            if guards.wants_loss:
                guards.on_before_backward(loss)
                if self.lean and not guards.wants_loss:
                    self.sync_wanted()  # checked: the adapter need not call here any more
        except Exception as err:  # noqa: BLE001
            watch.internal_failure("before_backward", err)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        watch = self.watch
        ledger = watch.ledger
        if watch.disabled or ledger is None:
            if watch.ranks.bystander is not None:
                watch.ranks.bystander.optimizer_step()
            return
        try:
            if not self.lean:  # (the lean route learns of the step from the framework's count, at batch end)
                several = ledger.optimizers.ids is not None  # several optimizers: which one steps (one scaler's skips
                index = ledger.optimizer_index(optimizer) if several else None  # are each one's own)
                if ledger.stepped:  # manual optimization: a second step in the same batch, a step of its own
                    quiet = watch.machine.quiet
                    self.take_closed(ledger.close(watch.host, quiet, split=True), quiet)
                    if ledger.losses_apart:
                        watch.machine.healthy.apart(LOSSES_APART)
                if several:
                    ledger.optimizers.current = index
                ledger.optimizer_step_begins()  # the step itself is read when it is over, in batch_end
            if self.probing:
                watch.investigations.optimizer_step(optimizer)
        except Exception as err:  # noqa: BLE001
            watch.internal_failure("before_optimizer_step", err)

    def batch_end(self, batch: Any, batch_idx: int, loss: Any = None, steps_done: int = -1) -> None:
        """A batch is over. On the lean route (:meth:`take_lean`) the adapter also hands its loss (None: no backward
        ran) and the framework's count of optimizer steps so far: one more than at the last batch, a step was taken."""
        watch = self.watch
        ledger = watch.ledger
        if watch.disabled or ledger is None:
            if watch.ranks.bystander is not None:
                watch.ranks.bystander.batch_end()
            return
        try:
            if self.lean:
                if loss is not None:
                    ledger.add_loss(loss)
                if steps_done != self.steps_done:  # an optimizer step ran in this batch (or was skipped by the scaler)
                    self.steps_done = steps_done
                    ledger.stepped = True  # (optimizer_step_begins, less what the lean route never has: DeepSpeed's
                    # boundary, a second optimizer's split)
            investigations = watch.investigations
            # what a replay needs of this batch (``Investigations.micro_batch``, inline: one is made every batch)
            rng = investigations.batch_rng if investigations is not None else None
            micro_batch: Any = (batch, batch_idx) if rng is None else (batch, batch_idx, *rng)
            if self.probing:
                ledger.keep_batch(micro_batch)
                micro_batch = None
                for diagnosis in investigations.finish_probe():  # the armed step is over
                    watch.episodes.emit(diagnosis)
                self.sync_investigations()
            if not ledger.stepped:
                if micro_batch is not None:
                    ledger.keep_batch(micro_batch)
                return  # mid-accumulation: no optimizer step in this batch
            # the machine's quiet, read once: closing a step leaves the machine as it is
            quiet = watch.machine.quiet
            control = watch.trajectory
            cadence = control.cadence if control is not None else None
            # a snapshot step the "auto" cadence checks its interval against, timed whole: what the hooks pay for it in
            # the steady run, once the log cadence has decided too (until then log steps hand the held steps over)
            log_cadence = self.log_cadence
            timed = (cadence is not None and cadence.decided and not cadence.checked
                     and (log_cadence is None or log_cadence.decided)
                     and ledger.step_index % control.ring.every == 0)  # type: ignore[union-attr]
            start = _clock() if timed else 0.0
            closed = ledger.close(watch.host, quiet, micro_batch)
            if closed is not None:  # None: no backward ran, or a clean step held back (``ledger.runs``)
                self.take_closed(closed, quiet)
            if timed:
                self.steady_snapshot(ledger.step_index - 1, start, _clock())
            log_every = self.log_every
            if log_every and ledger.step_index % log_every == 0:
                self.log_step()
            treatment = watch.treatment
            if treatment.due or treatment.watch is not None:  # an optimizer-step boundary: safe to change the run
                self.at_step_boundary()
        except AmpWatchError:
            raise
        except Exception as err:  # noqa: BLE001
            watch.internal_failure("batch_end", err)
        finally:
            self.open_lane()

    def express(self, loss: Any, batch: Any, batch_idx: int) -> bool:
        """The lean route's express lane: a healthy batch end in one call, with no framework count to read. Taken
        when the batch ran one optimizer step, which the scaler took, and nothing but its bookkeeping is due (the
        ledger's :meth:`ExpressLane.take`; the lane is opened, up to a step, at the end of every other batch end:
        :meth:`open_lane`). Returns False, having changed nothing, otherwise: the adapter then calls
        :meth:`batch_end` with the framework's count, as for any batch. ``loss``: the batch's (unscaled) loss."""
        watch = self.watch
        ledger = watch.ledger
        if ledger is None or self.probing or watch.disabled:
            return False
        try:
            investigations = watch.investigations
            rng = investigations.batch_rng if investigations is not None else None
            if ledger.express(loss, (batch, batch_idx) if rng is None else (batch, batch_idx, *rng)):
                self.steps_done += 1  # (the framework counted this step: one optimizer step per batch here)
                return True
        except Exception as err:  # noqa: BLE001
            watch.internal_failure("express", err)
            self.lane_failed = True  # the usual way from now on
            ledger.lane.until = 0
        return False

    def open_lane(self) -> None:
        """After a batch end: up to which step the express lane may take the next batches (none unless the lean
        route is taken and the machine is quiet with no remedy due or watched; the ledger adds its own limits).
        Nothing the lane takes changes any of this. On the lean route the machine changes only inside a batch end
        (and at the fit's end), a remedy becomes due only through the episode owner's ``emit``, which closes the
        lane, and a probe is checked at each lane call."""
        watch = self.watch
        ledger, machine, treatment = watch.ledger, watch.machine, watch.treatment
        if ledger is None or not self.lean:  # (the full route: never opened)
            return
        try:
            if (not self.lane_failed and not watch.disabled and machine is not None and machine.quiet
                    and not treatment.due and treatment.watch is None):
                ledger.lane.open(self.log_every)
                return
        except Exception as err:  # noqa: BLE001
            watch.internal_failure("the express lane", err)
        ledger.lane.until = 0

    # ------------------------------------------------------------------ steps -> machine -> diagnoses

    def take_closed(self, closed: ClosedStep | None, quiet: bool) -> None:
        """The one route of every step: its batches to the trajectory control, then a clean step to the machine
        and the timeline at once, or the steps resolved now through the episode owner's ``take``. ``quiet``: the
        machine's, as read before the step was closed (closing it changes nothing in the machine)."""
        if closed is None:
            return
        watch = self.watch
        machine, ledger = watch.machine, watch.ledger
        assert machine is not None and ledger is not None
        control = watch.trajectory
        if control is not None:  # every rank snapshots at the same steps: under DDP what the ranks agree on decides
            if watch.world_size == 1:
                control.note_step(closed.step, closed.batches, quiet, machine.has_reference)
            else:
                control.note_step(closed.step, closed.batches, machine.quiet_agreed, True)
        if closed.clean:
            machine.observe_clean(closed.step, closed.scale, closed.grew, closed.lrs, closed.loss)
            timeline = watch.timeline
            if timeline is not None:
                if closed.loss is None:
                    timeline.record_clean(closed.step, closed.scale, closed.lrs)
                else:
                    timeline.record_step(closed.step, skipped=False, loss=closed.loss, loss_finite=True,
                                         lrs=closed.lrs)
            if ledger.unnoted:  # the ring of held losses was full: read just now
                machine.note_losses(ledger.take_unnoted())
                watch.episodes.take_divergences()
        elif closed.resolved:
            watch.episodes.take(closed.resolved)
        self.plan_deferral()

    def steady_snapshot(self, step: int, start: float, end: float) -> None:
        """Step ``step``, due a snapshot once the ``"auto"`` cadence has decided, went from the ledger's close (which
        hands over the healthy steps held back) at ``start`` to the snapshot's end at ``end``: what the hooks pay for
        a snapshot step of the steady run, against which the cadence checks its interval, with the mean step since
        the previous one timed (:meth:`SnapshotCadence.observe_steady`). A step that took none (the run not quiet)
        is passed over: the next one due is timed instead."""
        watch = self.watch
        control = watch.trajectory
        cadence, ring = control.cadence, control.ring
        held = ring.snapshots
        if not (ring.enabled and held and held[-1].step == step):
            return
        last, self.steady_last = self.steady_last, (step, end)
        said = cadence.observe_steady(end - start, None if last is None else (start - last[1]) / (step - last[0]))
        if cadence.every != ring.every:
            ring.lengthen(cadence.every, control.keep)
            self.plan_deferral()
        if said is not None:
            watch.say_once(said)

    def at_step_boundary(self) -> None:
        """An optimizer-step boundary with a remedy due or watched: the episode decides; the deferral follows."""
        self.watch.episodes.at_step_boundary()
        self.plan_deferral()

    # ------------------------------------------------------------------ clean steps taken in later

    def plan_deferral(self) -> None:
        """Up to which step the ledger may defer clean steps: the next snapshot that may be due (a multiple of the
        ring's interval, taken by the full route), at most ``MAX_DEFERRED`` steps on; none while the cadence times
        every step or a remedy is watched (every step is a step boundary then)."""
        watch = self.watch
        ledger = watch.ledger
        if ledger is None:
            return
        control = watch.trajectory
        runs = ledger.runs
        runs.keep_batches = control is not None and control.ring.enabled  # nothing else reads a clean step's batches
        step = ledger.step_index  # the next step to be closed
        treatment = watch.treatment
        if watch.disabled or treatment.watch is not None or treatment.due:
            runs.until = step
            return
        # at most MAX_DEFERRED steps, even where the log cadence set the next log step that does its work further:
        # the steps held back are handed over where the run stops, so a longer run would only make that step dearer
        limit = step + MAX_DEFERRED
        if control is not None:
            every = control.defer_limit
            if every is not None:
                if every <= 0:
                    runs.until = step
                    return
                due = -(-step // every) * every  # the first multiple of ``every`` at or after ``step``
                if due < limit:
                    limit = due
        runs.until = limit

    # ------------------------------------------------------------------ the log step

    def log_step(self) -> None:
        """A framework log step: the log step's work (:meth:`at_log_step`), or, on the steps the log cadence passes
        over while the run is quiet, only the metrics (:meth:`at_metrics_step`). Timed while the cadence measures."""
        watch = self.watch
        ledger, machine, treatment = watch.ledger, watch.machine, watch.treatment
        assert ledger is not None and machine is not None
        step = ledger.step_index
        quiet = machine.quiet and treatment.watch is None and not treatment.due and not ledger.in_flight
        if step % self.judge_every and quiet:
            self.at_metrics_step()
            return
        cadence = self.log_cadence
        if cadence is None or cadence.decided or not quiet:
            self.at_log_step()
            return
        start = _clock()
        self.at_log_step()
        said = cadence.observe(step, start, _clock())
        if cadence.decided:
            self.judge_every = cadence.interval
            if not ledger.host_tape:  # an accelerator's losses: read at the log steps that do the work, not between
                ledger.losses.capacity = max(ledger.losses.capacity, min(cadence.interval, LOSS_RING_MAX_STEPS))
            if said:
                watch.say_once(said)
            self.plan_deferral()

    def at_metrics_step(self) -> None:
        """A log step whose work the log cadence passes over: the ``ampwatch/*`` metrics from host values only (the
        interval's counts, the scale the host mirrors); no read, no loss level, no timeline write."""
        watch = self.watch
        ledger, reporters, machine, host = watch.ledger, watch.reporters, watch.machine, watch.host
        assert ledger is not None and reporters is not None and machine is not None and host is not None
        steps, skipped, nonfinite = ledger.take_log_counts()
        reporters.metric_tensors(host, steps=steps, skipped=skipped, nonfinite=nonfinite)  # one process: no tensor
        mirror = ledger.mirror
        reporters.log_metrics(host, (), skipped_total=machine.skipped_total,
                              scale=None if mirror is None else mirror.scale, send=host.log_metrics)

    def at_log_step(self) -> None:
        """Once per ``log_every`` optimizer steps: resolve what is in flight, one packed read, log, flush."""
        watch = self.watch
        ledger, reporters, machine, host = watch.ledger, watch.reporters, watch.machine, watch.host
        assert ledger is not None and reporters is not None and machine is not None and host is not None
        episodes = watch.episodes
        episodes.take(ledger.drain_at_log_step(host))
        steps, skipped, nonfinite = ledger.take_log_counts()
        ranks = watch.ranks
        metrics = reporters.metric_tensors(host, steps=steps, skipped=skipped, nonfinite=nonfinite,
                                           signals=ranks.signals())
        scale, values = ledger.read_at_log_step(metrics)  # the one device-to-host read of the log step
        relayed: list[Diagnosis] = []
        if values and watch.world_size > 1:  # what another rank reached alone reaches rank zero; a rank switched off
            relayed = ranks.at_log_step(values, ledger)
            for diagnosis in relayed:
                episodes.publish_relayed(diagnosis)
            relayed = episodes.publish_reconciled() + relayed
            episodes.note_agreement()
        machine.note_losses(ledger.take_unnoted())
        episodes.take_divergences()  # the losses just read may show a finite divergence
        reporters.log_metrics(host, values, skipped_total=machine.skipped_total, scale=scale, send=host.log_metrics)
        loss = ledger.last_loss  # read just now with the others; a step with no loss read records none
        reporters.flush(None if loss is None else lambda: loss)
        self.plan_deferral()
        if ranks.end_due:  # a rank asked to end the run (on_unrecoverable, an alarm it judged alone): every rank, here
            said = ranks.end_if_due(host, relayed)
            if said is not None:
                watch.say_once(said, key=f"end:{ledger.step_index}")


def realign(ledger: Any, machine: Any, host: Any, effects: frozenset[Effect]) -> PrecisionInfo | None:
    """Bring the per-step view in line with what a remedy or a rollback changed (each declares its ``effects``): the
    ledger's precision, scaler mirror and param groups, and the machine's configuration they feed. Returns the new
    precision when it changed: the front then makes again what it built for the old arithmetic (the guards, the
    trajectory control, whose snapshots replay no more)."""
    switched = None
    for effect in effects:
        if effect is Effect.PRECISION:
            switched = host.precision()
            ledger.switch_precision(switched)
            machine.reconfigure(mode=switched.mode, scaler_config=ledger.scaler_config)
        elif effect is Effect.SCALER:
            ledger.mirror_scaler()
            if ledger.scaler_active:
                machine.reconfigure(scaler_config=ledger.scaler_config)
        elif effect is Effect.OPTIMIZERS:
            ledger.read_param_groups(host.optimizers, lrs_now=True)
    return switched
