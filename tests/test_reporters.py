"""``Reporters``, the callback's one way out: each sink fails alone (warned once, naming the sink and the path),
user-derived text prints as written, and ``ampwatch/*`` metrics share the CSV row of the step's own ``self.log``.
Real files, real loggers, a real Trainer; nothing mocked."""

from __future__ import annotations

import csv
import logging
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_ampwatch import Diagnosis, Finding
from lightning_ampwatch.reporters import EVENT_LOG_NAME, Reporters
from lightning_ampwatch.scenarios import Regressor, regression_data
from lightning_ampwatch.summary import RunStats
from lightning_ampwatch.timeline import TIMELINE_NAME, read_timeline

CPU = torch.device("cpu")

# What a user's own model can put in front of the console: a ModuleDict key and a quoted code line.
HOSTILE = Diagnosis(Finding.FORWARD_OVERFLOW, 3, location="heads.[bold red]x",
                    evidence={"[dim]op": "return losses[idx] * 1024", "max_abs": 7.0e4},
                    advice="Compute [italic]exp in float32.", remedy="fp32_island", outcome="recovered")


def reporters(log_dir: Path, **kwargs: Any) -> Reporters:
    options: dict[str, Any] = dict(is_global_zero=True, verbose=True, precision="fp16", device=CPU)
    options.update(kwargs)
    return Reporters(log_dir, **options)


def flat(text: str) -> str:
    """The console wraps and frames long lines; compare words."""
    return " ".join(text.replace("│", " ").split())


def tensorboard_texts(logger: TensorBoardLogger) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    return [t.tensor_proto.string_val[0].decode() for t in events.Tensors("ampwatch/diagnosis/text_summary")]


def test_console_panel_prints_user_text_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # verbose="full": the compact panel shows only a finding's own evidence rows, and "[dim]op" is not one of them
    reporters(tmp_path, verbose="full").publish(HOSTILE, [])
    out = flat(capsys.readouterr().out)
    assert "AmpWatch: FORWARD_OVERFLOW at step 3 in heads.[bold red]x" in out
    assert "[dim]op" in out and "return losses[idx] * 1024" in out
    assert "Fix: Compute [italic]exp in float32." in out and "Applied: fp32_island" in out


def test_summary_prints_user_text_as_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reporters(tmp_path).finish([HOSTILE], RunStats(8, skipped=1, scale=2.0**10))
    out = capsys.readouterr().out
    assert "step      3  FORWARD_OVERFLOW in heads.[bold red]x (fixed with fp32_island, recovery verified)" in out


def test_publish_writes_every_sink(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    sinks = reporters(tmp_path)
    assert sinks.writable and sinks.dir == tmp_path / "ampwatch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a healthy directory warns nothing
        sinks.publish(HOSTILE, [tb])
        sinks.record_remedy(3, "fp32_island")
        sinks.finish([HOSTILE], RunStats(8, skipped=1))
    assert Diagnosis.from_dict(__import__("json").loads((sinks.dir / EVENT_LOG_NAME).read_text())) == HOSTILE
    data = read_timeline(sinks.dir / TIMELINE_NAME)
    assert [e["finding"] for e in data.of_kind("diagnosis")] == ["FORWARD_OVERFLOW"]
    assert data.of_kind("remedy") == [{"event": "remedy", "step": 3, "name": "fp32_island"}]
    assert tensorboard_texts(tb)[0].startswith("**FORWARD_OVERFLOW** at step 3")
    assert "AmpWatch summary: 8 optimizer steps" in capsys.readouterr().out


def test_unwritable_log_dir_warns_once_and_console_and_loggers_still_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    tb = TensorBoardLogger(str(tmp_path), name="tb")
    with pytest.warns(RuntimeWarning) as caught:
        sinks = reporters(blocker / "run")
        sinks.publish(HOSTILE, [tb])
        sinks.publish(HOSTILE, [tb])
        sinks.flush()
        sinks.finish([HOSTILE], RunStats(8))
        sinks.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert f"cannot write its logs to {blocker / 'run' / 'ampwatch'}" in messages[0]
    assert not sinks.writable and sinks.timeline is None
    out = flat(capsys.readouterr().out)
    assert out.count("AmpWatch: FORWARD_OVERFLOW at step 3") == 2  # both panels
    assert len(tensorboard_texts(tb)) == 2  # and both texts


def test_a_sink_failing_mid_run_is_warned_once_and_the_others_go_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sinks = reporters(tmp_path)
    (sinks.dir / EVENT_LOG_NAME).mkdir(parents=True)  # the event log cannot be opened for appending now
    broken_logger = TensorBoardLogger(str(tmp_path / "a_file"))  # its experiment cannot be created ...
    (tmp_path / "a_file").write_text("a file where the logger wants a directory")  # ... under a regular file
    with pytest.warns(RuntimeWarning) as caught:
        sinks.publish(HOSTILE, [broken_logger])
        sinks.publish(HOSTILE, [broken_logger])
    messages = sorted(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
    assert len(messages) == 2, messages  # one per sink, not one per failure
    assert messages[0].startswith("AmpWatch could not write to the TensorBoardLogger: ")
    assert messages[1].startswith(f"AmpWatch could not write to the event log ({sinks.dir / EVENT_LOG_NAME}): ")
    assert flat(capsys.readouterr().out).count("AmpWatch: FORWARD_OVERFLOW at step 3") == 2
    sinks.finish([HOSTILE], RunStats(8))  # the timeline still gets its marker and end
    assert read_timeline(sinks.dir / TIMELINE_NAME).of_kind("end")[0]["steps"] == 8


def test_a_timeline_that_cannot_be_written_never_raises(tmp_path: Path) -> None:
    sinks = reporters(tmp_path, verbose=False)
    assert sinks.timeline is not None
    (sinks.dir / TIMELINE_NAME).mkdir()  # the timeline's file cannot be opened now
    sinks.timeline.record_step(0, skipped=True, scale=2.0)
    with pytest.warns(RuntimeWarning) as caught:
        sinks.flush()
        sinks.publish(HOSTILE, [])
        sinks.finish([HOSTILE], RunStats(1, skipped=1))
        sinks.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"AmpWatch could not write to the timeline ({sinks.dir / TIMELINE_NAME}): "
                                  "IsADirectoryError")
    assert (sinks.dir / EVENT_LOG_NAME).is_file()  # the event log is another sink: it still works


def test_other_ranks_write_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sinks = reporters(tmp_path, is_global_zero=False)
    sinks.publish(HOSTILE, [])
    sinks.say("rank one speaking")
    sinks.finish([HOSTILE], RunStats(8))
    assert sinks.timeline is None and not sinks.writable
    assert not (tmp_path / "ampwatch").exists()
    assert capsys.readouterr().out == ""


def test_say_prefixes_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("lightning.pytorch", "lightning.fabric"):
        caplog.set_level(logging.INFO, logger=name)
    sinks = reporters(tmp_path)
    sinks.say("bf16 has no scaler to watch.")
    sinks.say("AmpWatch stops the run after GRADIENT_OVERFLOW at step 4.")
    assert [r.getMessage() for r in caplog.records] == [
        "AmpWatch: bf16 has no scaler to watch.", "AmpWatch stops the run after GRADIENT_OVERFLOW at step 4."]


def test_pickles_without_its_console(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sinks = reporters(tmp_path)
    sinks.publish(HOSTILE, [])  # makes the console
    copy = pickle.loads(pickle.dumps(sinks))  # ddp_spawn sends the callback to each process
    copy.publish(HOSTILE, [])
    assert flat(capsys.readouterr().out).count("FORWARD_OVERFLOW at step 3") == 2


# ---------------------------------------------------------------------------- metrics, in a real Trainer


class LogsItsLoss(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


class MetricsEvery(pl.Callback):
    """What the callback does at its log steps, and at one step Lightning does not log (``extra``)."""

    def __init__(self, root: Path, every: int, extra: int) -> None:
        self.root, self.every, self.extra = root, every, extra
        self.sinks: Reporters | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.sinks = reporters(self.root, verbose=False)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        assert self.sinks is not None
        if trainer.global_step % self.every == 0 or trainer.global_step == self.extra:
            values = [float(t) for t in self.sinks.metric_tensors(trainer, steps=self.every, skipped=1, nonfinite=0)]
            self.sinks.log_metrics(trainer, values, skipped_total=trainer.global_step, scale=2.0**10)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.sinks is not None
        self.sinks.finish([], None)


def test_metrics_share_the_csv_row_of_the_steps_own_logged_values(tmp_path: Path) -> None:
    every, steps, extra = 5, 20, 7
    pl.seed_everything(0, verbose=False)
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    watch = MetricsEvery(tmp_path, every, extra)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, log_every_n_steps=every, logger=csv_logger,
                         callbacks=[watch], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(LogsItsLoss(), torch.utils.data.DataLoader(regression_data(n=256), batch_size=8))
    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    ours = [r for r in rows if r["ampwatch/scale"]]
    assert [int(r["step"]) for r in ours] == [4, extra - 1, 9, 14, 19]
    for row in ours:
        assert float(row["ampwatch/scale"]) == 1024.0 and row["ampwatch/skip_rate"]
        if int(row["step"]) != extra - 1:  # a step Lightning logs: one row with the user's value
            assert row["train_loss"], row
    assert [int(r["step"]) for r in rows if r["train_loss"]] == [4, 9, 14, 19]  # no row of their own
    assert len(rows) == 5  # Lightning's four, and the extra step's own
    assert "ampwatch/skipped_steps" in trainer.logged_metrics
    assert "log_metrics" not in vars(trainer._logger_connector)  # the connector is left as it was found


def test_an_unremedied_alarm_again_in_the_same_place_prints_one_line_and_full_prints_every_panel(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def alarm(step: int, location: str | None = "net.0", remedy: str | None = None) -> Diagnosis:
        return Diagnosis(Finding.INPUT_RANGE, step, location=location, evidence={"input_absmax": 1e5},
                         advice=f"Normalise the inputs (step {step}).", remedy=remedy)

    sink = reporters(tmp_path)
    for d in (alarm(8), alarm(17), alarm(20, location="net.3"), alarm(26), alarm(30, remedy="fp32_island")):
        sink.publish(d, [])
    out = flat(capsys.readouterr().out)
    # one panel for net.0, a line for each recurrence there (its advice may differ: a recurrence is not replayed);
    # another place, and an alarm that got a remedy, each get their own panel
    assert [s for s in (8, 17, 20, 26, 30) if f"AmpWatch: INPUT_RANGE at step {s} " in out] == [8, 20, 30]
    assert "AmpWatch: INPUT_RANGE again at step 17 in net.0 (the 2nd time this run; see the panel at step 8; " \
           "every record in" in out
    assert "INPUT_RANGE again at step 26 in net.0 (the 3rd time this run;" in out
    assert len((tmp_path / "ampwatch" / EVENT_LOG_NAME).read_text().splitlines()) == 5  # nothing lost
    full = reporters(tmp_path / "full", verbose="full")
    for d in (alarm(8), alarm(17)):
        full.publish(d, [])
    out = flat(capsys.readouterr().out)
    assert "AmpWatch: INPUT_RANGE at step 17 in net.0" in out and "again" not in out
