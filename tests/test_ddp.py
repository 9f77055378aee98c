"""Two CPU processes with gloo: a fault on one rank is reported identically on both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class DumpDiagnoses(Callback):
    """Each rank writes what its AmpWatch concluded, so the parent process can compare the ranks."""

    def __init__(self, watch: AmpWatch, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps([d.to_dict() for d in self.watch.diagnoses]))


def _fit_ddp(tmp_path: Path, nan_rows: tuple[int, ...], max_steps: int = 6) -> list[list[dict[str, Any]]]:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=max_steps, plugins=[true_fp16_plugin()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, DumpDiagnoses(watch, str(tmp_path))],
    )
    # DistributedSampler without shuffling: rank r gets dataset rows r, r+2, r+4, ...
    data = regression_data(n=256, nan_rows=nan_rows)
    trainer.fit(Regressor(), DataLoader(data, batch_size=16))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_nan_on_rank_one_only_is_reported_the_same_on_both_ranks(tmp_path: Path) -> None:
    # the DistributedSampler deals odd dataset rows to rank 1: row 67 is seen by rank 1 alone
    rank0, rank1 = _fit_ddp(tmp_path, nan_rows=(67,))
    assert rank0 == rank1, "both ranks must reach the same diagnoses"
    alarms = [d for d in rank0 if d["finding"] != Finding.NORMAL_SCALING.value]
    assert [d["finding"] for d in alarms] == [Finding.DATA_NONFINITE.value]
    d = alarms[0]
    assert d["evidence"]["fault_ranks"] == [1]
    assert d["evidence"]["investigated_on_rank"] == 1
    assert d["evidence"]["nonfinite_where"].startswith("rank 1: batch[0] rows [")
    assert d["evidence"]["fp32_control_loss"] == "nan"
    # rank zero alone writes the event log, with the agreed diagnosis
    lines = (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()
    assert [json.loads(line)["finding"] for line in lines] == [d["finding"] for d in rank0]
