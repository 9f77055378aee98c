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
from _sharded import RowsByRank, SnapshotBytes
from test_trajectory_e2e import LrJump

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import regression_data, true_fp16_plugin
from _limits import HANG_S

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class Dump(SnapshotBytes):
    """Each rank writes its diagnoses, the bytes of the snapshots it held, and its final weights."""

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


class SwitchOffOnRank1(pl.Callback):
    """After step ``at`` on rank 1 only, AmpWatch's own failure containment meets its limit of distinct internal
    failures (the real path: ``internal_failure``), and the watch switches itself off on that rank alone."""

    def __init__(self, watch: AmpWatch, at: int) -> None:
        self.watch, self.at = watch, at

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == 1 and batch_idx == self.at:
            for i in range(5):
                self.watch.watcher.internal_failure(f"part {i}", RuntimeError("made to fail"))


def _fit_switched_off(out_dir: str) -> None:
    """Run in a child process (the parent enforces the time limit): DDP, bf16 (no scaler), a NaN on rank 1's data
    at step 2, after which rank 1's watch switches itself off; log steps every 3 steps, each with the cross-rank
    non-finite sum, and the relay's last exchange at the end."""
    from test_ddp import DumpDiagnoses

    from lightning_ampwatch.scenarios import regression_data

    class Linear(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    class Steps(pl.Callback):
        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            Path(out_dir, f"steps{trainer.global_rank}").write_text(str(trainer.global_step))

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", precision="bf16-mixed", max_steps=9,
        log_every_n_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[watch, SwitchOffOnRank1(watch, at=2), DumpDiagnoses(watch, out_dir), Steps()])
    trainer.fit(Linear(), datamodule=RowsByRank(regression_data(n=512, nan_rows=(67,))))


def test_a_rank_whose_watch_switched_itself_off_still_meets_the_others_and_rank_zero_hears_of_its_fault(
        tmp_path: Path) -> None:
    # Rank 0 keeps watching: at each log step it sums the non-finite count across the ranks, and at the end the
    # ranks exchange what they judged alone. A switched-off rank that stayed away from either would leave rank 0
    # waiting (gloo aborts on the mismatch, NCCL hangs). The child must finish well inside the limit.
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_sharded_ddp as t; "
            f"t._fit_switched_off({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "switches itself off" in done.stderr
    assert [(tmp_path / f"steps{r}").read_text() for r in range(2)] == ["9", "9"]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    d = next(d for d in rank1 if d["finding"] == Finding.DATA_NONFINITE.value)
    assert d["step"] == 2
    # rank 1 judged it alone, then switched off before any log step: rank zero hears of it at the end
    assert any(r["evidence"].get("reported_from_rank") == 1 and r["step"] == 2 and
               r["finding"] == Finding.DATA_NONFINITE.value for r in rank0)
