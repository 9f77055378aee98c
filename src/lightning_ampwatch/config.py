"""The flags both adapters take, in one typed, validated record.

``AmpWatch`` (Lightning) and ``FabricWatch`` (Fabric) accept the same keyword arguments and hand them to
:class:`WatchConfig`; a bad value is refused here, once, with the value and the values that are valid. No
Lightning import: a config can be built and checked outside any Trainer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Union

from lightning_ampwatch.steps.cadence import AUTO_START
from lightning_ampwatch.machine import Thresholds
from lightning_ampwatch.remedies.base import RemedyName
from lightning_ampwatch.remedies.policy import parse_remediate

UNRECOVERABLE_MODES = ("warn", "stop", "raise")
OnUnrecoverable = Literal["warn", "stop", "raise"]
#: ``True`` (a compact panel per diagnosis), ``"full"`` (every evidence row on the console) or ``False``.
Verbose = Union[bool, Literal["full"]]


@dataclass
class WatchConfig:
    """Every option of a watch (the adapters' docstrings say what each one does), checked when made.
    ``remedies`` is the set of remedies ``remediate`` allows; ``log_dir`` has ``~`` expanded."""

    remediate: Union[bool, str, Iterable[str]] = False
    on_unrecoverable: OnUnrecoverable = "warn"
    control_replay: bool = True
    localize: bool = True
    hold_lr_on_skip: bool = False
    verbose: Verbose = True
    thresholds: Thresholds | None = None
    log_dir: str | os.PathLike[str] | None = None
    name: str | None = None
    snapshot_every: Union[int, Literal["auto"]] = "auto"
    snapshot_budget: int | None = None
    rollback: bool = True
    replay_episode: bool = False
    remedies: frozenset[RemedyName] = field(init=False)

    def __post_init__(self) -> None:
        self.remedies = frozenset(parse_remediate(self.remediate))
        if self.on_unrecoverable not in UNRECOVERABLE_MODES:
            raise ValueError(f"on_unrecoverable={self.on_unrecoverable!r} is not valid; use one of "
                             f"{UNRECOVERABLE_MODES}")
        for flag in ("control_replay", "localize", "hold_lr_on_skip", "rollback", "replay_episode"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise ValueError(f"{flag}={value!r} is not valid; use True or False")
        verbose = self.verbose
        if not (isinstance(verbose, bool) or (isinstance(verbose, str) and verbose == "full")):
            raise ValueError(f"verbose={verbose!r} is not valid; use True or False, or \"full\" (every evidence row "
                             "on the console)")
        if self.thresholds is not None and not isinstance(self.thresholds, Thresholds):
            raise ValueError(f"thresholds={self.thresholds!r} is not valid; use lightning_ampwatch.Thresholds(...) "
                             "or None")
        if self.thresholds is None:
            self.thresholds = Thresholds()
        log_dir = self.log_dir
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(f"log_dir={log_dir!r} is not valid; use a path (str or os.PathLike) or None")
        self.log_dir = None if log_dir is None else os.path.expanduser(os.fspath(log_dir))
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"name={self.name!r} is not valid; use a non-empty string or None")
        every = self.snapshot_every
        if every != "auto" and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise ValueError(f"snapshot_every={every!r} is not valid; use a whole number of steps (0: off) or 'auto'")
        budget = self.snapshot_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0):
            raise ValueError(f"snapshot_budget={budget!r} is not valid; use a positive number of bytes or "
                             "None (a tenth of the host's RAM, at most 8 GiB)")

    @property
    def snapshot_interval(self) -> tuple[int, bool]:
        """(the interval snapshots start at, whether the cadence may lengthen it): ``"auto"`` starts at
        :data:`~lightning_ampwatch.steps.cadence.AUTO_START` steps and is adaptive; a number is kept as given."""
        if self.snapshot_every == "auto":
            return AUTO_START, True
        return int(self.snapshot_every), False

    @property
    def state_key(self) -> str:
        """Where a checkpoint files this watch's state: ``AmpWatch``, or ``AmpWatch[name]`` for a named one."""
        return "AmpWatch" if self.name is None else f"AmpWatch[{self.name}]"
