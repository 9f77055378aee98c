"""The log cadence: on a fast step, the log step's own work (the losses' read, the loss level, the timeline) is done
every few framework log steps while the run is quiet, so that it costs at most a fixed share of the training time;
the ``ampwatch/*`` metrics still go out at every log step, and anything in progress brings the work back to every
log step. The policy is pure (unit tests); real fits, on a scripted clock so that the interval is known, check what
a user sees: the sentence said once, the metrics at every log step, the timeline written at the chosen interval,
and a fault after the interval was lengthened found at the next log step."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.steps import CleanRuns, route
from lightning_ampwatch.steps.cadence import LOG_CADENCE_AFTER, LOG_FRACTION, LOG_MAX_INTERVAL, LogCadence
from lightning_ampwatch.scenarios import Regressor, regression_data
from lightning_ampwatch.timeline import TIMELINE_NAME

from conftest import FileSizes, make_trainer

# ---------------------------------------------------------------------------------------------- the policy, pure


def _feed(cadence: LogCadence, log_steps: list[int], step_s: float, cost_s: float) -> list[str | None]:
    """Log steps at ``log_steps``, each doing ``cost_s`` of work, with healthy steps of ``step_s`` between them."""
    said, t, previous = [], 0.0, None
    for step in log_steps:
        start = t + (0.0 if previous is None else (step - previous) * step_s)
        said.append(cadence.observe(step, start, start + cost_s))
        t, previous = start + cost_s, step
    return said


def test_the_cadence_decides_once_from_the_cheapest_measures() -> None:
    cadence = LogCadence(50)
    said = _feed(cadence, [250, 300, 350, 400, 450, 500], 0.0007, 0.0003)
    assert cadence.decided and cadence.interval == 200
    assert said[:3] == [None, None, None] and said[4:] == [None, None]
    assert said[3] is not None and "every 200 steps instead of every 50" in said[3]
    assert "metrics still go out every 50 steps" in said[3]
    assert len(cadence.costs) == 3 and min(cadence.costs) == pytest.approx(0.0003)
    share = 0.0003 / (200 * 0.0007)
    assert f"({share:.2%} of the training time)" in said[3] and share <= LOG_FRACTION


def test_a_cheap_log_step_keeps_every_log_step() -> None:
    cadence = LogCadence(50)
    said = _feed(cadence, [300, 350, 400, 450], 0.02, 0.0003)  # 0.3 ms against 20 ms steps: 0.03%
    assert cadence.decided and cadence.interval == 50 and said == [None] * 4


def test_a_loaded_span_does_not_shorten_the_interval() -> None:
    cadence = LogCadence(50)
    t = 0.0
    for step, step_s in ((300, 0.0007), (350, 0.0007), (400, 0.02), (450, 0.0007)):  # one span 30x slower
        cadence.observe(step, t, t + 0.0003)
        t += 0.0003 + 50 * step_s
    assert cadence.decided and cadence.interval == 200  # the fastest span counts


def test_the_interval_is_capped() -> None:
    cadence = LogCadence(30)
    _feed(cadence, [300, 330, 360, 390], 0.0001, 0.1)  # 100 ms of work against 0.1 ms steps
    assert cadence.decided and cadence.interval == LOG_MAX_INTERVAL - LOG_MAX_INTERVAL % 30


def test_short_runs_are_never_measured() -> None:
    cadence = LogCadence(10)
    _feed(cadence, list(range(10, LOG_CADENCE_AFTER, 10)), 0.0007, 0.0003)
    assert not cadence.decided and cadence.costs == [] and cadence.interval == 10


@pytest.mark.parametrize("kwargs", [{"every": 0}, {"every": True}, {"every": 2.5}, {"every": 10, "fraction": 0},
                                    {"every": 10, "fraction": 1.5}])
def test_the_cadence_checks_its_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        LogCadence(**kwargs)


# ---------------------------------------------------------------------------------------------- real fits


class ScriptedClock(pl.Callback):
    """The log cadence's clock (``route._clock``) scripted: each batch takes 1 ms, each reading of the clock 0.1 ms.
    A timed log step reads it twice, so its work takes 0.1 ms against steps of 1.01 ms: 0.1 / (0.25% x 1.01) = 39.6
    steps, so every 40 steps instead of every 10."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(route, "_clock", self._read)

    def _read(self) -> float:
        now = self.now
        self.now += 1e-4
        return now

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.now += 1e-3


class LateOverflow(Regressor):
    """Healthy until ``from_step``; then its inputs are scaled by 1e5, so the first Linear layer overflows float16
    under autocast (inf activations, a non-finite loss, every step skipped)."""

    def __init__(self, from_step: int) -> None:
        super().__init__()
        self.from_step = from_step

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.global_step >= self.from_step:
            x = x * 1e5
        return nn.functional.mse_loss(self(x), y)


def _fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: Regressor, steps: int
         ) -> tuple[AmpWatch, FileSizes]:
    watch = AmpWatch(verbose=False, snapshot_every=0)
    clock = ScriptedClock(monkeypatch)
    sizes = FileSizes(tmp_path / "csv" / "version_0" / "ampwatch" / TIMELINE_NAME)  # beside the logger's files
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [clock, watch, sizes], "fp16", {"init_scale": 2.0**10, "growth_interval": 10**6},
                           max_steps=steps, logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=10)
    trainer.fit(model, DataLoader(regression_data(n=4096), batch_size=32))
    return watch, sizes


def _metric_steps(tmp_path: Path) -> list[int]:
    (path,) = tmp_path.glob("csv/*/metrics.csv")
    with path.open() as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("ampwatch/skip_rate")]


def test_a_long_quiet_run_does_the_log_step_work_every_chosen_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        watch, sizes = _fit(tmp_path, monkeypatch, Regressor(), 520)
    assert watch.diagnoses == []
    said = [r.getMessage() for r in caplog.records if "log-step work" in r.getMessage()]
    assert len(said) == 1 and "every 40 steps instead of every 10" in said[0]
    # the metrics at every log step, as before (Lightning's row index counts from 0: the step after 10 is 9)
    assert _metric_steps(tmp_path) == list(range(9, 520, 10))
    # the timeline: written at every log step up to the one the cadence decided at (300, 310, 320 timed), then at
    # every 40th step, and at the fit's end
    assert sizes.grew_at() == list(range(10, 330, 10)) + [360, 400, 440, 480, 520]


def test_a_fault_after_the_interval_was_lengthened_is_found_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    watch, sizes = _fit(tmp_path, monkeypatch, LateOverflow(from_step=405), 440)
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert alarms, "the overflow after step 405 was not diagnosed"
    # (which finding is the diagnosis's business: 1e5-scale inputs also blow up an FP32 replay; here, only when)
    assert alarms[0].step == 405
    # with an episode open the run is not quiet: the log step's work is back at every log step (410, 420, 430)
    grew = sizes.grew_at()
    assert [s for s in grew if s > 400] == [410, 420, 430, 440]
    assert [s for s in grew if 320 < s <= 400] == [360, 400]


class SlowerLogStepClock(ScriptedClock):
    """As :class:`ScriptedClock`, but each reading takes 0.2 ms: 0.2 / (0.25% x 1.02) = 78.4 steps, so the log step's
    work is done every 80 steps instead of every 10: longer than the 64 steps a run of held steps may last."""

    def _read(self) -> float:
        now = self.now
        self.now += 2e-4
        return now


def test_a_lengthened_interval_still_hands_the_held_steps_over_64_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log step hands over the healthy steps held back since the last hand-over, and reads the losses held: each
    is about a microsecond a step, wherever it happens, so a log step done every 80 steps must not take 80 of them
    (that made the log step dearer the longer the cadence made its interval). Runs and, on the CPU, the loss ring
    stay at 64 steps (``route.MAX_DEFERRED``); the step where one fills hands it over between two log steps."""
    handed: list[int] = []
    settle = CleanRuns.settle

    def counting(self: CleanRuns) -> None:
        if self.deferred:
            handed.append(len(self.deferred))
        settle(self)

    monkeypatch.setattr(CleanRuns, "settle", counting)
    seen: dict[str, int] = {"judge": 0, "capacity": 0, "held": 0}

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            ledger = watch.watcher.ledger
            seen["judge"] = max(seen["judge"], watch.watcher.route.judge_every)
            seen["capacity"] = max(seen["capacity"], ledger.losses.capacity)
            seen["held"] = max(seen["held"], len(ledger.losses.entries))

    watch = AmpWatch(verbose=False, snapshot_every=0)
    clock = SlowerLogStepClock(monkeypatch)
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [clock, watch, Look()], "fp16", {"init_scale": 2.0**10, "growth_interval": 10**6},
                           max_steps=600, log_every_n_steps=10)
    trainer.fit(Regressor(), DataLoader(regression_data(n=4096), batch_size=32))
    assert watch.diagnoses == []
    assert seen["judge"] == 80  # the cadence lengthened the interval past 64 steps ...
    assert route.MAX_DEFERRED == 64 and 32 < max(handed) <= 64  # ... and the runs still end within 64 steps
    assert seen["capacity"] == 64 and seen["held"] <= 64
