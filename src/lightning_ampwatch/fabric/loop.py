"""The loop's optimizer step as the Fabric adapter follows it: what the loop did between two ``watch.step`` calls
(:class:`LoopStep`), and the learning rates it set itself (:class:`LoopLearningRates`).

A Fabric loop calls ``fabric.backward`` once per micro-batch, steps its optimizers (the GradScaler's ``update`` ends
the step, taken or skipped), steps its schedulers, and hands the watch each micro-batch: ``watch.accumulate(batch)``
for all but the last, ``watch.step(batch, loss)`` for the last. :class:`LoopStep` counts those calls, so that the
watch can tell a step from a micro-batch and a loop that does not hand over every micro-batch; with
``hold_lr_on_skip`` it keeps the schedulers' state from before a skipped step, put back in ``watch.step``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Protocol, Sequence

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn

from lightning_ampwatch.core import RunWatcher


class LoopOwner(Protocol):
    """What the adapter's parts read of the watch they serve (:class:`~lightning_ampwatch.fabric.FabricWatch`)."""

    fabric: Fabric
    loss_fn: Callable[[Any, Any], Any]
    log_every_n_steps: int
    hold_lr_on_skip: bool
    watcher: RunWatcher
    steps: int  # optimizer steps taken in (watch.step calls)
    should_stop: bool


def scaler_of(plugin: Any) -> Any:
    """The GradScaler of a Fabric precision plugin, or None (a plugin without one: bf16, 32-true, 16-true)."""
    return getattr(plugin, "scaler", None)


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

    @classmethod
    def of(cls, optimizers: Sequence[torch.optim.Optimizer]) -> "LoopLearningRates | None":
        """The rates of these optimizers, when every param group's is a plain number (a tensor rate, as capturable
        Adam keeps it, is left to the loop's schedulers); else None."""
        if all(isinstance(g.get("lr"), (int, float)) for opt in optimizers for g in opt.param_groups):
            return cls(optimizers)
        return None

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


class LoopStep:
    """The loop's calls since the last ``watch.step``: the ``fabric.backward`` calls, the micro-batches handed over
    (``watch.accumulate``), the GradScaler's updates (the loop's optimizer step ran), whether this step's rates are
    noted; and, with ``hold_lr_on_skip``, the schedulers' state from before a skipped step. The patches on the run
    (:mod:`lightning_ampwatch.fabric.patches`) report to it; :class:`~lightning_ampwatch.fabric.FabricWatch` reads it
    at each ``watch.step``."""

    def __init__(self, owner: LoopOwner, optimizers: Sequence[torch.optim.Optimizer], schedulers: list[Any],
                 loop_lrs: LoopLearningRates | None) -> None:
        self._owner = owner
        self._optimizers = optimizers
        self._schedulers = schedulers
        self.loop_lrs = loop_lrs
        self.backward_seen = False
        self.backward_calls = 0  # fabric.backward calls since the last step
        self.micro_batches = 0  # handed to accumulate() since the last step
        self.scaler_updates = 0  # the loop's scaler updates since the last watch.step
        self.lrs_noted = False  # this step's rates are noted (at its first fabric.backward)
        self.in_step = False  # inside watch.step/accumulate: what runs now (replays, remedies) is the watch's own
        self.in_loop = True  # False once the watch is closing: forwards from then on are replays
        self._batch_index = 0  # micro-batches taken in so far (a replay's batch_idx)
        self._batch_started = False
        self._held: tuple[list[tuple[Any, dict[str, Any]]], list[list[Any]]] | None = None

    def next_batch_index(self) -> int:
        """The micro-batch's index in the run (what a replay passes on as ``batch_idx``)."""
        index = self._batch_index
        self._batch_index += 1
        return index

    def batch_over(self) -> None:
        """After ``watcher.route.batch_end``: the next forward is the next micro-batch's."""
        self._batch_started = False
        self.backward_seen = False
        self.scaler_updates = 0

    def step_over(self) -> None:
        """After ``watch.step`` (and before :meth:`batch_over`): the next ``fabric.backward`` is the next optimizer
        step's first."""
        self.micro_batches = 0
        self.backward_calls = 0
        self.lrs_noted = False

    def note_lrs(self) -> None:
        """At a step's first backward: the rates it runs with. When the loop changed them since the last step, the
        ledger reads them again, so the step is recorded with the rates it ran with (a loop that sets them at the
        top of each iteration, after the previous step was taken in)."""
        self.lrs_noted = True
        loop_lrs = self.loop_lrs
        if loop_lrs is not None and loop_lrs.note(self._owner.steps):
            ledger = self._owner.watcher.ledger
            if ledger is not None:
                ledger.read_param_groups(self._optimizers, lrs_now=True)

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """The module's forward pre-hook (a model that draws random numbers): the first forward of a micro-batch
        starts it, where the route keeps the RNG state a replay needs."""
        if not self._batch_started and self.in_loop:
            self._batch_started = True
            route = self._owner.watcher.route
            if route.wants_batch_start:
                route.batch_start()  # catches its own failures

    # ------------------------------------------------------------------ the loop's optimizer step, and hold_lr_on_skip

    def after_scaler_update(self) -> None:
        """The scaler has just updated: the loop's optimizer step ran (taken or skipped). With ``hold_lr_on_skip``, a
        skipped step's schedulers are held: their state (and the LRs they set) from before the loop steps them is
        kept, to be put back in ``watch.step``. Only skipped steps cost anything; the skip is the step hook's host
        flag, no device read (a fused optimizer excepted: its found-inf flag is read, as under ``AmpWatch``)."""
        if self.in_step:
            return  # a replay's or a remedy's update, not the loop's
        self.scaler_updates += 1
        ledger = self._owner.watcher.ledger
        if not (self._owner.hold_lr_on_skip and self._schedulers) or ledger is None \
                or not ledger.last_step_skipped():
            return
        self._held = ([(s, copy.deepcopy(s.state_dict())) for s in self._schedulers],
                      [[group["lr"] for group in opt.param_groups] for opt in self._optimizers])

    def optimizer_stepped(self) -> bool:
        """Whether the loop ran an optimizer step since the last ``watch.step``: under a scaler its update ran
        (whether it took the step or skipped it); without one the optimizer's step hook saw a step."""
        if scaler_of(self._owner.fabric.strategy.precision) is not None:
            return self.scaler_updates > 0
        ledger = self._owner.watcher.ledger
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
        watcher = self._owner.watcher
        if scaler_of(self._owner.fabric.strategy.precision) is None:
            if not self.lrs_noted:
                self.note_lrs()
            watcher.route.before_backward(loss)
            self.backward_seen = True
        else:
            watcher.say_once("watch.step() got a loss, but fabric.backward() was not called since the last step; "
                             "under a GradScaler the watch reads each step in fabric.backward, so this step is not "
                             "counted. Call fabric.backward(loss).")
