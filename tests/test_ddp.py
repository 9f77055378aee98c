"""Two CPU processes with gloo: a fault on one rank is reported identically on both."""

from __future__ import annotations

import atexit
import json
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin
from _limits import HANG_S

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class DumpDiagnoses(Callback):
    """Each rank writes what its AmpWatch concluded, so the parent process can compare the ranks."""

    def __init__(self, watch: AmpWatch, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = Path(self.out_dir) / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps([d.to_dict() for d in self.watch.diagnoses]))


def _end_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class EndProcessGroupAtExit(Callback):
    """A ``ddp_spawn`` worker ends its process group before the interpreter shuts down.

    Lightning leaves the group alive when the fit returns, and a spawned worker then exits through interpreter
    finalization, where gloo's threads can abort the process ("terminate called without an active exception",
    SIGABRT). Measured here on two-rank ``ddp_spawn`` fits: 2 of 14 with a plain callback in AmpWatch's place, 1 of
    12 with AmpWatch, 0 of 20 with AmpWatch and this callback. A forked worker leaves through ``os._exit`` and never
    meets it."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        atexit.register(_end_process_group)  # runs in the worker, while the interpreter is still whole


class RowsByRank(pl.LightningDataModule):
    """Rank r trains on rows r, r+2, r+4, ... in order (Lightning's own sampler would shuffle training data)."""

    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16, sampler=DistributedSampler(self.data, shuffle=False))


def _fit_ddp(tmp_path: Path, nan_rows: tuple[int, ...], max_steps: int = 6) -> list[list[dict[str, Any]]]:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=max_steps, plugins=[true_fp16_plugin()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, DumpDiagnoses(watch, str(tmp_path))],
        use_distributed_sampler=False,
    )
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=256, nan_rows=nan_rows)))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_nan_on_rank_one_only_is_reported_the_same_on_both_ranks(tmp_path: Path) -> None:
    # row 67 is rank 1's 34th row: its batch 2 (batch size 16), row 1 within it; rank 0 never sees it
    rank0, rank1 = _fit_ddp(tmp_path, nan_rows=(67,))
    assert rank0 == rank1, "both ranks must reach the same diagnoses"
    alarms = [d for d in rank0 if d["finding"] != Finding.NORMAL_SCALING.value]
    assert [d["finding"] for d in alarms] == [Finding.DATA_NONFINITE.value]
    d = alarms[0]
    assert d["evidence"]["fault_ranks"] == [1]
    assert d["evidence"]["investigated_on_rank"] == 1
    assert d["step"] == 2
    assert d["evidence"]["nonfinite_where"] == "rank 1: batch[0] rows [1]"
    assert d["evidence"]["fp32_control_loss"] == "nan"
    # rank zero alone writes the event log, with the agreed diagnosis
    lines = (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()
    assert [json.loads(line)["finding"] for line in lines] == [d["finding"] for d in rank0]


def _fit_ddp_without_scaler(precision: str, out_dir: str) -> None:
    """Run in a child process (the parent enforces the time limit): 2 ranks, no GradScaler, NaN on rank 1 only."""
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=6, precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, callbacks=[watch, DumpDiagnoses(watch, out_dir)], use_distributed_sampler=False,
    )
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=256, nan_rows=(67,))))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_without_a_scaler_a_nan_on_one_rank_does_not_hang_the_run(tmp_path: Path, precision: str) -> None:
    # Without a scaler the ranks meet the NaN at different steps; a collective entered by one rank alone would
    # wait for ever. The child process must finish well inside the limit (alone it takes a few seconds).
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_ddp; "
            f"test_ddp._fit_ddp_without_scaler({precision!r}, {str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # rank 1 read the NaN in its own batch; rank 0 met it one step later, through the averaged gradients
    assert rank1 and rank1[0]["finding"] == Finding.DATA_NONFINITE.value and rank1[0]["step"] == 2
    assert rank0 and rank0[0]["step"] >= 2


def test_ddp_spawn_brings_the_diagnoses_back_to_the_main_process(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_steps=4, plugins=[true_fp16_plugin()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, EndProcessGroupAtExit()], use_distributed_sampler=False,
    )
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=256, nan_rows=(67,))))
    assert [d.finding for d in watch.diagnoses] == [Finding.DATA_NONFINITE]
    assert watch.diagnoses[0].evidence["fault_ranks"] == [1]


def test_the_trajectory_control_runs_on_every_rank_and_the_ranks_agree(tmp_path: Path) -> None:
    from test_trajectory import ExpSoftmax, separable

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=16, plugins=[true_fp16_plugin(init_scale=2.0**8)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, DumpDiagnoses(watch, str(tmp_path))],
        use_distributed_sampler=False,
    )
    trainer.fit(ExpSoftmax(), datamodule=RowsByRank(separable(n=512)))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0 == rank1, "both ranks must reach the same diagnoses"
    d = next(d for d in rank0 if d["finding"] != Finding.NORMAL_SCALING.value)
    assert d["evidence"]["control_verdict"].endswith(": an AMP fault")
    assert "trajectory_fp32_losses" in d["evidence"]


class DumpWeights(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import torch

        torch.save(pl_module.state_dict(), Path(self.out_dir) / f"weights{trainer.global_rank}.pt")


def test_a_rollback_and_its_remedy_leave_the_ranks_with_equal_weights(tmp_path: Path) -> None:
    import torch
    from test_recovery_e2e import Classifier
    from test_trajectory import separable

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=True, snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=30, plugins=[true_fp16_plugin(init_scale=2.0**8)],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[watch, DumpDiagnoses(watch, str(tmp_path)), DumpWeights(str(tmp_path))],
        use_distributed_sampler=False,
    )
    trainer.fit(Classifier(), datamodule=RowsByRank(separable(n=1024)))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0 == rank1
    [d] = [d for d in rank0 if d["remedy"]]
    assert d["evidence"]["rollback"].startswith("rolled back from step ") and d["outcome"] == "recovered"
    w0, w1 = (torch.load(tmp_path / f"weights{r}.pt") for r in range(2))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def _fit_bf16_nan_on_rank_one(out_dir: str) -> None:
    """Run in a child process: 2 ranks, bf16-mixed (no GradScaler: each rank judges alone), NaN in rank 1's data at
    step 2, the trajectory control's snapshots on, the console panels on (rank zero's)."""
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=True, snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=6, precision="bf16-mixed", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, callbacks=[watch, DumpDiagnoses(watch, out_dir)], use_distributed_sampler=False,
    )
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=256, nan_rows=(67,))))


@pytest.fixture(scope="module")
def bf16_nan_on_rank_one(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, list[list[dict[str, Any]]]]:
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("bf16_nan_on_rank_one")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_ddp; "
            f"test_ddp._fit_bf16_nan_on_rank_one({str(out)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_trajectory_replay_one_rank_would_make_alone_under_ddp_concludes_nothing(bf16_nan_on_rank_one: Any) -> None:
    _, (rank0, rank1) = bf16_nan_on_rank_one
    # rank 0's weights went NaN through the all-reduce of rank 1's gradients; a replay on rank 0 alone has no
    # all-reduce, stays finite, and would have called the fault a transient one (NOT_REPRODUCED). Nor does rank 0
    # publish what it judged alone at step 3: the ranks compare their lone alarms, and the fault is rank 1's
    for published in (rank0, rank1):
        assert not any(d["finding"] == Finding.NOT_REPRODUCED.value for d in published)
        assert [(d["finding"], d["step"]) for d in published if d["finding"] != "NORMAL_SCALING"] == [
            (Finding.DATA_NONFINITE.value, 2)]
    [d] = [d for d in rank0 if d["finding"] != "NORMAL_SCALING"]
    assert "trajectory_verdict" not in d["evidence"]
    assert d["evidence"]["reached_ranks"].startswith("through the gradient reduction: rank 0 at step 3")


def test_a_diagnosis_relayed_from_another_rank_names_the_rank_where_the_rows_are(bf16_nan_on_rank_one: Any) -> None:
    done, (rank0, rank1) = bf16_nan_on_rank_one
    [relayed] = [d for d in rank0 if d["evidence"].get("reported_from_rank") == 1]
    assert relayed["finding"] == Finding.DATA_NONFINITE.value and relayed["step"] == 2
    # as under a scaler, where the ranks see the step together: the rows named with their rank
    assert relayed["evidence"]["nonfinite_where"] == "rank 1: batch[0] rows [1]"
    assert "(rank 1: batch[0] rows [1])" in relayed["advice"]
    # rank 1 publishes the same record, named with its rank as every rank names it
    assert [d for d in rank1 if d["finding"] != "NORMAL_SCALING"] == [relayed]
    # rank zero's panel: the rank in its title, the row and the advice
    assert "DATA_NONFINITE at step 2 on rank 1" in done.stdout
    # the compact panel's plain label for nonfinite_where (the event log keeps the key)
    assert re.search(r"non-finite values in the batch +rank 1: batch\[0\] rows \[1\]", done.stdout)
    assert "Fix: Clean the data before it reaches the model (rank 1: batch[0] rows [1])" in done.stdout


def test_a_start_up_overflow_judged_on_the_clean_step_after_it_is_published_the_same_on_both_ranks(
        tmp_path: Path) -> None:
    """The start-up streak's alarm is raised on the clean step that ends it, where each rank knows only itself as the
    rank at fault: each judged the trajectory replays by its own (each rank replays its own batches, so their skips
    differ) and published different evidence (a fresh run: raw sensor features, tests/_user_models.py)."""
    import _user_models as um

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=12, plugins=[true_fp16_plugin()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, DumpDiagnoses(watch, str(tmp_path))],
        use_distributed_sampler=False,
    )
    trainer.fit(um.RawFeatures(steps=12), datamodule=RowsByRank(um.raw_features(n_batches=24, batch_size=32).dataset))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    startup = next(d for d in rank0 if d["finding"] == Finding.GRADIENT_OVERFLOW.value)
    assert startup["step"] == 0 and startup["evidence"]["trajectory_rank"] == 0 and "tried" in startup["evidence"]
    assert rank0 == rank1, "both ranks must publish the same diagnoses"
