"""The ranks' one protocol under DDP, two CPU processes with gloo, real float16 autocast and a real GradScaler.

Each run is made in a child process under a time limit: a rank left waiting in a collective that another rank
never enters fails the test instead of blocking it (gloo waits 30 minutes, NCCL for ever)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _limits import HANG_S
from _sharded import RowsByRank, SnapshotBytes
from torch import nn
from torch.utils.data import TensorDataset

from lightning_ampwatch import AmpWatch, Finding

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

HERE = Path(__file__).parent


def _child(function: str, out_dir: Path, timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    """``function(out_dir)`` in a child process of its own session, within ``timeout`` seconds: past it, the child
    and the rank it forked are killed (their stacks written first) and the test fails."""
    code = (f"import faulthandler, sys; faulthandler.dump_traceback_later({timeout - 5}, exit=False); "
            f"sys.path.insert(0, {str(HERE)!r}); import test_ddp_protocol as t; t.{function}({str(out_dir)!r})")
    return run_bounded([sys.executable, "-c", code], timeout)


def run_bounded(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``command`` in a session of its own; past ``timeout`` every process in it is killed (a forked rank left
    waiting in a collective included) and the test fails with what they wrote."""
    import os
    import signal

    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGUSR1)  # where each process waits (faulthandler, where it is registered)
            try:
                out, err = child.communicate(timeout=3)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
            pytest.fail(f"the run did not end within {timeout} s (a rank waits in a collective):\n{err[-4000:]}")
    return subprocess.CompletedProcess(command, child.returncode, out, err)


class Softmax(pl.LightningModule):
    """Two layers and a hand-written softmax: ``exp`` of the raw logits overflows float16 past ~11, not float32."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        e = self.head(self.body(x)).exp()
        p = e / e.sum(-1, keepdim=True)
        return -p.gather(1, y[:, None]).float().log().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def overflows_on_both_ranks(batches: tuple[int, ...], factor: float = 200.0, n: int = 1024) -> TensorDataset:
    """Separable rows; in each of ``batches`` (batch size 16, rows alternating between 2 ranks) the first row of
    both ranks is scaled so that its logits' exp overflows float16 but not float32."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)
    for b in batches:
        x[32 * b] *= factor
        x[32 * b + 1] *= factor
    return TensorDataset(x, y)


class Dump(SnapshotBytes):
    """Each rank writes its diagnoses, step count, the bytes its snapshots held and its final weights."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = {"diagnoses": [d.to_dict() for d in self.watch.diagnoses], "steps": trainer.global_step,
               "bytes": sorted(self.snapshot_bytes)}
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   Path(self.out_dir, f"rank{trainer.global_rank}.pt"))


def _ranks(out_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def replicated_bytes(module: nn.Module) -> int:
    """The state every DDP rank holds alike: the weights and AdamW's two moments and step count per parameter."""
    trained = [p for p in module.parameters() if p.requires_grad]
    return 3 * sum(p.nbytes for p in trained) + 4 * len(trained)


def _fit_split_snapshot_overflow_on_both_ranks(out_dir: str) -> None:
    """DDP, float16 with a GradScaler: a forward overflow on both ranks at steps 13-15, a snapshot every 5 steps
    and a budget of about 0.55x the replicated state plus 5 batches, so that each rank keeps its half of a split
    snapshot (the whole one would not fit)."""
    from lightning_ampwatch.scenarios import true_fp16_plugin

    pl.seed_everything(0, verbose=False)
    module = Softmax()
    batch_bytes = 16 * 8 * 4 + 16 * 8  # x float32, y int64
    budget = int(0.55 * replicated_bytes(module)) + 5 * batch_bytes
    watch = AmpWatch(verbose=False, snapshot_every=5, snapshot_budget=budget)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=20, plugins=[true_fp16_plugin(init_scale=2.0**8)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, use_distributed_sampler=False, callbacks=[watch, Dump(watch, out_dir)])
    trainer.fit(module, datamodule=RowsByRank(overflows_on_both_ranks((13, 14, 15))))


def test_a_split_snapshot_under_ddp_with_an_overflow_on_both_ranks_ends_and_the_ranks_agree(tmp_path: Path) -> None:
    done = _child("_fit_split_snapshot_overflow_on_both_ranks", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 20
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    # each rank kept its half of a split snapshot (the whole would not have fitted the budget)
    assert rank0["bytes"] and rank1["bytes"]
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"]) == (Finding.FORWARD_OVERFLOW.value, 13)
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"


class FailsToReadStateOnRank1(Softmax):
    """A user's state-dict hook that fails on rank 1, the real way, once the trajectory control has begun replaying
    (its ``training_step`` runs an older batch again): on the second read of the module's state after that, which is
    the live state the second replay (at the run's precision) copies before it restores the split snapshot. Rank 0
    goes on into that restore, whose broadcasts need rank 1."""

    def __init__(self) -> None:
        super().__init__()
        self.latest = -1
        self.replaying = False
        self.reads = 0
        self._register_state_dict_hook(self._read)

    def _read(self, *args: Any) -> None:
        if self.replaying and self.global_rank == 1:
            self.reads += 1
            if self.reads == 2:
                raise RuntimeError("the state cannot be read now")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx < self.latest:
            self.replaying = True
        self.latest = max(self.latest, batch_idx)
        return super().training_step(batch, batch_idx)


def _fit_replay_fails_before_its_restore_on_rank1(out_dir: str) -> None:
    from lightning_ampwatch.scenarios import true_fp16_plugin

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=16, plugins=[true_fp16_plugin(init_scale=2.0**8)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, use_distributed_sampler=False, callbacks=[watch, Dump(watch, out_dir)])
    trainer.fit(FailsToReadStateOnRank1(), datamodule=RowsByRank(overflows_on_both_ranks((13, 14, 15))))


def test_a_replay_that_fails_on_one_rank_before_its_split_restore_stops_every_rank_before_it(tmp_path: Path) -> None:
    # before the fix: rank 0 waited in the restore's broadcast while rank 1 waited in the next meeting's all_gather
    done = _child("_fit_replay_fails_before_its_restore_on_rank1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 16
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"]) == (Finding.FORWARD_OVERFLOW.value, 13)
    assert d["evidence"]["trajectory_control"] == (
        "failed: the trajectory replay failed: RuntimeError: the state cannot be read now")
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"
