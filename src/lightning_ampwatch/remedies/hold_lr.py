"""``hold_lr_on_skip``: a step the scaler skipped does not advance a step-interval LR scheduler either."""

from __future__ import annotations

from typing import Any, Callable, Sequence


class HoldLrOnSkip:
    """Stands in for ``LightningModule.lr_scheduler_step``: a step-interval scheduler does not advance when the
    scaler skipped the optimizer step it follows (as accelerate and DeepSpeed do).

    ``skipped`` answers whether the last optimizer step was skipped; it is the callback's host-side flag, so
    holding costs no device read (fused optimizers excepted: their flag is read here, once per step).
    A callable object, not a closure, so that the module still pickles while it is installed.
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

    @staticmethod
    def uninstall(module: Any) -> None:
        if isinstance(module.__dict__.get("lr_scheduler_step"), HoldLrOnSkip):
            del module.__dict__["lr_scheduler_step"]
