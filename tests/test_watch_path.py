"""What the watch path logs reaches TensorBoard. (Its host reads per step are counted in test_host_reads.py.)"""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import SCENARIOS

from conftest import make_trainer


def test_tensorboard_holds_the_scalars_and_the_diagnosis_text(tmp_path: Path) -> None:
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb", version=0)
    scenario = SCENARIOS["gradient_overflow"]
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = make_trainer(tmp_path, [watch], "fp16", logger=logger, max_steps=30, log_every_n_steps=5)
    trainer.fit(scenario.model(), scenario.dataloader())
    logger.experiment.flush()
    diagnosis = next(d for d in watch.diagnoses if d.finding is Finding.GRADIENT_OVERFLOW)

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    for name in ("ampwatch/scale", "ampwatch/skipped_steps", "ampwatch/nonfinite_losses"):
        assert name in tags["scalars"], tags["scalars"]

    scales = [e.value for e in events.Scalars("ampwatch/scale")]
    assert len(scales) == 6  # steps 4, 9, ..., 29
    assert all(math.log2(s).is_integer() for s in scales), scales  # GradScaler only halves and doubles
    assert max(scales) <= 2.0**16 and min(scales) < 2.0**16  # the scaler backed off from its start
    skipped = [e.value for e in events.Scalars("ampwatch/skipped_steps")]
    assert skipped == sorted(skipped) and skipped[-1] == watch.machine.skipped_total > 0  # type: ignore[union-attr]

    text_tags = [t for t in tags["tensors"] if t.startswith("ampwatch/diagnosis")]
    assert text_tags, tags["tensors"]
    texts = [tensor_event.tensor_proto.string_val[0].decode()
             for tag in text_tags for tensor_event in events.Tensors(tag)]
    assert any("GRADIENT_OVERFLOW" in t and f"at step {diagnosis.step}" in t for t in texts), texts
    assert any(diagnosis.advice[:60] in t for t in texts)
    # with a logger, the event log sits in the logger's directory
    assert (Path(logger.log_dir) / "ampwatch" / "diagnoses.jsonl").is_file()
