"""DeepSpeed (ZeRO stage 2, bf16) in two CPU processes: AmpWatch starts, and a NaN in rank 1's data reaches rank
zero's report. Skipped, with the reason, where DeepSpeed is not installed (see ``_sharded.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _sharded import DEEPSPEED, NO_DEEPSPEED

from lightning_ampwatch import Finding

pytestmark = pytest.mark.skipif(not DEEPSPEED, reason=NO_DEEPSPEED)


def _fit(out_dir: str) -> None:
    """Run in a child process (DeepSpeed sets process-wide state): 2 ranks, NaN in row 67, rank 1's only."""
    import lightning.pytorch as pl
    from _sharded import RowsByRank, cpu_deepspeed
    from test_ddp import DumpDiagnoses

    from lightning_ampwatch import AmpWatch
    from lightning_ampwatch.scenarios import Regressor, regression_data

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_deepspeed(stage=2), precision="bf16-mixed", max_steps=6,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, callbacks=[watch, DumpDiagnoses(watch, out_dir)], use_distributed_sampler=False)
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=256, nan_rows=(67,))))


def test_deepspeed_starts_and_a_nan_on_rank_one_reaches_rank_zero(tmp_path: Path) -> None:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_sharded_deepspeed as t; "
            f"t._fit({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "internal error" not in done.stderr, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # rank 1 read the NaN in its own batch (row 67 is its batch 2) and judged alone ...
    assert [(d["finding"], d["step"]) for d in rank1][:1] == [(Finding.DATA_NONFINITE.value, 2)]
    # ... and rank zero, which prints and logs, reports it with the rank it came from
    relayed = [d for d in rank0 if d["evidence"].get("reported_from_rank") == 1]
    assert [(d["finding"], d["step"]) for d in relayed][:1] == [(Finding.DATA_NONFINITE.value, 2)]
    assert relayed[0]["evidence"]["nonfinite_where"] == rank1[0]["evidence"]["nonfinite_where"]
    lines = [json.loads(line) for line in (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()]
    assert any(line["finding"] == Finding.DATA_NONFINITE.value and line["step"] == 2 for line in lines)
    assert "DATA_NONFINITE" in done.stdout + done.stderr  # on rank zero's console
