"""Diagnoses reach the loggers people use: text where the logger takes text, ``ampwatch/*`` metrics at the trainer's
``log_every_n_steps``, several loggers at once. Real logger classes writing real files under tmp_path."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_ampwatch import AmpWatch
from lightning_ampwatch.scenarios import SCENARIOS, build_trainer

STEPS, EVERY = 40, 10


def fit_with(loggers: list[Any], root: Path) -> AmpWatch:
    """The gradient-overflow scenario (true fp16): GRADIENT_OVERFLOW at step 0, then NORMAL_SCALING."""
    watch = AmpWatch(verbose=False)
    scenario = SCENARIOS["gradient_overflow"]
    pl.seed_everything(0, verbose=False)
    trainer = build_trainer(scenario, [watch], str(root), logger=loggers, max_steps=STEPS, log_every_n_steps=EVERY)
    trainer.fit(scenario.model(), scenario.dataloader())
    found = [d.finding.value for d in watch.diagnoses]
    assert found == ["GRADIENT_OVERFLOW", "NORMAL_SCALING"], found
    return watch


def test_tensorboard_and_csv_at_once(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLogger(str(tmp_path), name="tb")
    csv_logger = CSVLogger(str(tmp_path), name="csv")
    watch = fit_with([tb, csv_logger], tmp_path)

    events = EventAccumulator(tb.log_dir, size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    texts = events.Tensors("ampwatch/diagnosis/text_summary")
    assert [t.step for t in texts] == [d.step for d in watch.diagnoses]
    first = texts[0].tensor_proto.string_val[0].decode()
    assert first.startswith("**GRADIENT_OVERFLOW** at step 0")
    assert "| safe_scale |" in first and "Fix: Start the scaler where it proved safe" in first
    scale_points = events.Scalars("ampwatch/scale")
    assert len(scale_points) == STEPS // EVERY  # log_every_n_steps, not every step
    assert scale_points[0].value < 2.0**16  # the scale had already come down from its default start

    with open(Path(csv_logger.log_dir) / "metrics.csv", newline="") as fh:
        logged = [row for row in csv.DictReader(fh) if row.get("ampwatch/scale")]
    assert [int(r["step"]) for r in logged] == [EVERY * (i + 1) - 1 for i in range(STEPS // EVERY)]
    assert {"ampwatch/skipped_steps", "ampwatch/skip_rate", "ampwatch/nonfinite_losses"} <= set(logged[0])
    assert watch.machine is not None
    assert float(logged[-1]["ampwatch/skipped_steps"]) == watch.machine.skipped_total
    # the text of a CSV run lives in the event log beside the metrics (the trainer's log_dir is the first logger's)
    assert (Path(tb.log_dir) / "ampwatch" / "diagnoses.jsonl").is_file()


def test_mlflow_file_store_gets_metrics_and_a_text_artifact_per_diagnosis(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # recent MLflow asks for this to use a plain directory
    mlflow_logger = MLFlowLogger(experiment_name="ampwatch", tracking_uri=f"file:{tmp_path / 'mlruns'}")
    watch = fit_with([mlflow_logger, CSVLogger(str(tmp_path), name="csv")], tmp_path)

    client, run_id = mlflow_logger.experiment, mlflow_logger.run_id
    history = client.get_metric_history(run_id, "ampwatch/scale")
    assert len(history) == STEPS // EVERY
    assert client.get_metric_history(run_id, "ampwatch/skipped_steps")[-1].value == watch.machine.skipped_total
    names = sorted(a.path for a in client.list_artifacts(run_id, "ampwatch"))
    assert names == ["ampwatch/step00000000_GRADIENT_OVERFLOW.md", "ampwatch/step00000028_NORMAL_SCALING.md"]
    artifact_dir = Path(client.get_run(run_id).info.artifact_uri.removeprefix("file://").removeprefix("file:"))
    text = (artifact_dir / names[0]).read_text(encoding="utf-8")
    assert text.startswith("**GRADIENT_OVERFLOW** at step 0") and "Fix: " in text


def test_wandb_offline_gets_metrics_and_the_diagnosis_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb_logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="ampwatch-test")
    try:
        watch = fit_with([wandb_logger], tmp_path)
        summary = dict(wandb_logger.experiment.summary)
        run_dir = Path(wandb_logger.experiment.dir)
    finally:
        wandb.finish()
    assert summary["ampwatch/skipped_steps"] == watch.machine.skipped_total
    assert summary["trainer/global_step"] == STEPS - 1
    tables = sorted((run_dir / "media" / "table" / "ampwatch").glob("diagnoses_*.table.json"),
                    key=lambda p: int(p.name.split("_")[1]))
    assert len(tables) == 2
    latest = json.loads(tables[-1].read_text())
    assert latest["columns"] == ["step", "finding", "location", "advice", "remedy", "outcome"]
    assert [row[:2] for row in latest["data"]] == [[0, "GRADIENT_OVERFLOW"], [28, "NORMAL_SCALING"]]  # all so far
