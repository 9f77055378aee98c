"""Every place a diagnosis, a metric or the summary goes while a run trains: the JSON event log, the timeline,
the console panel, logger text and the ``ampwatch/*`` metrics, behind one :class:`Reporters` object (each sink's
own words are in its module: :mod:`.event_log`, :mod:`.panel`, :mod:`.loggers`, :mod:`.unremedied`).

The event log is the source of truth: the console and the loggers never show anything it lacks. Each sink fails
alone, so a full disk or a broken logger costs that sink and never the run.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from rich.console import Console

from lightning_ampwatch import compat, distributed, protocol
from lightning_ampwatch.reporters.event_log import EventLog, ensure_writable
from lightning_ampwatch.reporters.loggers import text_writer
from lightning_ampwatch.reporters.panel import diagnosis_panel, update_panel
from lightning_ampwatch.reporters.unremedied import unremedied_reason
from lightning_ampwatch.summary import RunStats, summary_lines
from lightning_ampwatch.taxonomy import Diagnosis
from lightning_ampwatch.timeline import TIMELINE_NAME, Timeline

#: Where a line goes without an adapter's own ``say``: the logger Lightning's ``rank_zero_info`` writes to.
_RANK_ZERO_LOG = logging.getLogger("lightning.pytorch.utilities.rank_zero")
LOG_WINDOWS = 4  # the skip rate is a running mean over this many log intervals


def _times(n: int) -> str:
    """``2`` -> "the 2nd time"."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"the {n}{suffix} time"


class Reporters:
    """Every place a diagnosis, a metric or the summary goes. Each sink fails alone: a failure is warned once
    (naming the sink, and the path for files) and never stops the other sinks or the caller."""

    def __init__(self, log_dir: str | os.PathLike[str], *, is_global_zero: bool, verbose: bool | str,
                 precision: str, device: torch.device, world_size: int = 1,
                 remedies: Iterable[str] | None = None, say: Callable[[str], None] | None = None) -> None:
        self.dir = Path(log_dir) / "ampwatch"
        self.remedies = None if remedies is None else frozenset(str(r) for r in remedies)  # what remediate= allows
        self._say = say or _RANK_ZERO_LOG.info  # the adapter's rank-zero info line
        self.is_global_zero = is_global_zero
        self.verbose = verbose
        # what the console last showed of each diagnosis: a later fact about it prints as a short update
        self._printed: dict[tuple[Any, int], Diagnosis] = {}
        # the unremedied alarms shown as a panel, by (finding, location): [first step, times seen]; the same alarm
        # again prints one line (a glitch every few batches would otherwise print a panel every few steps)
        self._shown: dict[tuple[Any, str | None], list[int]] = {}
        self.event_log = EventLog(log_dir)
        self._warned: set[str] = set()
        self._console: Console | None = None  # made on first use: a Console does not pickle (ddp_spawn)
        self._step_metrics: compat.StepMetrics | None = None
        # The skip rate needs no cross-rank sum (under a scaler every rank skips the same steps) and its window
        # holds a few host integers: a deque does it at no cost, where torchmetrics' RunningMean took ~130 us a
        # log step. The non-finite count differs by rank: under DDP a sum across ranks (one process needs none, and
        # is spared it), which also carries the few counts the ranks agree on at log steps
        # (distributed.CrossRank.signals): one all-reduce for them all.
        self._skip_window: deque[tuple[int, int]] = deque(maxlen=LOG_WINDOWS)  # (steps, skipped) per interval
        self._nonfinite_sum = RankSums(distributed.SIGNALS, device) if world_size > 1 else None
        self._nonfinite_total = 0
        self.writable = is_global_zero and self._check_writable()
        self.timeline: Timeline | None = (
            Timeline(self.dir / TIMELINE_NAME, precision=precision) if self.writable else None)

    @classmethod
    def for_run(cls, config: Any, host: Any, precision: str, world_size: int,
                say: Callable[[str], None]) -> "Reporters":
        """The sinks of one run: in the watch's ``log_dir`` (else the host's), written on rank zero only, with the
        console's ``verbose`` and the remedies ``remediate=`` allows, as the configuration asks; ``say``: the
        adapter's one-line voice."""
        return cls(config.log_dir or host.log_dir, is_global_zero=host.is_global_zero, verbose=config.verbose,
                   precision=precision, device=host.device, world_size=world_size, remedies=config.remedies, say=say)

    def _check_writable(self) -> bool:
        try:
            ensure_writable(self.dir)
        except OSError as err:
            self._warn("files", f"AmpWatch cannot write its logs to {self.dir} ({err}); the event log and the "
                                "timeline are off for this run, the console and the loggers still get every "
                                "diagnosis.")
            return False
        return True

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = Console(highlight=False)
        return self._console

    def _warn(self, sink: str, message: str) -> None:
        if sink not in self._warned:
            self._warned.add(sink)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def sink(self, sink: str, action: Callable[[], Any], where: Path | None = None) -> None:
        """Run one sink (also an adapter's own, such as its logger connector); a failure is warned once per sink
        and goes no further."""
        try:
            action()
        except Exception as err:  # noqa: BLE001 - one broken sink must not silence the others
            at = f" ({where})" if where is not None else ""
            self._warn(sink, f"AmpWatch could not write to the {sink}{at}: {type(err).__name__}: {err}. "
                             "Training and AmpWatch's other outputs go on.")

    def publish(self, diagnosis: Diagnosis, loggers: Sequence[Any]) -> None:
        """Rank zero: event log, timeline marker, console panel (if verbose), logger text. Never raises."""
        if not self.is_global_zero:
            return
        if self.writable:
            self.sink("event log", lambda: self.event_log.append(diagnosis), self.event_log.path)
        if self.timeline is not None:
            self.sink("timeline", lambda: self.timeline.record_diagnosis(diagnosis), self.timeline.path)
        if self.verbose:
            self.sink("console", lambda: self._print(diagnosis))
        for logger in loggers:
            writer = text_writer(logger)
            if writer is not None:
                self.sink(type(logger).__name__, lambda: writer(logger, diagnosis))  # noqa: B023 - called at once

    def carry_over(self, diagnoses: Sequence[Diagnosis]) -> None:
        """Rank zero, at the start of a resumed run: the diagnoses its checkpoint brought back, written to this run's
        event log where it does not hold them yet (a resumed run that logs to a new directory), so that the log and
        ``ampwatch report`` count the whole run as its summary does. Never raises."""
        if not (self.is_global_zero and self.writable and diagnoses):
            return

        def write() -> None:
            path = self.event_log.path
            held = set(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else set()
            for d in diagnoses:
                if d.to_json() not in held:
                    self.event_log.append(d)

        self.sink("event log", write, self.event_log.path)

    def _print(self, diagnosis: Diagnosis) -> None:
        key = (diagnosis.finding, diagnosis.step)
        before = self._printed.get(key)
        same = (diagnosis.finding, diagnosis.location)
        seen = self._shown.get(same) if diagnosis.is_alarm and diagnosis.remedy is None else None
        if before is None and seen is not None and self.verbose != "full":
            seen[1] += 1
            where = f" in {diagnosis.location}" if diagnosis.location else ""
            self.console.print(f"AmpWatch: {diagnosis.finding.value} again at step {diagnosis.step}{where} "
                               f"({_times(seen[1])} this run; see the panel at step {seen[0]}; "
                               f"every record in {self.event_log.path if self.writable else 'the loggers'})")
        elif before is None:
            more_at = str(self.dir.parent) if self.writable else None
            self.console.print(diagnosis_panel(diagnosis, self.verbose, more_at))
            if diagnosis.is_alarm and diagnosis.remedy is None:
                self._shown.setdefault(same, [diagnosis.step, 1])
        else:
            self.console.print(update_panel(before, diagnosis, full=self.verbose == "full"))
        self._printed[key] = diagnosis

    def record_remedy(self, step: int, name: str) -> None:
        if self.timeline is not None:
            self.sink("timeline", lambda: self.timeline.record_remedy(step, name), self.timeline.path)

    def say(self, message: str) -> None:
        """One plain line on rank zero, prefixed with "AmpWatch: " unless it already names AmpWatch."""
        if self.is_global_zero:
            self._say(message if message.startswith("AmpWatch") else f"AmpWatch: {message}")

    def metric_tensors(self, trainer: Any, *, steps: int, skipped: int, nonfinite: int,
                       signals: Sequence[float] = (0.0, 0.0)) -> list[torch.Tensor]:
        """Under DDP, the cross-rank sums as one device vector, not read: it joins the log step's one packed read
        (its first value is the non-finite count, then ``signals``, each rank's increments of what the ranks agree
        on: see :class:`~lightning_ampwatch.distributed.CrossRank`). Empty with one process, or when there is no
        logger. Also takes the interval's counts."""
        if not trainer.loggers and self._nonfinite_sum is None:
            return []
        # Under DDP the cross-rank sum is taken with or without a logger: it is the agreement point at
        # which rank zero learns of a fault another rank judged alone (distributed.Relay)
        self._skip_window.append((steps, skipped))
        self._nonfinite_total += nonfinite
        if self._nonfinite_sum is None:
            return []  # one process: the host count is the total
        self._nonfinite_sum.update(torch.tensor([float(nonfinite), *signals], device=self._nonfinite_sum.device))
        return [self._nonfinite_sum.compute()]

    def log_metrics(self, trainer: Any, values: Sequence[float], *, skipped_total: int, scale: float | None,
                    send: Callable[[dict[str, float]], None] | None = None) -> None:
        """The ``ampwatch/*`` metrics (``values``: what :meth:`metric_tensors` gave, read), only when there is a
        logger, through Lightning's logger connector at the step Lightning logs at (see ``compat.StepMetrics``). Not
        ``self.log``: its bookkeeping costs milliseconds per call."""
        if not trainer.loggers:
            return
        nonfinite_total = values[0] if values else self._nonfinite_total
        steps = skipped = 0
        for n, k in self._skip_window:  # one pass, no generators: once per log step
            steps += n
            skipped += k
        skip_rate = skipped / steps if steps else 0.0
        metrics: dict[str, float] = {
            "ampwatch/skipped_steps": float(skipped_total),
            "ampwatch/nonfinite_losses": float(nonfinite_total),
            "ampwatch/skip_rate": float(skip_rate),
        }
        if scale is not None:
            metrics["ampwatch/scale"] = float(scale)
        self.sink("loggers", lambda: send(metrics) if send is not None else self._hold_metrics(trainer, metrics))

    def _hold_metrics(self, trainer: Any, metrics: dict[str, float]) -> None:
        """A Lightning trainer's way: in the same logger call as the step's own values (``compat.StepMetrics``)."""
        connector = compat.logger_connector(trainer)
        if self._step_metrics is None or self._step_metrics.connector is not connector:
            self._step_metrics = compat.StepMetrics(connector)
        self._step_metrics.hold(compat.batches_that_stepped(trainer), metrics)

    def flush(self, read_last_loss: Callable[[], float] | None = None) -> None:
        """Write the buffered timeline rows; ``read_last_loss`` samples the latest loss. Never raises."""
        if self.timeline is not None:
            self.sink("timeline", lambda: self.timeline.flush(read_last_loss), self.timeline.path)

    def finish(self, diagnoses: Sequence[Diagnosis], stats: RunStats | None) -> None:
        """End of fit: the exact counters and the last rows to the timeline, then the summary (rank zero,
        verbose)."""
        self.sink("loggers", self._release_metrics)
        if self.timeline is not None and stats is not None:
            scale = stats.scale if stats.precision in (None, "fp16") else None  # a bf16 fallback dropped the scaler
            self.sink("timeline", lambda: self.timeline.record_end(stats.steps, stats.skipped, stats.nonfinite,
                                                                   scale, precision=stats.precision),
                      self.timeline.path)
        self.flush()
        if self.is_global_zero and self.verbose and stats is not None:
            self.sink("console", lambda: self._print_summary(diagnoses, stats))

    def _print_summary(self, diagnoses: Sequence[Diagnosis], stats: RunStats) -> None:
        why = {(d.finding, d.step): unremedied_reason(d, diagnoses, self.remedies)
               for d in diagnoses if d.is_alarm and not d.remedy}
        for line in summary_lines(diagnoses, stats, self.dir.parent, why):
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def _release_metrics(self) -> None:
        step_metrics, self._step_metrics = self._step_metrics, None
        if step_metrics is not None:
            step_metrics.detach()

    def close(self) -> None:
        """On an exception or at teardown: what is buffered goes to disk, the connector is left as found."""
        self.sink("loggers", self._release_metrics)
        if self.timeline is not None:
            self.sink("timeline", self.timeline.close, self.timeline.path)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_console"] = None
        state["_step_metrics"] = None  # bound to one trainer's connector, which a spawned process does not share
        return state


class RankSums:
    """A vector of counts summed over the ranks, each rank adding its increments: the non-finite count and the counts
    of :data:`lightning_ampwatch.distributed.SIGNALS`. One ``all_reduce`` of a few floats at ``compute`` (no read:
    the result joins the log step's packed read). A torchmetrics sum would gather the vector's shape first, a
    second collective at every log step."""

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        self.sums = torch.zeros(size, device=device)

    @property
    def device(self) -> torch.device:
        return self.sums.device

    def update(self, values: torch.Tensor) -> None:
        self.sums += values

    def compute(self) -> torch.Tensor:
        summed = self.sums.clone()
        if distributed.world_size() > 1:
            protocol.all_reduce(summed)
        return summed
