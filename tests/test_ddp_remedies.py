"""Two CPU processes with gloo: a fault only one rank sees gets one remedy, applied alike on both ranks.

The remedy is decided on rank zero from the agreed diagnosis and broadcast, so a rank that never saw the fault
still changes its run the same way and the two keep training in step (same steps, same weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.remedies import ISLAND_ATTR
from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin
from test_trajectory_e2e import LrJump

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class DumpRankState(Callback):
    """Each rank writes what its AmpWatch concluded and did, and where its weights ended, for the parent."""

    def __init__(self, watch: AmpWatch, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = [p.detach().double() for p in pl_module.parameters()]
        state = {
            "diagnoses": [d.to_dict() for d in self.watch.diagnoses],
            "applied": [r.to_dict() for r in self.watch.applied],
            "island": pl_module.attention is not None and getattr(pl_module.attention, ISLAND_ATTR, None) is not None,
            "precision": trainer.precision_plugin.precision,
            "scaler": trainer.precision_plugin.scaler is not None,
            "global_step": trainer.global_step,
            "skipped": self.watch.machine.skipped_total,
            "weights_finite": all(bool(torch.isfinite(p).all()) for p in params),
            "lrs": [g["lr"] for opt in trainer.optimizers for g in opt.param_groups],
            "scheduler_steps": [c.scheduler.last_epoch for c in trainer.lr_scheduler_configs],
        }
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(state))
        torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()},
                   Path(self.out_dir, f"rank{trainer.global_rank}.pt"))


def _rows_scaled(odd: float, n: int = 256) -> TensorDataset:
    """Regression data whose odd rows are multiplied by ``odd`` (see :class:`RowsByRank`: rank 1's rows)."""
    x, y = regression_data(n=n).tensors
    x = x.clone()
    x[1::2] *= odd
    return TensorDataset(x, y)


class RowsByRank(pl.LightningDataModule):
    """Rank r trains on rows r, r+2, r+4, ... in order. Lightning's own sampler shuffles training data, so the
    test brings an unshuffled DistributedSampler, made in each process once the process group exists."""

    def __init__(self, data: TensorDataset) -> None:
        super().__init__()
        self.data = data

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16, sampler=DistributedSampler(self.data, shuffle=False))


def _fit_ddp(tmp_path: Path, model: pl.LightningModule, data: TensorDataset, max_steps: int,
             remediate: Any = True) -> tuple[list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
    watch = AmpWatch(verbose=False, remediate=remediate)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=max_steps, plugins=[true_fp16_plugin()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, DumpRankState(watch, str(tmp_path))],
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=RowsByRank(data))
    states = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    return states, weights


def _assert_in_step(states: list[dict[str, Any]], weights: list[dict[str, torch.Tensor]], max_steps: int) -> None:
    rank0, rank1 = states
    assert rank0["global_step"] == rank1["global_step"] == max_steps
    assert rank0["skipped"] == rank1["skipped"]
    assert rank0["weights_finite"] and rank1["weights_finite"]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), f"{name} differs between the ranks"


def _only_alarm(diagnoses: list[dict[str, Any]]) -> dict[str, Any]:
    alarms = [d for d in diagnoses if d["finding"] != Finding.NORMAL_SCALING.value]
    assert len(alarms) == 1, alarms
    return alarms[0]


def test_forward_overflow_on_rank_one_only_gets_the_same_fp32_island_on_both_ranks(tmp_path: Path) -> None:
    # odd rows x10: rank 1's attention scores pass exp()'s float16 limit, rank 0's stay far below it
    pl.seed_everything(0, verbose=False)
    max_steps = 8
    states, weights = _fit_ddp(tmp_path, Regressor(attention=True), _rows_scaled(10.0), max_steps)
    rank0, rank1 = states
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    assert rank0["applied"] == rank1["applied"], "both ranks must apply the same remedies"
    d = _only_alarm(rank0["diagnoses"])
    assert (d["finding"], d["location"], d["remedy"]) == (Finding.FORWARD_OVERFLOW.value, "attention", "fp32_island")
    assert d["evidence"]["fault_ranks"] == [1]
    assert d["evidence"]["investigated_on_rank"] == 1
    assert d["evidence"]["remedy_details"] == {"module": "attention"}
    assert [(a["name"], a["finding"], a["details"]) for a in rank0["applied"]] == \
        [("fp32_island", Finding.FORWARD_OVERFLOW.value, {"module": "attention"})]
    assert rank0["island"] and rank1["island"], "rank 0 never overflowed but must run the island too"
    assert rank0["skipped"] == 1  # the overflowing step only: the island holds on every later step
    _assert_in_step(states, weights, max_steps)


def test_input_range_on_rank_one_only_switches_both_ranks_to_bf16(tmp_path: Path) -> None:
    # odd rows x1e5: past float16's range on rank 1 as soon as autocast casts them; rank 0's rows are ordinary
    pl.seed_everything(0, verbose=False)
    max_steps = 8
    states, weights = _fit_ddp(tmp_path, Regressor(lr=1e-3, optimizer="adam"), _rows_scaled(1e5), max_steps)
    rank0, rank1 = states
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    assert rank0["applied"] == rank1["applied"], "both ranks must apply the same remedies"
    d = _only_alarm(rank0["diagnoses"])
    assert (d["finding"], d["remedy"]) == (Finding.INPUT_RANGE.value, "bf16_fallback")
    assert d["evidence"]["fault_ranks"] == [1]
    assert d["evidence"]["remedy_details"] == {"precision_before": "16-mixed", "precision_after": "bf16-mixed"}
    assert [a["name"] for a in rank0["applied"]] == ["bf16_fallback"]
    for state in states:
        assert (state["precision"], state["scaler"]) == ("bf16-mixed", False)
    _assert_in_step(states, weights, max_steps)


def test_reduce_lr_after_an_lr_jump_holds_the_same_ceiling_on_both_ranks(tmp_path: Path) -> None:
    # the LR jumps 100x at scheduler step 20 on both ranks; after the rollback each rank holds its LR at or under the
    # one before the jump (a stand-in on its own module), so both re-run the jump at 0.03 and stay in step
    pl.seed_everything(0, verbose=False)
    max_steps = 50
    states, weights = _fit_ddp(tmp_path, LrJump(), regression_data(n=512), max_steps, remediate=["reduce_lr"])
    rank0, rank1 = states
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    assert rank0["applied"] == rank1["applied"], "both ranks must apply the same remedies"
    d = _only_alarm(rank0["diagnoses"])
    assert (d["finding"], d["remedy"]) == (Finding.LR_SCHEDULE.value, "reduce_lr")
    assert d["evidence"]["rollback"].startswith("rolled back from step ")
    details = d["evidence"]["remedy_details"]
    assert details["factor"] == 1.0 and details["ceiling"] == [pytest.approx(3e-2)]
    for state in states:  # the schedule came to its jump again after the rollback, and was held on each rank
        assert state["scheduler_steps"][0] >= 20 and state["lrs"] == [pytest.approx(3e-2)]
    _assert_in_step(states, weights, max_steps)
