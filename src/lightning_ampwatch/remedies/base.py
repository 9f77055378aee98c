"""What a remedy is, and the one registry of them.

A remedy is a small unit: it applies itself at an optimizer-step boundary and says what it changed, names what
AmpWatch must re-read afterwards, puts itself back after a resume when a checkpoint cannot carry it, and says in
one line what it did. Adding a remedy: a ``RemedyName`` member, and a ``@register``-ed unit in a module the
package imports (plus a ladder row in :mod:`.policy` if a finding should get it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Sequence, TypeVar

import torch
from torch import nn

from lightning_ampwatch.errors import RemedyError  # defined below the remedies: the DeepSpeed adapter raises it too
from lightning_ampwatch.taxonomy import Diagnosis

if TYPE_CHECKING:
    from lightning_ampwatch.guards import RecipeGuards


class RemedyName(str, Enum):
    """The names ``remediate=`` accepts; the value is what users write and what the event log holds."""

    LOWER_INIT_SCALE = "lower_init_scale"
    SLOW_GROWTH = "slow_growth"
    FP32_ISLAND = "fp32_island"
    BF16_FALLBACK = "bf16_fallback"
    REDUCE_LR = "reduce_lr"
    UNSCALE_BEFORE_CLIP = "unscale_before_clip"
    SKIP_BATCH = "skip_batch"  # a NaN/inf batch reached the weights: back to before it, and on without it

    def __str__(self) -> str:  # "fp32_island", not "RemedyName.FP32_ISLAND"
        return self.value


class Effect(Enum):
    """What AmpWatch must re-read after a remedy, because the remedy changed it under AmpWatch's feet."""

    SCALER = "scaler"  # the scaler's scale or growth settings: mirror them again
    PRECISION = "precision"  # the trainer's precision plugin: a new mode, maybe no scaler
    OPTIMIZERS = "optimizers"  # the learning rates (or the param groups themselves): read them again


@dataclass
class RemedyContext:
    """What a remedy may act on. Built by the callback; plain attributes so remedies stay testable."""

    trainer: Any
    module: nn.Module
    scaler: Any  # torch.amp.GradScaler or None
    device: torch.device
    safe_scale: float | None = None  # the largest scale at which a step went through
    guards: RecipeGuards | None = None  # the run's recipe guards (unscale_before_clip switches them)
    switch_precision: Callable[[str], None] | None = None
    """Swap the run's precision for the named one (``"bf16-mixed"``); None: ``trainer`` is a Lightning Trainer and
    its strategy's precision plugin is replaced."""
    lightning_module: Any = None
    """The LightningModule whose ``lr_scheduler_step`` the trainer calls for every scheduler step, where a ceiling on
    the learning rates can be held (``reduce_lr`` after an LR rise); None: the loop steps its schedulers and sets its
    learning rates itself (Fabric), and ``reduce_lr`` lowers the optimizers' and the schedulers' rates instead."""


@dataclass
class AppliedRemedy:
    """A remedy as it was applied (``step``: the first optimizer step run with it in effect; the finding's onset
    is the diagnosis's step): enough to show the user and to put it back after a resume."""

    name: RemedyName
    step: int
    finding: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name.value, "step": self.step, "finding": self.finding, "details": dict(self.details)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "AppliedRemedy":
        return cls(RemedyName(data["name"]), int(data["step"]), str(data["finding"]), dict(data.get("details", {})))


class Remedy(ABC):
    """One remedy. Stateless: what it changed lives in its ``details`` and in the objects it acted on."""

    name: ClassVar[RemedyName]
    effects: ClassVar[frozenset[Effect]] = frozenset()
    #: It acts on (or through) the float16 loss scaler: a later ``bf16_fallback`` took it out of the run.
    needs_scaler: ClassVar[bool] = False

    @abstractmethod
    def apply(self, ctx: RemedyContext, diagnosis: Diagnosis) -> dict[str, Any]:
        """Change the run; return the details (what it was before, what it is now). ``RemedyError`` if it cannot."""

    def reapply(self, ctx: RemedyContext, record: AppliedRemedy) -> str | None:
        """After a resume, before the first step. Nothing by default: the state lives in what Lightning checkpoints
        (the scaler's, the optimizers', the schedulers'). Returns None, or why it was not put back (the resumed run
        trains at another precision than the one it acted on, which is the user's to choose: it is kept)."""
        return None

    @abstractmethod
    def describe(self, details: Mapping[str, Any]) -> str:
        """One plain line for the console, from the details ``apply`` returned."""


REGISTRY: dict[RemedyName, Remedy] = {}

_Unit = TypeVar("_Unit", bound=type[Remedy])


def register(unit: _Unit) -> _Unit:
    """Class decorator: the one place a remedy is made known to the policy, the callback and resume."""
    REGISTRY[unit.name] = unit()
    return unit


def reapply_all(ctx: RemedyContext, applied: Sequence[AppliedRemedy]) -> list[str]:
    """On resume: every applied remedy puts back what a checkpoint could not carry, in the order applied. Returns
    the lines to say: one for each reason some were not put back, naming them. A scaler's remedy that a later
    ``bf16_fallback`` had already taken out of the run (bf16 has no scaler) is not named."""
    last_fallback = max((i for i, r in enumerate(applied) if r.name is RemedyName.BF16_FALLBACK), default=-1)
    left: dict[str, list[str]] = {}
    for i, record in enumerate(applied):
        unit = REGISTRY[record.name]
        why = unit.reapply(ctx, record)
        if why and not (unit.needs_scaler and i < last_fallback):
            names = left.setdefault(why, [])
            if record.name.value not in names:
                names.append(record.name.value)
    return [f"AmpWatch: the checkpoint's {', '.join(names)} {'was' if len(names) == 1 else 'were'} not applied "
            f"again: {why}." for why, names in left.items()]


def require_scaler(ctx: RemedyContext) -> Any:
    if ctx.scaler is None:
        raise RemedyError("there is no GradScaler in this run")
    return ctx.scaler
