"""Stand-ins for ``LightningModule.lr_scheduler_step``, the hook Lightning calls to step every scheduler.

``hold_lr_on_skip``: a step the scaler skipped does not advance a step-interval LR scheduler either.
``reduce_lr`` after an LR rise: every param group's learning rate is held at or under a ceiling, whatever the
scheduler computes next.

Each is a callable object wrapping the hook it found (so that the module still pickles while it is installed);
they stack, and each comes out of the stack on its own, whichever was installed first.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from lightning_ampwatch import compat


class _SchedulerStepWrapper:
    """One link of the chain on ``module.lr_scheduler_step``: ``original`` is what it stands in for."""

    original: Callable[[Any, Any], None]

    @classmethod
    def installed(cls, module: Any) -> Any:
        """This kind's wrapper on ``module``, wherever it sits in the chain, or None."""
        fn = module.__dict__.get("lr_scheduler_step")
        while isinstance(fn, _SchedulerStepWrapper):
            if isinstance(fn, cls):
                return fn
            fn = fn.original
        return None

    @classmethod
    def uninstall(cls, module: Any) -> None:
        """Take this kind's wrappers out of the chain, leaving the others as they are; with none left, the class's
        own hook is what Lightning calls again."""
        fn = module.__dict__.get("lr_scheduler_step")
        if not isinstance(fn, _SchedulerStepWrapper):
            return
        chain: list[_SchedulerStepWrapper] = []
        while isinstance(fn, _SchedulerStepWrapper):
            chain.append(fn)
            fn = fn.original
        inner: Any = fn
        for link in reversed([w for w in chain if not isinstance(w, cls)]):
            link.original = inner
            inner = link
        bound_own_hook = getattr(inner, "__self__", None) is module and \
            getattr(inner, "__func__", None) is getattr(type(module), "lr_scheduler_step", None)
        if bound_own_hook:
            del module.__dict__["lr_scheduler_step"]
        else:
            module.__dict__["lr_scheduler_step"] = inner


class HoldLrOnSkip(_SchedulerStepWrapper):
    """Stands in for ``LightningModule.lr_scheduler_step``: a step-interval scheduler does not advance when the
    scaler skipped the optimizer step it follows (as accelerate and DeepSpeed do).

    ``skipped`` answers whether the last optimizer step was skipped; it is the callback's host-side flag, so
    holding costs no device read (fused optimizers excepted: their flag is read here, once per step).
    """

    def __init__(self, original: Callable[[Any, Any], None], skipped: Callable[[], bool],
                 step_schedulers: Callable[[], Sequence[Any]]) -> None:
        self.original = original
        self.skipped = skipped
        self.step_schedulers = step_schedulers

    def __call__(self, scheduler: Any, metric: Any = None) -> None:
        if any(s is scheduler for s in self.step_schedulers()) and self.skipped():
            return
        self.original(scheduler, metric)

    @staticmethod
    def install(module: Any, skipped: Callable[[], bool], step_schedulers: Callable[[], Sequence[Any]]) -> None:
        module.lr_scheduler_step = HoldLrOnSkip(module.lr_scheduler_step, skipped, step_schedulers)


def param_groups(optimizers: Sequence[Any]) -> list[dict[str, Any]]:
    """Every param group of every optimizer, in order: the order ``reduce_lr``'s details list learning rates in."""
    return [g for opt in optimizers for g in opt.param_groups]


def clamp_lrs(groups: Sequence[dict[str, Any]], caps: Sequence[float]) -> None:
    """Each group's learning rate held at or under its cap (a tensor LR is clamped in place: no device read)."""
    for group, cap in zip(groups, caps):
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            lr.clamp_(max=cap)
        elif isinstance(lr, (int, float)) and lr > cap:
            group["lr"] = cap


class LrCeiling(_SchedulerStepWrapper):
    """Stands in for ``LightningModule.lr_scheduler_step``: after every scheduler step, each param group's learning
    rate is held at or under its cap (``caps``, one per param group of the trainer's optimizers, in order),
    whatever the scheduler computed. The schedule itself is left as it is: under the caps it runs as written.

    The optimizers are read from the module's trainer at every call: a rollback or a resume loads new states into
    the same objects, and the ceiling follows them. It holds the module, not the trainer, so that a copy of the
    module (an EMA callback's) does not copy the trainer. One loop over the param groups (not the parameters), on
    the host.
    """

    def __init__(self, original: Callable[[Any, Any], None], caps: Sequence[float], module: Any) -> None:
        self.original = original
        self.caps = [float(c) for c in caps]
        self.module = module

    def __call__(self, scheduler: Any, metric: Any = None) -> None:
        self.original(scheduler, metric)
        self.clamp()
        compat.held_last_lr(scheduler)  # get_last_lr() (what LR monitors log) says the rate held, not the computed

    def optimizers(self) -> Sequence[Any]:
        try:
            trainer = self.module.trainer
        except RuntimeError:  # not attached to a trainer (a copy of the module): nothing to hold
            return []
        return list(getattr(trainer, "optimizers", None) or [])

    def clamp(self) -> None:
        clamp_lrs(param_groups(self.optimizers()), self.caps)

    @staticmethod
    def install(module: Any, caps: Sequence[float]) -> "LrCeiling":
        """Hold the learning rates at or under ``caps`` from now on (they are clamped at once too). A ceiling
        already installed is lowered where the new caps are lower, never raised: one wrapper, the lower caps."""
        held = LrCeiling.installed(module)
        if held is not None and len(held.caps) == len(caps):
            held.caps = [min(a, float(b)) for a, b in zip(held.caps, caps)]
        else:
            if held is not None:
                LrCeiling.uninstall(module)
            held = LrCeiling(module.lr_scheduler_step, caps, module)
            module.lr_scheduler_step = held
        held.clamp()
        return held
