"""What drives an optimizer step outside Lightning's loop: :class:`TrainState`, everything a snapshot copies and a
replay steps (the module, the optimizers, the scaler, the step schedulers, the precision's own state)."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lightning_ampwatch import deepspeed_state, sharding

PRECISIONS = ("fp32", "amp", "bf16")


# --------------------------------------------------------------------------------------------
# What drives an optimizer step outside Lightning's loop
# --------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """The pieces of a fit that a replay drives step by step, exactly as Lightning's automatic optimization does."""

    module: Any  # the LightningModule: its training_step(batch, batch_idx) and lr_scheduler_step
    optimizers: list[torch.optim.Optimizer]
    scaler: Any = None  # the run's GradScaler, or None (bf16, fp32)
    schedulers: list[tuple[Any, int]] = field(default_factory=list)  # step-interval (scheduler, frequency)
    clip_val: float | None = None
    clip_algorithm: str = "norm"
    accumulate: int = 1  # Lightning divides each micro-batch's loss by accumulate_grad_batches
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forward_context: Callable[[], Any] = contextlib.nullcontext  # the precision plugin's: the amp replay's autocast
    unavailable: str | None = None  # why the trajectory control cannot run in this fit; None when it can
    #: why the FP32 replay cannot run though snapshots can (FSDP gathers half-precision parameters for compute): the
    #: snapshots still serve rollback; None when it can
    fp32_unavailable: str | None = None
    step_loss: Callable[[Any, int], Any] | None = None  # one micro-batch's loss; None: module.training_step

    root: Any = None  # the module as the strategy wraps it (DDP, FSDP1, FSDP2): state is read from it; else module
    #: DDP with a scaler: every rank holds the same state, so each keeps 1/N of a snapshot and the ranks put it
    #: back together on restore (a collective; restores then happen on every rank at once: the ranks meet
    #: anomalies together under a scaler). Off without a scaler, where a rank may replay alone.
    split: bool = False
    #: Why the steps cannot be replayed (re-run) in this fit although snapshots can be taken and put back (a rollback
    #: needs only those); None when they can.
    replay_unavailable: str | None = None
    #: the LRs each step of the run ran with, as the step ledger read them (``lr_history.LrLog``): a replayed step
    #: runs at them where the restored schedulers give others (an LR a callback set); None: the schedulers' alone
    lr_log: Any = None

    def __post_init__(self) -> None:
        if self.root is None:
            self.root = self.module

    @classmethod
    def from_trainer(cls, trainer: Any, pl_module: Any) -> "TrainState":
        """Read from a fitting Trainer (call it once optimizers exist: ``on_train_start`` or later)."""
        plugin = trainer.precision_plugin
        root = getattr(trainer.strategy, "model", None)
        root = root if isinstance(root, torch.nn.Module) else pl_module
        unavailable = replay_unavailable = fp32_unavailable = None
        if not pl_module.automatic_optimization:
            unavailable = ("the trajectory control is not available under manual optimization: training_step "
                           "steps the optimizers itself, so its steps cannot be re-run one by one")
        elif deepspeed_state.is_engine(root):  # its module is half precision by design (float32 masters elsewhere)
            unavailable = sharding.unsupported_reason(root, list(trainer.optimizers))
            # snapshots (and rollbacks) where they are available; the replays never
            replay_unavailable = deepspeed_state.REPLAY_UNAVAILABLE if unavailable is None else None
        elif any(p.dtype in sharding.HALF for p in pl_module.parameters() if p.requires_grad):
            # frozen half-precision weights (a bf16 base under a LoRA or a head) are fine: they are not trained,
            # and the FP32 replay computes them in float32 (sharding.fp32_frozen)
            unavailable = ("the trajectory control is not available: the trained weights themselves are half "
                           "precision (a '16-true' or 'bf16-true' run), so there is no FP32 run to replay")
        else:
            unavailable = sharding.unsupported_reason(root, list(trainer.optimizers))
        if unavailable is None:  # the snapshots are taken in any case below: a rollback needs no FP32 replay
            fp32_unavailable = sharding.fp32_replay_unavailable(root)
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None and not _enabled(scaler):
            scaler = None  # a disabled GradScaler scales nothing: the run has no scaler to replay with
        algorithm = trainer.gradient_clip_algorithm
        split = scaler is not None and sharding.replicated(root)
        return cls(
            module=pl_module,
            optimizers=list(trainer.optimizers),
            scaler=scaler,
            schedulers=[(c.scheduler, c.frequency) for c in trainer.lr_scheduler_configs
                        if c.interval == "step" and not c.reduce_on_plateau],
            clip_val=trainer.gradient_clip_val,
            clip_algorithm=str(getattr(algorithm, "value", algorithm) or "norm"),
            accumulate=trainer.accumulate_grad_batches,
            device=pl_module.device,
            forward_context=plugin.forward_context,
            unavailable=unavailable,
            fp32_unavailable=fp32_unavailable,
            # through a root FSDP1 wrapper's forward, which gathers the parameters (a plain call everywhere else)
            step_loss=functools.partial(sharding.training_step, root, pl_module) if sharding.redirects(root) else None,
            root=root,
            split=split,
            replay_unavailable=replay_unavailable,
        )


def _enabled(scaler: Any) -> bool:
    """A GradScaler made with ``enabled=False`` (as Lightning's FSDP precision makes one without CUDA) scales
    nothing and keeps no state."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
