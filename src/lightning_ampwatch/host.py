"""The :class:`Host` protocol: what only the training framework knows, as one object an adapter implements for
:class:`~lightning_ampwatch.core.RunWatcher` (see the contract in :mod:`lightning_ampwatch.core`). No Lightning import.

Attribute names follow the Lightning ``Trainer`` where the rooms already read them (``global_step``,
``optimizers``, ``loggers``, ``is_global_zero``), so a host is passed to the rooms where a trainer was.
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol, Sequence, runtime_checkable

import torch

from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.remedies import RemedyContext
from lightning_ampwatch.signals import PrecisionInfo
from lightning_ampwatch.trajectory.state import TrainState


@runtime_checkable
class Host(Protocol):
    """What only the training framework knows, as one object the adapter implements.

    Read at ``start`` (and again where noted): nothing here is called on a healthy step except ``global_step``
    and ``optimizers`` at log steps and when a step is opened.
    """

    module: torch.nn.Module
    """The model being trained (Lightning: the LightningModule; Fabric: the user's module, unwrapped)."""
    device: torch.device
    automatic: bool
    """One loss -> backward -> optimizer step per batch, driven by the framework, so a step can be replayed from
    its batches alone through :meth:`step_loss`. False for Lightning's manual optimization."""
    is_global_zero: bool
    world_size: int

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """The raw torch optimizers (not framework wrappers)."""

    @property
    def loggers(self) -> Sequence[Any]:
        """The framework's loggers; diagnoses go to those that take text (TensorBoard, MLflow, W&B)."""

    @property
    def log_every(self) -> int:
        """Optimizer steps between log steps (metrics, one packed read, timeline flush); 0: never."""

    @property
    def log_dir(self) -> str:
        """Where ``ampwatch/`` goes unless ``log_dir=`` was given."""

    def precision(self) -> PrecisionInfo:
        """The run's arithmetic and scaler, now (a bf16 fallback changes it mid-run)."""

    def forward_context(self) -> ContextManager[Any]:
        """The autocast context the run's forward uses now (a replay at the run's own precision enters it)."""

    def step_loss(self, batch: Any, batch_idx: int) -> Any:
        """One micro-batch's loss, computed as the training step does (Lightning: ``training_step``; Fabric: the
        user's ``loss_fn(module, batch)``); a dict with ``"loss"`` or None is allowed. Replays call it with autocast
        on or off around it, and with the weights of the faulty step; it must not step an optimizer."""

    def train_state(self) -> TrainState:
        """What the FP32 trajectory control drives step by step (optimizers, scaler, step schedulers, clipping,
        accumulation); ``TrainState.unavailable`` says why it cannot run, if it cannot."""

    def step_schedulers(self) -> list[Any]:
        """The LR schedulers stepped every optimizer step (an adapter's ``hold_lr_on_skip`` holds them on a skipped
        step, asking :meth:`RunWatcher.last_step_skipped`)."""

    def remedy_context(self, scaler: Any, safe_scale: float | None, guards: RecipeGuards) -> RemedyContext:
        """What a remedy acts on (the module, the scaler, the device, the guards, as given). ``trainer`` is the
        object whose ``optimizers`` and ``lr_scheduler_configs`` (``.scheduler``) ``reduce_lr`` changes and whose
        ``strategy.precision_plugin.precision`` names the run's precision; ``switch_precision`` swaps the precision
        for the bf16 fallback (None: ``trainer`` is a Lightning Trainer, whose plugin is replaced)."""

    def rollback_to_checkpoint(self, before: int) -> tuple[str | None, int | None]:
        """Load the newest checkpoint file this fit wrote (or resumed from) before step ``before`` ran that holds the
        whole training state (weights, scaler, optimizers, schedulers; not the loop): (its path, its step), or
        (None, None) when there is none. A file is checked before the live state is touched; a restore that still
        fails raises (the caller publishes the alarm with the failure)."""

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """The ``ampwatch/*`` metrics of the current log step, to the framework's loggers."""

    def stop(self) -> None:
        """End the run cleanly after this step (``on_unrecoverable="stop"``)."""

    def say(self, message: str) -> None:
        """One plain line for the user (the framework's rank-zero info log)."""

    # Optional members (read with ``getattr``; a host without them is still a Host):
    #
    # ``wrapped_module() -> nn.Module``: the module as the strategy wraps it (DDP, a root FSDP1 wrapper, an
    #     FSDP2 module): a replay asks it whether its forward talks to every rank and in which dtype FSDP computes.
    # ``processes_per_node: int``: the processes training on this host, which share the default snapshot budget.
    # ``rollback_unavailable() -> str | None``: why no checkpoint can be rolled back to in this run, if none can.
    # ``rollback_passed_over() -> str | None``: the checkpoint files the latest ``rollback_to_checkpoint`` passed
    #     over, counted by why (``1 file that holds only the weights, ...``), or None.
    # ``replays_refused() -> str | None``: why no faulty step may be replayed now (the loop does not hand over every
    #     micro-batch), else None: the faulty batch's replay and its FP32 control are then not run, and say why.
    # ``user_failure(err) -> str | None``: when ``err`` (a failure inside the watch) is the user's own code failing
    #     under it (a ``loss_fn`` that raises in a replay), the warning to give instead of an internal error.


def user_code_failure(failed: BaseException | None, err: BaseException, code: str) -> str | None:
    """The warning for the core's failure ``err`` when it is the user's ``code`` (``failed``: what that code last
    raised while a replay called it) failing under the watch: ``err`` itself, or a replay's error that carries its
    words (a failure gathered across ranks). None when ``err`` is something else: an internal error."""
    if failed is None or not (err is failed or f"{type(failed).__name__}: {failed}" in str(err)):
        return None
    return (f"AmpWatch replayed a faulty step through {code}, which raised {type(failed).__name__}: {failed}. The "
            "watch goes on without the replays that failed (the diagnoses rest on the steps' own measurements); a "
            "replay calls it again on a batch it has already seen, with the weights of the faulty step.")
