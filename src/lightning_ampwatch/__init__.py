"""lightning_ampwatch: name the cause when a mixed-precision Lightning run goes NaN, and fix it."""

from lightning_ampwatch.callback import AmpWatch
from lightning_ampwatch.machine import Thresholds
from lightning_ampwatch.taxonomy import AmpWatchError, Diagnosis, Finding

__all__ = ["AmpWatch", "AmpWatchError", "Diagnosis", "Finding", "Thresholds"]
__version__ = "0.1.0"
