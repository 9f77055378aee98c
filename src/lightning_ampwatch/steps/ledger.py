"""The step ledger: every optimizer step taken in, in order, at no added host-device read on a healthy step.

The core tells the ledger what happened (a loss went to backward, a batch ended, an optimizer stepped); the ledger
decides what a step costs to watch, and returns a :class:`ClosedStep` for every step it takes in. A healthy step
under a GradScaler takes the fast path: a clean record made of host-side values (the scale mirror's, the LRs).
Any other step is opened, resolved once its deferred reads have landed, and handed back as a
:class:`ResolvedStep`. The core hands each record it gets to the machine, the timeline and the trajectory
control. A clean step the core's plan lets it hold back is not returned: the ledger hands such steps over in runs,
to the consumers registered at train start (:class:`CleanRuns`), before any step, read or log step that must see
them taken in (:meth:`StepLedger.settle` for a reader from outside a step).

Step losses are kept as device tensors and read together, in one read, at a log step, on an anomaly, or when the
ring is full (:class:`LossRing`, :class:`LossReads`): the loss level stays current without a read per step. On the
CPU (``losses.HOST_TAPE_DEVICES``), where reading a tensor is no synchronisation, each loss is taken as a float when
it comes, and the log step has no tensor op for the losses. The scaler's host mirror is :class:`ScaleTracking`'s,
the LRs :class:`LrTracking`'s.

``close`` keeps a healthy step's bookkeeping inline, and the lean route's express lane (:class:`ExpressLane`)
repeats it, because every call on an ordinary step counts against its budget of 25 (``benchmarks/step_counts.py``).
The steps that are not clean are queued and resolved by :class:`OpenSteps`; which optimizers step, by
:class:`Optimizers`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_ampwatch import compat
from lightning_ampwatch.probes import MicroBatch
from lightning_ampwatch.signals import LossTape, PrecisionInfo, ScaleMirror, StepTaken
from lightning_ampwatch.steps import losses as _losses
from lightning_ampwatch.steps.clean_runs import NO_BATCHES, CleanRuns
from lightning_ampwatch.steps.lane import ExpressLane
from lightning_ampwatch.steps.losses import LOSS_RING_MAX_STEPS, LOSS_RING_STEPS, LossRing
from lightning_ampwatch.steps.lrs import LrTracking
from lightning_ampwatch.steps.open_steps import OpenSteps
from lightning_ampwatch.steps.optimizers import Optimizers
from lightning_ampwatch.steps.reads import LossReads
from lightning_ampwatch.steps.records import ClosedStep, ResolvedStep
from lightning_ampwatch.steps.scale import ScaleTracking

#: A run whose optimizer steps never come (a ``training_step`` that always returns None) keeps at most this many
#: batches, trimmed to ``BATCHES_KEPT_AFTER_TRIM``: enough for any accumulation a real run uses.
BATCHES_KEPT_MAX = 64
BATCHES_KEPT_AFTER_TRIM = 32
_NONE_RESOLVED: list[ResolvedStep] = []  # a clean step resolves nothing (shared, never appended to)


class StepLedger:
    """Takes each optimizer step in and returns a record of it: clean, or an observation once resolved."""

    def __init__(self, precision: PrecisionInfo, device_type: str = "cpu", world_size: int = 1) -> None:
        self.precision = precision
        self.device_type = device_type
        self.world_size = world_size
        #: several ranks meet anomalies together under a scaler (and gather a view of each skip) until a rank's watch
        #: switches itself off (distributed.CrossRank)
        self.agree = True
        self.scale, self.taken = ScaleTracking(), StepTaken()  # the scaler's mirror; what tells a step the scaler ran
        self.stepped = False  # an optimizer step ran in this batch and is not taken in yet
        self._mark = 0  # the tape's length when that step began: later losses belong to the batch's next step
        self.losses_apart = False  # a batch stepped several optimizers, each on losses of its own (a GAN's two)
        self.step_index = 0  # trainer.global_step at the step being opened, kept locally (the property is slow)
        self.losses = LossRing()
        self.reads = LossReads()
        self.recent_losses = self.reads.recent_losses  # (step, loss) as read: a remedy's outcome is judged on them
        self.unnoted = self.reads.unnoted  # losses read and not yet handed to the machine (take_unnoted)
        self.log_steps = self.log_skipped = self.log_nonfinite = 0  # since the last log step
        self._tape = LossTape()
        self._batches: list[MicroBatch] = []
        #: the steps closed but not resolved yet (the slow path: :class:`OpenSteps`)
        self.open_steps = OpenSteps(self)
        #: the LRs each step runs with (and the log of their changes, :attr:`lr_log`, which the replay reads)
        self.lr = LrTracking()
        self.lr_log = self.lr.log
        #: the optimizers the step hook sits on, and which one steps where there are several (:class:`Optimizers`)
        self.optimizers = Optimizers()
        self.host: Any = None  # the trainer, for the optimizers' re-check on an anomalous step (resolved without it)
        self.fast_path = False
        self._host_loss = False
        self._host_tape = device_type in _losses.HOST_TAPE_DEVICES  # losses taken as floats (see backward)
        self._clean = ClosedStep(-1, [], True, None, False, (), None, _NONE_RESOLVED)  # refilled each clean step
        #: clean fast-path steps held back and handed over in runs (:class:`CleanRuns`): ``close`` returns None for a
        #: step it holds
        self.runs = CleanRuns()
        #: the lean route's express lane: a healthy batch end taken in one call (:class:`ExpressLane`)
        self.lane = ExpressLane(self)

    # ------------------------------------------------------------------ set-up

    def start(self, trainer: Any, log_every: int) -> None:
        """At train start: the optimizers' hooks, the LRs, and one read of the scaler (restored by now)."""
        self.step_index = trainer.global_step
        self.lane.until = 0
        self.host = trainer
        self.taken.attach(trainer.optimizers)
        self.optimizers.clear()
        self.optimizers.attach(trainer.optimizers, getattr(trainer, "module", None))
        self.lr.start(trainer, self.step_index)
        self.losses.capacity = min(max(LOSS_RING_STEPS, log_every), LOSS_RING_MAX_STEPS)
        self.mirror_scaler()

    def stop(self) -> None:
        """Leave the optimizers as they were found, and drop every reference to batches and losses (the clean steps
        held back handed over first: the timeline and the machine as they would be)."""
        try:
            self.runs.settle()
        finally:
            self.runs.drop()
            self.taken.detach()
            self.host = None
            self.optimizers.clear()
            self.lr.forget_groups()
            self.stepped = False
            self.open_steps.queue.clear()
            self._batches = []
            self._clean.batches = []
            self.lane.until = 0
            self._tape = LossTape()
            self.losses.entries = []

    @property
    def host_tape(self) -> bool:
        """Whether the losses are taken as floats as they come (``losses.HOST_TAPE_DEVICES``): reading the ring of
        held losses is then no synchronisation, wherever it happens."""
        return self._host_tape

    @property
    def scaler_active(self) -> bool:
        """A loss scaler skips the steps it finds an overflow in: a GradScaler, or DeepSpeed's own."""
        return self.precision.scaler is not None or self.precision.loss_scale is not None

    @property
    def mirror(self) -> ScaleMirror | None:
        """The scaler's host mirror (None without a scaler)."""
        return self.scale.mirror

    @property
    def scaler_config(self) -> dict[str, Any]:
        """The scaler's growth settings, as last mirrored (for the machine)."""
        return self.scale.config

    def mirror_scaler(self) -> None:
        """Read the scaler once into the host mirror (:meth:`ScaleTracking.read`)."""
        self.scale.read(self.precision)
        self._update_fast_path()

    def switch_precision(self, precision: PrecisionInfo) -> None:
        """The precision plugin changed under the run (bf16 fallback): a new scaler, or none."""
        self.precision = precision
        self.mirror_scaler()

    @property
    def optimizer_names(self) -> tuple[str, ...]:
        """Each optimizer in a few words, where the run has several (for the machine)."""
        return self.optimizers.names

    def optimizer_index(self, optimizer: Any) -> int | None:
        """The index of ``optimizer``, about to step, where the run has several (:meth:`Optimizers.index`). The first
        time a second one steps, each step from then on is resolved with its optimizer's index (the step before it
        too: the route asks before it takes that step in)."""
        several = self.optimizers.several
        index = self.optimizers.index(optimizer)
        if self.optimizers.several != several:
            self._update_fast_path()
        return index

    def take_unnoted(self) -> list[tuple[int, float]]:
        """The losses read since the last call, in step order, for the machine's loss level."""
        return self.reads.take_unnoted()

    def settle(self) -> None:
        """Every clean step held back handed over to its consumers now (:class:`CleanRuns`): for a reader from outside
        a step (an adapter's ``machine``, a checkpoint, the fit's end)."""
        self.runs.settle()

    def hold(self) -> None:
        """Something outside the steps happened (a diagnosis emitted, possibly from inside a step): the clean steps
        held back are handed over, and none is held back (nor taken by the express lane) until the core's next
        plan (``runs.until``), so that whatever follows sees every step taken in."""
        self.runs.settle()
        self.runs.until = self.step_index
        self.lane.until = 0

    @property
    def express_until(self) -> int:
        """The express lane takes the steps below this one (0: closed; :meth:`ExpressLane.open`)."""
        return self.lane.until

    @property
    def waiting(self) -> bool:
        """An earlier micro-batch's loss or batch waits for its step, or a step is in flight."""
        return bool(self._tape or self._batches or self.open_steps)

    @property
    def in_flight(self) -> bool:
        """Steps closed but not resolved yet (a skip or a loss still to be read)."""
        return bool(self.open_steps)

    def read_param_groups(self, optimizers: Sequence[torch.optim.Optimizer], lrs_now: bool = False) -> None:
        """The param groups whose LRs are read every step (:meth:`LrTracking.read_param_groups`); ``lrs_now``: the
        LRs changed since the last step was taken in (a remedy, a rollback)."""
        self.lr.read_param_groups(optimizers, self.step_index, lrs_now)

    def _update_fast_path(self) -> None:
        """Whether a clean step can take the fast path: a scaler whose skips the step hook reports (not fused)
        and a host mirror of its scale; or no scaler and a model on the CPU, whose loss is read for free."""
        self._host_loss = not self.scaler_active and self.device_type == "cpu"
        self.fast_path = self.scaler_active and self.scale.mirror is not None and not self.taken.fused \
            and not self.optimizers.several

    # ------------------------------------------------------------------ what the hooks report

    def backward(self, loss: Tensor) -> None:
        """The loss is kept unread, without its graph. ``.data`` rather than ``.detach()``: the same values and no
        graph, without an aten op through the dispatcher on every step (half the time on the CPU); the tape only
        reads it. On the CPU (``HOST_TAPE_DEVICES``) its value is taken at once instead: ``item()`` is no
        synchronisation there, costs less than ``.data``, and leaves the log step no tensor op for the losses.
        (Under a GradScaler this is the scaled loss; the tape keeps the scale beside it.)"""
        self.add_loss(loss if self._host_tape else loss.data, self.scale.tape_mirror.scale)

    def add_loss(self, loss: Tensor, scale: float = 1.0) -> None:
        """A loss joins the tape beside the scale it carries: kept unread (a tensor without its graph), or on the
        CPU taken as a float. The lean route hands the batch's loss as the framework returned it, already unscaled
        and detached (Lightning's own copy)."""
        value: Any = loss
        if self._host_tape:
            try:
                value = loss.item()
            except RuntimeError:  # not one value (a manual backward of a vector): tensors from now on, as before
                self._host_tape = False
                value = loss.data  # never the graph
        self._tape.append((value, scale))

    def keep_batch(self, micro_batch: MicroBatch | tuple[Any, ...]) -> None:
        """The batch joins its step's batches (kept by reference, read only if the step turns out faulty)."""
        batches = self._batches
        if len(batches) >= BATCHES_KEPT_MAX:
            del batches[:-BATCHES_KEPT_AFTER_TRIM]
        batches.append(micro_batch)  # type: ignore[arg-type]

    def last_step_skipped(self) -> bool:
        """Whether the optimizer step that just ran was skipped by the scaler (for ``hold_lr_on_skip``)."""
        return self.scale.last_step_skipped(self.precision, self.taken)

    # ------------------------------------------------------------------ the per-step path

    def express(self, loss: Tensor, micro_batch: MicroBatch | tuple[Any, ...]) -> bool:
        """The lean route's express lane (:meth:`ExpressLane.take`): True when it took this batch's step."""
        return self.lane.take(loss, micro_batch)

    def optimizer_step_begins(self) -> None:
        """An optimizer is about to step: losses handed to backward from now on belong to the next step."""
        engine = self.scale.engine
        if engine is not None and not compat.deepspeed_at_boundary(engine):
            return  # DeepSpeed mid-accumulation: its engine will take no step; the losses stay for the one that does
        self.stepped = True
        self._mark = len(self._tape)

    def close(self, trainer: Any, quiet: bool, micro_batch: MicroBatch | tuple[Any, ...] | None = None,
              split: bool = False) -> ClosedStep | None:
        """This batch's optimizer step is over (the scaler has updated, the scheduler has stepped): take it in.
        ``quiet``: the machine has nothing in progress (a clean step may take the fast path). ``micro_batch``: this
        batch, if not kept yet (:meth:`keep_batch` in the same call). None when backward never ran (no step was
        taken). ``split``: another optimizer steps next in the same batch (manual optimization, a GAN's generator
        then discriminator): this step takes the losses handed to backward before it began; the later ones stay
        for the next step (which shares them when there are none: several optimizers stepped from one backward).
        Each optimizer step is a step, as Lightning's ``global_step`` counts them. Also None for a clean fast-path
        step below ``runs.until``: it is held back (:class:`CleanRuns`) and handed over with its run. Any other step
        hands the run held back over first (:meth:`settle`), so that every consumer takes the steps in order."""
        self.stepped = False
        tape, batches = self._tape, self._batches
        if micro_batch is not None:
            batches.append(micro_batch)  # type: ignore[arg-type]
        if split:
            mark = self._mark
            if 0 < mark < len(tape):  # each optimizer stepped on losses of its own: not one series
                self._tape, self.losses_apart = LossTape(tape[mark:]), True
                del tape[mark:]
            else:
                self._tape = LossTape(tape)
            # the batch is handed over at its end, to the step that closes it: this one shares its list, so that it
            # too is judged with the batch it ran on (a NaN in the data is the data's, not the first optimizer's)
        else:
            self._tape = LossTape()
            self._batches = []
        step = self.step_index
        self.step_index = step + 1
        tracking = self.lr
        lrs = tracking.ran_with(step, trainer)  # the LRs this step ran with (and the next step's read)
        taken_hook = self.taken
        taken, found_inf = taken_hook.taken, taken_hook.found_inf
        taken_hook.taken, taken_hook.found_inf = False, None
        tracking_scale = self.scale
        scaler = tracking_scale.table_scaler
        unscaled = False  # no scaler step ran: nothing skipped, nothing for the mirror to follow
        if scaler is not None:
            states = compat.read_per_optimizer_states(scaler)
            if not taken and found_inf is None:
                if states is tracking_scale.states_seen:
                    # Lightning runs no scaler step when the step's last micro-batch returned None from training_step
                    # (earlier micro-batches' losses are on the tape); the scaler neither skipped nor updated
                    unscaled = taken = True
                elif self.recheck_optimizers(trainer):
                    # no hook fired because the optimizer that stepped is not the one it sat on (a callback swapped
                    # it): the scaler tells whether it skipped the step, by the scale it backed off
                    taken = tracking_scale.held(scaler)
                    if tracking.set_before:  # and this step ran at the new optimizers' LRs, read just now
                        lrs = tracking.lrs
                        tracking.points.append((step, lrs))
            tracking_scale.states_seen = states
        if not tape:
            return None  # backward never ran (training_step returned None): the framework did not step
        mirror = tracking_scale.mirror
        scale = mirror.scale if mirror is not None else None
        loss_scale = tracking_scale.loss_scale
        if loss_scale is not None:
            # DeepSpeed: its engine counted the step as skipped or not, and set its scale, on the host already
            skipped_total = loss_scale.skipped_steps()
            taken = skipped_total == tracking_scale.skipped_seen
            tracking_scale.skipped_seen = skipped_total
            scale_after = loss_scale.scale()
            if not (taken and quiet and not self.open_steps):
                if self.runs.deferred:
                    self.runs.settle()
                return self.open_steps.open(step, scale, lrs, tape, batches, taken, scale_after=scale_after)
            grew = scale_after > mirror.scale  # type: ignore[union-attr]
            mirror.reconcile(scale_after, 0 if grew else mirror.tracker + 1)  # type: ignore[union-attr]
            clean_step = True  # then the fast path's bookkeeping below, as for a GradScaler
        elif self.fast_path and taken and quiet and not self.open_steps:
            # The fast path, nearly every step of a healthy run: the scaler took the step and nothing is in
            # progress. Host-side bookkeeping only; no Observation, no device read, no object but the ring's entry.
            tracker = mirror.tracker + 1  # type: ignore[union-attr]  # ScaleMirror.update(False), inline ...
            if unscaled:
                grew = False
            elif tracker < mirror.growth_interval:  # type: ignore[union-attr]
                mirror.tracker = tracker  # type: ignore[union-attr]
                grew = False
            else:  # ... but for a growth
                grew = mirror.update(False)  # type: ignore[union-attr]
            clean_step = True
        else:
            clean_step = False
        if clean_step:
            self.log_steps += 1
            losses = self.losses
            entries = losses.entries
            entries.append((step, tape))
            if len(entries) < losses.capacity:
                runs = self.runs
                if step < runs.until:  # handed over later, with the run of clean steps it ends
                    runs.deferred.append((step, batches if runs.keep_batches else NO_BATCHES, scale, grew, lrs))
                    return None
                if runs.deferred:
                    runs.settle()
            else:  # (the read hands the run held back over first)
                self.read_losses()
                self.lr_log.trim()
            clean = self._clean
            clean.step, clean.batches, clean.scale, clean.grew, clean.lrs, clean.loss = step, batches, scale, grew, \
                lrs, None
            return clean
        if self.runs.deferred:
            self.runs.settle()
        if self._host_loss and not self.open_steps and quiet:
            # No scaler, and the loss lives on the host (CPU): reading it is no synchronisation, so a finite loss
            # takes the fast path too. On an accelerator the loss goes the deferred way below.
            loss = tape.read()
            if math.isfinite(loss):
                self.log_steps += 1
                self.reads.recent((step, loss))
                clean = self._clean
                clean.step, clean.batches, clean.scale, clean.grew, clean.lrs, clean.loss = step, batches, None, \
                    False, lrs, loss
                return clean
        return self.open_steps.open(step, scale, lrs, tape, batches, taken, unscaled, found_inf, split)

    def drain(self, force: bool) -> list[ResolvedStep]:
        """Resolve the opened steps in order; with ``force`` wait for copies still in flight (log steps, fit end)."""
        return self.open_steps.drain(force)

    # ------------------------------------------------------------------ reads

    @property
    def last_loss(self) -> float | None:
        """The loss of the latest step read so far (the timeline samples it at log steps)."""
        return self.reads.last_loss

    def read_losses(self, extra: Sequence[Tensor] = ()) -> list[float]:
        """Read every held step loss, and ``extra`` tensors, in ONE device-to-host copy (:meth:`LossReads.read`);
        returns ``extra``'s values, flattened. The clean steps held back are handed over first: the losses read are
        noted after them."""
        if self.runs.deferred:
            self.runs.settle()
        return self.reads.read(self.losses, self._host_tape, extra)

    def drain_at_log_step(self, trainer: Any) -> list[ResolvedStep]:
        """Once per ``log_every_n_steps``: re-synchronise with the trainer and resolve everything in flight (the clean
        steps held back handed over first)."""
        self.runs.settle()
        self.step_index = trainer.global_step  # cheap here, once per log interval
        if not self.recheck_optimizers(trainer):
            self.read_param_groups(trainer.optimizers)  # the groups as they are (a group's dict replaced?)
        self.lr_log.trim()
        return self.drain(force=True)

    def recheck_optimizers(self, trainer: Any) -> bool:
        """At a log step or an anomalous step: whether the trainer's optimizers or their param groups changed since
        they were read (a callback swapped in a new optimizer, or added a group: BackboneFinetuning). Then the step
        hook moves to the new optimizers and every group's LR is read again, from the next step taken in on.
        A swap is said once, in one line."""
        optimizers = trainer.optimizers
        swapped = self.optimizers.swapped(optimizers)
        if not swapped and not self.lr.groups_changed(optimizers):
            return False
        if swapped:
            self.taken.attach(optimizers)
            self.optimizers.attach(optimizers, getattr(trainer, "module", None))
            self._update_fast_path()
            self.lr_log.swapped_at = max(self.step_index - 1, 0)
            say = getattr(trainer, "say", None)
            if say is not None:
                names = ", ".join(type(opt).__name__ for opt in optimizers) or "none"
                say(f"AmpWatch: the optimizers changed (seen at step {self.lr_log.swapped_at}; now {names}): their "
                    "steps and learning rates are read from them from here on.")
        self.read_param_groups(optimizers, lrs_now=True)
        return True

    def read_at_log_step(self, extra: Sequence[Tensor] = ()) -> tuple[float | None, list[float]]:
        """The log step's one packed read: the scaler's scale and growth tracker (the mirror is reconciled with
        them), ``extra`` scalars and the held losses. Returns the real scale (the mirror's without a scaler
        tensor yet) and ``extra``'s values."""
        self.runs.settle()  # (the losses read are noted after the clean steps held back)
        scaler, mirror = self.precision.scaler, self.scale.mirror
        read = None if scaler is None else self.reads.read_with_scaler(self.losses, self._host_tape, scaler, extra)
        if read is None:
            return (mirror.scale if mirror is not None else None), self.read_losses(extra)
        scale, tracker, values = read
        if mirror is not None:
            mirror.reconcile(scale, int(tracker))
        return scale, values

    def take_log_counts(self) -> tuple[int, int, int]:
        """(steps, skipped, non-finite losses) since the last call: one log interval's counts."""
        counts = (self.log_steps, self.log_skipped, self.log_nonfinite)
        self.log_steps = self.log_skipped = self.log_nonfinite = 0
        return counts

