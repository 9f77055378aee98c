"""DDP, two CPU processes with gloo, real float16 autocast and a real GradScaler: every rank holds the same state,
so each keeps half of each snapshot; a rollback puts the halves back together on both ranks, and the ranks go on
with equal weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _sharded import RowsByRank
from test_trajectory_e2e import LrJump

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import regression_data, true_fp16_plugin

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class Dump(pl.Callback):
    """Each rank writes its diagnoses, the bytes of the snapshots it held, and its final weights."""

    def __init__(self, watch: AmpWatch, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir
        self.snapshot_bytes: set[int] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        control = self.watch.watcher.trajectory
        if control is not None and control.ring.snapshots:
            self.snapshot_bytes.add(control.ring.snapshots[-1].nbytes)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trained = [p for p in pl_module.parameters() if p.requires_grad]
        out = {"diagnoses": [d.to_dict() for d in self.watch.diagnoses], "bytes": sorted(self.snapshot_bytes),
               "replicated": 3 * sum(p.nbytes for p in trained) + 4 * len(trained),  # weights, Adam, steps
               "global_step": trainer.global_step}
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   Path(self.out_dir, f"rank{trainer.global_rank}.pt"))


def test_ddp_ranks_each_hold_half_a_snapshot_and_a_rollback_restores_equal_weights(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=40, plugins=[true_fp16_plugin()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, Dump(watch, str(tmp_path))], use_distributed_sampler=False)
    trainer.fit(LrJump(), datamodule=RowsByRank(regression_data(n=1024)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["diagnoses"] == ranks[1]["diagnoses"]
    # each rank's snapshot holds about half of the replicated state (plus its scaler's two numbers); together all
    replicated = ranks[0]["replicated"]
    [b0], [b1] = ranks[0]["bytes"], ranks[1]["bytes"]
    assert b0 + b1 == replicated + 2 * 8
    assert max(b0, b1) <= 0.6 * replicated
    d = next(d for d in ranks[0]["diagnoses"] if d.get("remedy") == "reduce_lr")
    assert d["finding"] == Finding.LR_SCHEDULE.value
    assert "the in-memory snapshot taken after step" in d["evidence"]["rollback"]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 40
    for name in weights[0]:  # rolled back from halves, trained on alike: the ranks stay equal
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"
        assert torch.isfinite(weights[0][name]).all()
