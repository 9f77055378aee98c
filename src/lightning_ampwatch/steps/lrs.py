"""The learning rates each step runs with: read from the optimizers' param groups as each step is taken in (one
dict read while there is one group with a number LR), and logged as change points for the replay."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_ampwatch.machine import LrLog
from lightning_ampwatch.signals import current_lrs


class LrTracking:
    """The LRs the next step runs with, the param groups they are read from, and the log of their changes."""

    def __init__(self) -> None:
        self.lrs: tuple[float, ...] = ()  # the LRs the next step will run with
        self.param_groups: list[dict[str, Any]] = []
        self.float_lrs = True  # every LR a Python number (not a tensor): read them inline
        self.one_group: dict[str, Any] | None = None  # the only param group, when there is one with a number LR
        #: the LRs each step ran with, as change points (a constant LR adds none): what the replay runs each step at
        self.log = LrLog()
        self.points = self.log.entries
        # An LR seen to change when a step is taken in was set before that step ran (a callback's on_train_epoch_start
        # or on_train_batch_start, an epoch-interval scheduler), not after it, when no scheduler steps between the
        # optimizer step and the read: Lightning with no step-interval scheduler. Then that step is dated with it.
        self.set_before = False
        # the param groups' count when they were read: a callback may add a group (BackboneFinetuning); checked at log
        # steps and on an anomalous step, never per step
        self.groups_seen = 0

    def start(self, trainer: Any, step: int) -> None:
        """At train start: the groups and the LRs read, and whether an LR change is dated with the step it is seen at."""
        self.log.clear()
        self.read_param_groups(trainer.optimizers, step, lrs_now=True)
        try:
            self.set_before = bool(getattr(trainer, "automatic", False)) and \
                getattr(trainer, "trainer", None) is not None and not trainer.step_schedulers()
        except Exception:  # noqa: BLE001 - an LR change is then dated as it is read, one step late at worst
            self.set_before = False

    def read_param_groups(self, optimizers: Sequence[torch.optim.Optimizer], step: int, lrs_now: bool = False) -> None:
        """The param groups whose LRs are read every step, and whether they are all plain numbers. ``lrs_now``:
        the LRs changed since the last step was taken in (a remedy, a rollback), so the next step's (``step``) are read
        again."""
        groups = self.param_groups = [g for opt in optimizers for g in opt.param_groups]
        self.groups_seen = len(groups)
        self.float_lrs = all(isinstance(g.get("lr"), (int, float)) for g in groups)
        self.one_group = groups[0] if len(groups) == 1 and self.float_lrs else None
        if self.one_group is not None and len(self.lrs) != 1:
            lrs_now = True  # the next step's LRs are kept as a 1-tuple while there is one group (see StepLedger.close)
        if lrs_now:
            self.lrs = current_lrs(optimizers)
            self.points.append((step, self.lrs))

    def forget_groups(self) -> None:
        """At the fit's end: no reference to the optimizers' param groups (they hold the model's parameters)."""
        self.param_groups, self.one_group = [], None

    def groups_changed(self, optimizers: Sequence[torch.optim.Optimizer]) -> bool:
        """Whether the optimizers' param groups are not the count read last (a group added)."""
        return sum(len(opt.param_groups) for opt in optimizers) != self.groups_seen

    def changed(self, step: int, ran: tuple[Any, ...], now: tuple[Any, ...]) -> tuple[Any, ...]:
        """The LRs read as ``step`` is taken in differ from those it was thought to run with (``ran``): ``now`` is the
        next step's, and a change point for the replay. Returns the LRs ``step`` ran with: ``now`` when they were set
        before it ran (no scheduler steps between the optimizer step and this read), else ``ran``."""
        self.lrs = now
        if self.set_before:
            self.points.append((step, now))
            return now
        self.points.append((step + 1, now))
        return ran

    def ran_with(self, step: int, trainer: Any) -> tuple[Any, ...]:
        """The LRs ``step``, being taken in, ran with (read when the previous step was taken in), and the next
        step's read now: a change is taken in (:meth:`changed`); a constant LR keeps its tuple (no new object per
        step). One group, the usual case, is read inline, without the trainer's ``optimizers`` (a slow property)."""
        lrs = self.lrs
        group = self.one_group
        if group is not None:
            lr = group["lr"]
            return lrs if lrs[0] == lr else self.changed(step, lrs, (lr,))
        now = self.read_now(trainer.optimizers)
        return lrs if now == lrs else self.changed(step, lrs, now)

    def read_now(self, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[Any, ...]:
        """Every group's LR as it is now (more than one group, or a tensor LR, which is never read on a device)."""
        return current_lrs(optimizers) if not self.float_lrs else tuple([g["lr"] for g in self.param_groups])
