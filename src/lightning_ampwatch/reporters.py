"""PROVISIONAL: replaced by the reporting room's version at merge."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_info
from rich.console import Console
from torchmetrics.aggregation import RunningMean, SumMetric

from lightning_ampwatch.report import EventLog, print_diagnosis, write_text
from lightning_ampwatch.summary import RunStats, summary_lines
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch.timeline import TIMELINE_NAME, Timeline


class Reporters:
    def __init__(self, log_dir: str | os.PathLike[str], *, is_global_zero: bool, verbose: bool, precision: str,
                 device: torch.device) -> None:
        self.event_log = EventLog(log_dir)
        self.dir = self.event_log.dir
        self.is_global_zero = is_global_zero
        self.verbose = verbose
        self.timeline = Timeline(self.dir / TIMELINE_NAME if is_global_zero else None, precision=precision)
        self._skip_rate = RunningMean(window=4).to(device)
        self._nonfinite_sum = SumMetric().to(device)
        self._device = device
        self._console: Console | None = None
        self._said: set[str] = set()
        self._failed: set[str] = set()

    def _sink(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001
            if name not in self._failed:
                self._failed.add(name)
                warnings.warn(f"AmpWatch could not write to {name}: {type(err).__name__}: {err}", RuntimeWarning)

    def console(self) -> Console:
        if self._console is None:
            self._console = Console(highlight=False)
        return self._console

    def publish(self, diagnosis: Diagnosis, loggers: Sequence[Any]) -> None:
        if not self.is_global_zero:
            return
        self._sink(str(self.event_log.path), lambda: self.event_log.append(diagnosis))
        self._sink("the timeline", lambda: self.timeline.record_diagnosis(diagnosis))
        if self.verbose:
            self._sink("the console", lambda: print_diagnosis(diagnosis, self.console()))
        self._sink("the loggers", lambda: write_text(loggers, diagnosis))

    def record_remedy(self, step: int, name: str) -> None:
        self.timeline.record_remedy(step, name)

    def say(self, message: str, key: str | None = None) -> None:
        key = key or message
        if key not in self._said:
            self._said.add(key)
            rank_zero_info(f"AmpWatch: {message}")

    def log_metrics(self, trainer: Any, *, steps: int, skipped: int, nonfinite: int, skipped_total: int,
                    scale: float | None) -> None:
        if not trainer.loggers:
            return
        if steps:
            flags = torch.zeros(steps, device=self._device)
            flags[:skipped] = 1.0
            self._skip_rate.update(flags)
        self._nonfinite_sum.update(torch.tensor(float(nonfinite), device=self._device))
        metrics: dict[str, float] = {
            "ampwatch/skipped_steps": float(skipped_total),
            "ampwatch/nonfinite_losses": float(self._nonfinite_sum.compute()),
            "ampwatch/skip_rate": float(self._skip_rate.compute()),
        }
        if scale is not None:
            metrics["ampwatch/scale"] = scale
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and hasattr(connector, "log_metrics"):
            connector.log_metrics(metrics)
        else:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def flush(self, read_last_loss: Callable[[], float] | None = None) -> None:
        self._sink("the timeline", lambda: self.timeline.flush(read_last_loss=read_last_loss))

    def finish(self, diagnoses: Sequence[Diagnosis], stats: RunStats | None) -> None:
        if stats is not None:
            self.timeline.record_end(stats.steps, stats.skipped, stats.nonfinite, stats.scale)
        self.flush()
        if self.is_global_zero and self.verbose and stats is not None:
            for line in summary_lines(diagnoses, stats, self.dir.parent):
                self.console().print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        self._sink("the timeline", self.timeline.close)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_console"] = None
        return state
