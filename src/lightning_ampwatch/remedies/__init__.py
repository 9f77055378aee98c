"""Fixes AmpWatch can apply mid-run, and the policy that picks one for a finding.

Each remedy is a unit in :data:`REGISTRY` (see :mod:`.base`); the policy is a table, finding -> ordered ladder of
remedies: when a finding comes back after a remedy, the next rung applies; when no allowed rung is left, the
finding is unrecoverable and ``on_unrecoverable`` decides.
"""

from lightning_ampwatch.remedies.base import (
    REGISTRY,
    AppliedRemedy,
    Effect,
    Remedy,
    RemedyContext,
    RemedyError,
    RemedyName,
    reapply_all,
)
from lightning_ampwatch.remedies.data import SkipBatch
from lightning_ampwatch.remedies.hold_lr import HoldLrOnSkip, LrCeiling
from lightning_ampwatch.remedies.island import ISLAND_ATTR, Fp32Island, attach_island, detach_island
from lightning_ampwatch.remedies.lr import ReduceLr
from lightning_ampwatch.remedies.policy import DEFAULT_REMEDIES, LADDERS, RemedyPolicy, ladder_for, parse_remediate
from lightning_ampwatch.remedies.precision import Bf16Fallback, bf16_supported
from lightning_ampwatch.remedies.scaler import LowerInitScale, SlowGrowth, UnscaleBeforeClip

__all__ = [
    "DEFAULT_REMEDIES", "ISLAND_ATTR", "LADDERS", "REGISTRY", "AppliedRemedy", "Bf16Fallback", "Effect", "Fp32Island",
    "HoldLrOnSkip", "LowerInitScale", "LrCeiling", "ReduceLr", "Remedy", "RemedyContext", "RemedyError", "RemedyName",
    "RemedyPolicy", "SkipBatch", "SlowGrowth", "UnscaleBeforeClip", "attach_island", "bf16_supported", "detach_island",
    "ladder_for", "parse_remediate", "reapply_all",
]
