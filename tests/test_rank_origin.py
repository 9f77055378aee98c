"""Two CPU processes with gloo, no GradScaler (bf16-mixed): a NaN in one batch of rank 1 only reaches rank 0 through
the gradient all-reduce, one step later. Every rank publishes rank 1's finding (DATA_NONFINITE, its batch and rows,
at its step), and only that one: one fault, one finding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin
from _limits import HANG_S
from test_ddp import DumpDiagnoses, EndProcessGroupAtExit  # each rank writes the diagnoses its AmpWatch published

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")



def fit(strategy: str, precision: str, out_dir: str, log_every: int) -> None:
    """In a child process: 2 ranks, rank r reads rows r, r+2, ... in order; row 67 (rank 1's batch 2, row 1) NaN."""
    from test_ddp import RowsByRank

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=True)
    kwargs: dict[str, Any] = ({"plugins": [true_fp16_plugin()]} if precision == "fp16" else {"precision": precision})
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=8, logger=False, log_every_n_steps=log_every,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
        callbacks=[watch, DumpDiagnoses(watch, out_dir), EndProcessGroupAtExit()], use_distributed_sampler=False,
        **kwargs,
    )
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=256, nan_rows=(67,))))


def _run(tmp_path: Path, strategy: str, precision: str, log_every: int = 50) -> tuple[str, list[list[dict[str, Any]]]]:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_rank_origin as t; "
            f"t.fit({strategy!r}, {precision!r}, {str(tmp_path)!r}, {log_every})")
    if strategy == "ddp_spawn":  # the spawned workers import the model from here
        code = "if __name__ == '__main__':\n    " + code
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _alarms(diagnoses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in diagnoses if d["finding"] != Finding.NORMAL_SCALING.value]


@pytest.mark.parametrize("strategy,log_every", [("ddp_fork", 50), ("ddp_fork", 2), ("ddp_spawn", 50)])
def test_a_nan_that_reaches_rank_zero_through_the_all_reduce_is_rank_ones_finding_on_every_rank(
        tmp_path: Path, strategy: str, log_every: int) -> None:
    stdout, (rank0, rank1) = _run(tmp_path, strategy, "bf16-mixed", log_every)
    alarms0, alarms1 = _alarms(rank0), _alarms(rank1)
    assert alarms0 == alarms1, "both ranks must publish the same findings"
    [d] = alarms0  # one fault, one finding: no FORWARD_OVERFLOW for the step the all-reduce carried it to rank 0
    assert d["finding"] == Finding.DATA_NONFINITE.value and d["step"] == 2
    assert d["evidence"]["fault_ranks"] == [1] and d["evidence"]["reported_from_rank"] == 1
    assert d["evidence"]["nonfinite_where"] == "rank 1: batch[0] rows [1]"
    assert "(rank 1: batch[0] rows [1])" in d["advice"]
    assert d["evidence"]["reached_ranks"].startswith("through the gradient reduction: rank 0 at step 3")
    # rank zero's console: one panel, rank 1's; none for what rank 0 judged alone
    assert "DATA_NONFINITE at step 2 on rank 1" in stdout and "FORWARD_OVERFLOW at step" not in stdout


def test_under_a_scaler_the_ranks_already_see_the_step_together(tmp_path: Path) -> None:
    _, (rank0, rank1) = _run(tmp_path, "ddp_fork", "fp16")
    assert _alarms(rank0) == _alarms(rank1)
    [d] = _alarms(rank0)
    assert d["finding"] == Finding.DATA_NONFINITE.value and d["step"] == 2 and d["evidence"]["fault_ranks"] == [1]
    assert d["evidence"]["nonfinite_where"] == "rank 1: batch[0] rows [1]"


def test_a_finite_divergence_one_rank_found_alone_is_published_alike_on_every_rank(tmp_path: Path) -> None:
    # under a scaler, rank 1's own losses climb (finite) while rank 0's stay: judged from rank 1's losses alone, and
    # published by every rank alike (before, rank 1 published it and rank 0 relayed it, and neither list matched)
    from test_collective_safety import _child, _ranks

    done = _child("_fit_divergence_on_rank1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    alarms0, alarms1 = _alarms(rank0["diagnoses"]), _alarms(rank1["diagnoses"])
    assert alarms0 == alarms1 and alarms0
    d = next(d for d in alarms0 if d["evidence"].get("pattern") == "finite_divergence")
    assert d["evidence"]["fault_ranks"] == [1] and d["evidence"]["reported_from_rank"] == 1
    # the alarm every rank met together (the skips) is named from what every rank saw, not from rank 1's climb
    overflow = next(d for d in alarms0 if d["finding"] == Finding.GRADIENT_OVERFLOW.value)
    assert "diverged_first" not in overflow["evidence"] and overflow["evidence"]["fault_ranks"] == [0, 1]
