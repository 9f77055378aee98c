"""DeepSpeed (ZeRO stage 2) in two CPU processes: in bf16 AmpWatch starts, and a NaN in rank 1's data reaches rank
zero's report; in real fp16 (``_sharded.deepspeed_fp16_on_cpu``) AmpWatch reads DeepSpeed's own loss scaler. Skipped,
with the reason, where DeepSpeed is not installed (see ``_sharded.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from _sharded import DEEPSPEED, NO_DEEPSPEED

from lightning_ampwatch import Finding
from lightning_ampwatch.deepspeed_state import NOT_UNDER_DEEPSPEED
from lightning_ampwatch.summary import RunStats
from _limits import HANG_S

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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "internal error" not in done.stderr, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # rank 1 read the NaN in its own batch (row 67 is its batch 2) and judged alone ...
    assert [(d["finding"], d["step"]) for d in rank1][:1] == [(Finding.DATA_NONFINITE.value, 2)]
    # ... and rank zero, which prints and logs, reports it with the rank it came from
    relayed = [d for d in rank0 if d["evidence"].get("reported_from_rank") == 1]
    assert [(d["finding"], d["step"]) for d in relayed][:1] == [(Finding.DATA_NONFINITE.value, 2)]
    # every rank names the rank where the rows are, as under a scaler, and publishes the same findings (the NaN
    # reached rank 0 only through the gradient reduction: no second finding of its own)
    assert relayed[0]["evidence"]["nonfinite_where"] == "rank 1: batch[0] rows [1]"
    alarms0, alarms1 = ([d for d in r if d["finding"] != "NORMAL_SCALING"] for r in (rank0, rank1))
    assert alarms0 == alarms1
    lines = [json.loads(line) for line in (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()]
    assert any(line["finding"] == Finding.DATA_NONFINITE.value and line["step"] == 2 for line in lines)
    assert "DATA_NONFINITE" in done.stdout + done.stderr  # on rank zero's console


# ------------------------------------------------------------------ fp16: DeepSpeed's own loss scaler


class ScaleLog(pl.Callback):
    """Each rank writes what its AmpWatch concluded and what DeepSpeed itself recorded: the loss scale each step ran
    with and set after it (its ZeRO optimizer's ``cur_scale``), its overflow flag and ``engine.skipped_steps``."""

    def __init__(self, watch: Any, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir
        self.steps: list[dict[str, Any]] = []
        self.before = 0.0
        self.losses: list[float] = []  # every micro-batch's loss as handed to backward

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.losses.append(float(loss))

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.before = float(trainer.optimizers[0].cur_scale)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        engine, opt = trainer.strategy.model, trainer.optimizers[0]
        self.steps.append({"ran_with": self.before, "after": float(opt.cur_scale), "overflow": bool(opt.overflow),
                           "skipped_steps": int(engine.skipped_steps)})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = RunStats.of_run(self.watch.watcher.machine, self.watch.watcher.ledger.mirror)
        out = {"diagnoses": [d.to_dict() for d in self.watch.diagnoses], "steps": stats.steps,
               "skipped": stats.skipped, "scale": stats.scale, "deepspeed": self.steps,
               "losses": self.losses, "run_steps": trainer.global_step,
               "step_losses": [loss for _, loss in sorted(self.watch.watcher.ledger.recent_losses)],
               "loss_scaler": type(trainer.optimizers[0].loss_scaler).__name__,
               "scale_window": trainer.optimizers[0].loss_scaler.scale_window,
               "scale_factor": trainer.optimizers[0].loss_scaler.scale_factor,
               "dtype": str(next(trainer.strategy.model.module.parameters()).dtype)}
        (Path(self.out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def _fit_fp16(out_dir: str, initial_scale_power: int, max_steps: int, big_row: int | None = None, stage: int = 2,
              loss_scale_window: int = 1000, accumulate: int = 1, **watch_kw: Any) -> None:
    """Run in a child process: DeepSpeed ZeRO-2 in real fp16 (its own dynamic loss scaler, hysteresis 1), 2 ranks."""
    from _sharded import RowsByRank, cpu_deepspeed, deepspeed_fp16_on_cpu

    from lightning_ampwatch import AmpWatch
    from lightning_ampwatch.scenarios import Regressor, regression_data

    deepspeed_fp16_on_cpu()
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=True, **watch_kw)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, precision="16-mixed", max_steps=max_steps, accumulate_grad_batches=accumulate,
        strategy=cpu_deepspeed(stage=stage, initial_scale_power=initial_scale_power, hysteresis=1,
                               loss_scale_window=loss_scale_window),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, callbacks=[watch, ScaleLog(watch, out_dir)], use_distributed_sampler=False)
    data = regression_data(n=512)
    if big_row is not None:  # one row whose activations overflow float16 (its batch's loss is inf)
        data.tensors[0][big_row] *= 3e4
    trainer.fit(Regressor(), datamodule=RowsByRank(data))


def _run_fp16(tmp_path: Path, initial_scale_power: int, max_steps: int,
              **kwargs: Any) -> tuple[list[dict[str, Any]], str]:
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_sharded_deepspeed as t; "
            f"t._fit_fp16({str(tmp_path)!r}, {initial_scale_power}, {max_steps}, **{kwargs!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "internal error" not in done.stderr, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:  # DeepSpeed's real fp16 path ran: its module in float16, its dynamic loss scaler
        assert rank["dtype"] == "torch.float16" and rank["loss_scaler"] == "DynamicLossScaler"
    return ranks, done.stdout + done.stderr


def test_deepspeed_fp16_a_start_up_overflow_is_read_from_its_own_loss_scaler(tmp_path: Path) -> None:
    """The Regressor's gradients overflow float16 at loss scales above 2**15: from 2**20 DeepSpeed skips five steps
    in a row, halving its scale each time. AmpWatch reads that from DeepSpeed's scaler (no GradScaler exists)."""
    (rank0, rank1), console = _run_fp16(tmp_path, initial_scale_power=20, max_steps=8)
    ds = rank0["deepspeed"]
    skipped = [i for i, s in enumerate(ds) if s["overflow"]]
    assert skipped == [0, 1, 2, 3, 4] and ds[-1]["skipped_steps"] == 5  # the real overflows, as DeepSpeed saw them
    assert rank0["diagnoses"] == rank1["diagnoses"]  # DeepSpeed agrees the overflow across the ranks: so do we
    alarm = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (alarm["finding"], alarm["step"]) == (Finding.GRADIENT_OVERFLOW.value, 0)
    ev = alarm["evidence"]
    assert ev["pattern"] == "startup" and ev["skipped_in_row"] == 5
    # the scale readings are DeepSpeed's: the scales the skipped steps ran with, and the one that held
    assert ev["scale_history"] == [s["ran_with"] for s in ds[:5]] == [2.0**20, 2.0**19, 2.0**18, 2.0**17, 2.0**16]
    assert ev["init_scale"] == 2.0**20 and ev["safe_scale"] == ds[5]["ran_with"] == 2.0**15
    # the advice speaks of DeepSpeed's setting, not of a GradScaler the run does not have
    assert ev["loss_scaler"] == "deepspeed" and '"initial_scale_power": 15' in alarm["advice"]
    assert "GradScaler" not in alarm["advice"]
    # DeepSpeed casts the module to float16 (its float32 masters are its optimizer's): no FP32 control pretends
    assert ev["fp32_control"].startswith("not run: DeepSpeed keeps the module's parameters in float16")
    # no false recipe alarms: DeepSpeed fp16 has neither autocast nor a GradScaler to misuse
    assert [d["finding"] for d in rank0["diagnoses"]] == [Finding.GRADIENT_OVERFLOW.value]
    for rank in (rank0, rank1):  # every step and every skip counted as DeepSpeed made them
        assert rank["steps"] == 8 and rank["skipped"] == rank["deepspeed"][-1]["skipped_steps"] == 5
        assert rank["scale"] == rank["deepspeed"][-1]["after"]
    assert "GRADIENT_OVERFLOW" in console


def test_deepspeed_zero3_fp16_a_start_up_overflow_is_named_and_no_replay_breaks_the_engine(tmp_path: Path) -> None:
    """Under ZeRO stage 3 a replay's backward would run the engine's gradient partitioning hooks into the live
    step's buckets (DeepSpeed then fails its next backward): the batch is not replayed, the evidence says why, and
    the run goes on."""
    (rank0, rank1), _ = _run_fp16(tmp_path, initial_scale_power=20, max_steps=6, stage=3)
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"], d["evidence"]["pattern"]) == (Finding.GRADIENT_OVERFLOW.value, 0, "startup")
    assert d["evidence"]["scale_history"] == [s["ran_with"] for s in rank0["deepspeed"][:5]]
    assert d["evidence"]["replay"].startswith("not run: under DeepSpeed ZeRO stage 3")
    assert d["evidence"]["trajectory_control"].startswith("not run: the trajectory control is not available under "
                                                          "this DeepSpeed engine")
    for rank in (rank0, rank1):
        assert rank["steps"] == 6 and rank["skipped"] == rank["deepspeed"][-1]["skipped_steps"] == 5


def test_deepspeed_fp16_lower_init_scale_sets_deepspeed_s_own_scale(tmp_path: Path) -> None:
    """With ``lower_init_scale`` allowed the start-up streak is judged at its fourth skip, and the remedy sets
    DeepSpeed's scale at once to the scale measured safe from the replay's gradients, instead of letting the
    scaler halve its way down."""
    (rank0, rank1), _ = _run_fp16(tmp_path, initial_scale_power=20, max_steps=14, remediate=["lower_init_scale"])
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d["remedy"] == "lower_init_scale")
    assert d["finding"] == Finding.GRADIENT_OVERFLOW.value
    # 8 clean steps after it; the outcome stays unverified (not claimed): there was no healthy loss level before
    # the episode, and the FP32 replay that could give one does not run under DeepSpeed
    assert d["evidence"]["recovery"]["skipped"] == 0 and d["evidence"]["recovery"]["steps"] == 8
    assert d["outcome"] == "not_verified"
    details = d["evidence"]["remedy_details"]
    ds = rank0["deepspeed"]
    assert [i for i, s in enumerate(ds) if s["overflow"]] == [0, 1, 2, 3]  # the fifth skip is saved
    assert details["scale_before"] == 2.0**16  # where DeepSpeed's scaler had halved to after the fourth skip
    # DeepSpeed's own scaler now runs at the measured scale, and waits 4x longer before it grows
    assert details["scale_after"] == ds[4]["ran_with"] == ds[-1]["after"] <= 2.0**15
    assert (details["growth_interval_before"], details["growth_interval_after"]) == (1000, 4000)
    for rank in (rank0, rank1):
        assert rank["steps"] == 14 and rank["skipped"] == rank["deepspeed"][-1]["skipped_steps"] == 4


def test_deepspeed_fp16_a_remedy_that_cannot_act_under_deepspeed_says_why(tmp_path: Path) -> None:
    """A row of rank 1's batch 5 overflows float16 in the forward: both ranks name it INPUT_RANGE (DeepSpeed agrees
    the overflow across the ranks). Its remedy, a switch to bf16, cannot be made to a DeepSpeed engine mid-run:
    the diagnosis says so rather than swap Lightning's precision plugin under an engine still in fp16."""
    (rank0, rank1), _ = _run_fp16(tmp_path, initial_scale_power=12, max_steps=10, big_row=16 * 2 * 5 + 1,
                                  remediate=["bf16_fallback"])
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"], d["remedy"]) == (Finding.INPUT_RANGE.value, 5, None)
    assert d["evidence"]["fault_ranks"] == [1]
    assert d["evidence"]["remedies_failed"] == ["bf16_fallback: " + NOT_UNDER_DEEPSPEED["bf16_fallback"]]
    for rank in (rank0, rank1):
        assert rank["steps"] == 10 and rank["skipped"] == rank["deepspeed"][-1]["skipped_steps"] == 1


def test_deepspeed_fp16_slow_growth_acts_on_deepspeed_s_window_and_factor(tmp_path: Path) -> None:
    """Gradients that overflow float16 above 2**15, and a loss scale window of 2: DeepSpeed's scaler keeps growing to
    2**16 and backing off. AmpWatch names the growth overflow from DeepSpeed's scale readings, and ``slow_growth``
    acts on DeepSpeed's own settings: the window 10x (at least 100), the factor 2 -> 1.5."""
    (rank0, rank1), _ = _run_fp16(tmp_path, initial_scale_power=15, max_steps=24, loss_scale_window=2,
                                  remediate=["slow_growth"])
    assert rank0["diagnoses"] == rank1["diagnoses"]
    ds = rank0["deepspeed"]
    grown = [i for i, s in enumerate(ds) if s["ran_with"] > 2.0**15]
    assert grown[:3] == [3, 7, 11] and all(ds[i]["overflow"] for i in grown)  # each growth overflowed
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["remedy"], d["outcome"]) == (Finding.GROWTH_OVERFLOW.value, "slow_growth", "recovered")
    ev = d["evidence"]
    assert ev["loss_scaler"] == "deepspeed" and '"loss_scale_window"' in d["advice"]
    # the replay overflowed at 2**16 too: nothing above the scale that held is called safe
    assert ev["replay_grads_finite"] is False and ev["safe_scale"] <= 2.0**15
    assert ev["remedy_details"] == {"growth_interval_before": 2, "growth_interval_after": 100,
                                    "growth_factor_before": 2.0, "growth_factor_after": 1.5}
    for rank in (rank0, rank1):  # DeepSpeed's own scaler has the new settings
        assert (rank["scale_window"], rank["scale_factor"]) == (100, 1.5)
        assert rank["steps"] == 24 and rank["skipped"] == rank["deepspeed"][-1]["skipped_steps"] == len(grown)


def test_deepspeed_fp16_under_gradient_accumulation_counts_deepspeed_s_steps(tmp_path: Path) -> None:
    """With ``accumulate_grad_batches=2`` Lightning hands DeepSpeed's engine every micro-batch, and the engine steps
    at every second one: AmpWatch counts those steps (asking the engine whether the coming step is a boundary), and a
    step's loss is its micro-batches' together."""
    (rank0, rank1), _ = _run_fp16(tmp_path, initial_scale_power=20, max_steps=6, accumulate=2)
    assert rank0["diagnoses"] == rank1["diagnoses"]
    ds = rank0["deepspeed"]  # one record per micro-batch
    assert len(ds) == 12 and [s["skipped_steps"] for s in ds[1::2]] == [1, 2, 3, 4, 5, 5]
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"], d["evidence"]["pattern"]) == (Finding.GRADIENT_OVERFLOW.value, 0, "startup")
    assert d["evidence"]["scale_history"] == [s["ran_with"] for s in ds[1:10:2]]
    # a step's loss is the sum of what its micro-batches handed to backward (Lightning divided each by 2)
    micro = rank0["losses"]
    assert rank0["step_losses"] == pytest.approx([micro[i] + micro[i + 1] for i in range(0, 12, 2)], rel=1e-3)
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 6 and rank["skipped"] == 5


def test_deepspeed_fp16_a_healthy_run_reports_nothing(tmp_path: Path) -> None:
    (rank0, rank1), _ = _run_fp16(tmp_path, initial_scale_power=12, max_steps=8)
    for rank in (rank0, rank1):
        assert not any(s["overflow"] for s in rank["deepspeed"])
        assert rank["diagnoses"] == [] and rank["steps"] == 8 and rank["skipped"] == 0
        assert rank["scale"] == 2.0**12


# ------------------------------------------------------------------ snapshots of ZeRO-2's partitioned state


def _fit_lr_jump(out_dir: str) -> None:
    """Run in a child process: an LR jump (100x at step 20) under DeepSpeed ZeRO-2 in real fp16, 2 ranks, with
    snapshots every 5 steps and ``reduce_lr``."""
    import torch
    from _sharded import RowsByRank, cpu_deepspeed, deepspeed_fp16_on_cpu
    from test_trajectory_e2e import LrJump

    from lightning_ampwatch import AmpWatch
    from lightning_ampwatch.scenarios import regression_data

    class Weights(ScaleLog):
        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            super().on_fit_end(trainer, pl_module)
            engine = trainer.strategy.model
            torch.save({"module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                        "fp32": [p.detach().clone() for p in engine.optimizer.single_partition_of_fp32_groups],
                        "bit16": [p.detach().clone() for p in engine.optimizer.parallel_partitioned_bit16_groups[0]],
                        "lr": [g["lr"] for g in trainer.optimizers[0].param_groups]},
                       Path(self.out_dir) / f"weights{trainer.global_rank}.pt")

    deepspeed_fp16_on_cpu()
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, precision="16-mixed", max_steps=40,
        strategy=cpu_deepspeed(stage=2, initial_scale_power=8, hysteresis=1),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, callbacks=[watch, Weights(watch, out_dir)], use_distributed_sampler=False)
    trainer.fit(LrJump(), datamodule=RowsByRank(regression_data(n=1024)))


def test_deepspeed_an_lr_jump_rolls_back_each_rank_s_partition_and_reduce_lr_recovers(tmp_path: Path) -> None:
    import torch

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_sharded_deepspeed as t; "
            f"t._fit_lr_jump({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "internal error" not in done.stderr, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d.get("remedy") == "reduce_lr")
    assert d["finding"] == Finding.LR_SCHEDULE.value and d["outcome"] == "recovered", d
    assert "the in-memory snapshot taken after step" in d["evidence"]["rollback"]
    for rank in (rank0, rank1):
        assert rank["steps"] == 40 and rank["skipped"] == rank["deepspeed"][-1]["skipped_steps"] > 0
        # DeepSpeed's loss scaler went back with the snapshot: it had halved on the episode's overflows, and it grows
        # only after 1000 clean steps, so only the restore brings it back to where it was after step 15
        ds = rank["deepspeed"]
        assert min(s["after"] for s in ds) < ds[15]["after"] == ds[-1]["after"] == 2.0**8
    weights = [torch.load(tmp_path / f"weights{r}.pt") for r in range(2)]
    for name, value in weights[0]["module"].items():  # the module's float16 weights: equal on both ranks
        assert torch.equal(value, weights[1]["module"][name]) and torch.isfinite(value).all(), name
    for w in weights:
        # each rank's float16 partition is its float32 master partition, rounded: made from it after the restore
        assert torch.equal(w["bit16"][0 if w is weights[0] else 1], w["fp32"][0].half())
        assert w["lr"][0] < 3.0  # the jumped LR, reduced


def _fit_snapshot_bf16(out_dir: str) -> None:
    """Run in a child process: DeepSpeed ZeRO-2 in bf16, 2 ranks, Adam. After step 2 each rank snapshots its
    partitioned state; after step 5 it puts the snapshot back. Each rank saves its state at both points, and just
    before the restore."""
    import torch
    from _sharded import RowsByRank, cpu_deepspeed

    from lightning_ampwatch.scenarios import Regressor, regression_data
    from lightning_ampwatch.trajectory.snapshot import Snapshot
    from lightning_ampwatch.trajectory.state import TrainState

    def state_of(trainer: pl.Trainer) -> dict[str, Any]:
        engine = trainer.strategy.model
        partitions = engine.optimizer.single_partition_of_fp32_groups
        inner = engine.optimizer.optimizer
        return {"module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
                "fp32": [p.detach().clone() for p in partitions],
                "adam": [{k: v.clone() for k, v in inner.state[p].items()} for p in partitions]}

    class SnapshotAndRestore(pl.Callback):
        def __init__(self) -> None:
            self.saved: dict[str, Any] = {}
            self.snapshot: Any = None

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if trainer.global_step == 3:
                self.snapshot = Snapshot.take(TrainState.from_trainer(trainer, pl_module), 2)
                self.saved["taken"] = state_of(trainer)
            elif trainer.global_step == 6:
                self.saved["before_restore"] = state_of(trainer)
                state = TrainState.from_trainer(trainer, pl_module)
                assert state.unavailable is None, state.unavailable
                self.snapshot.restore(state)
                self.saved["restored"] = state_of(trainer)
                self.saved["snapshot_bytes"] = self.snapshot.nbytes

        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.saved["end"] = state_of(trainer)
            torch.save(self.saved, Path(out_dir) / f"state{trainer.global_rank}.pt")

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_deepspeed(stage=2), precision="bf16-mixed", max_steps=8,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=out_dir, callbacks=[SnapshotAndRestore()], use_distributed_sampler=False)
    trainer.fit(Regressor(optimizer="adam", lr=1e-2), datamodule=RowsByRank(regression_data(n=256)))


def test_deepspeed_bf16_a_snapshot_of_zero2_s_partitions_is_put_back_whole_on_both_ranks(tmp_path: Path) -> None:
    import torch

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_sharded_deepspeed as t; "
            f"t._fit_snapshot_bf16({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"state{r}.pt") for r in range(2)]
    for saved in ranks:
        taken, before, restored = saved["taken"], saved["before_restore"], saved["restored"]
        # three steps moved every part of the state ...
        assert not torch.equal(taken["fp32"][0], before["fp32"][0])
        assert not torch.equal(taken["adam"][0]["exp_avg"], before["adam"][0]["exp_avg"])
        assert any(not torch.equal(v, before["module"][k]) for k, v in taken["module"].items())
        # ... and the restore put it all back: this rank's float32 partition and Adam's state over it, and the
        # module's bf16 weights, whole (the other rank's partition gathered back too)
        assert torch.equal(restored["fp32"][0], taken["fp32"][0])
        for key, value in taken["adam"][0].items():
            assert torch.equal(restored["adam"][0][key], value), key
        for name, value in taken["module"].items():
            assert restored["module"][name].dtype == torch.bfloat16
            assert torch.equal(restored["module"][name], value), name
        # each rank copied its own half: the float32 partition and Adam's two moments over it (and the step)
        n = taken["fp32"][0].numel()
        assert 3 * 4 * n <= saved["snapshot_bytes"] <= 3 * 4 * n + 64
        assert all(torch.isfinite(v).all() for v in saved["end"]["module"].values())
    # both ranks hold the same weights after the restore and at the end
    for point in ("restored", "end"):
        for name, value in ranks[0][point]["module"].items():
            assert torch.equal(value, ranks[1][point]["module"][name]), (point, name)
    # the partitions are halves of one state: rank 0's and rank 1's differ
    assert not torch.equal(ranks[0]["taken"]["fp32"][0][:8], ranks[1]["taken"]["fp32"][0][:8])
