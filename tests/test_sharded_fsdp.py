"""FSDP2 (Lightning's ModelParallelStrategy, ``fully_shard``) in two CPU processes with gloo, real float16 autocast
and a real GradScaler: a fault on one rank's data is replayed by every rank together (a sharded forward is
collective), and both ranks reach the same located diagnosis; the step and skip counts are the run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _sharded import RowsByRank, cpu_fsdp1, cpu_fsdp2, fsdp1_fp16
from torch import nn
from torch.utils.data import TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.scenarios import true_fp16_plugin
from lightning_ampwatch.summary import RunStats
from _limits import HANG_S

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class ShardedSoftmax(pl.LightningModule):
    """Two hidden layers and a head, each ``fully_shard``-ed, and a hand-written softmax: ``exp`` of the raw logits
    overflows float16 past ~11 (FP32 has room up to ~88)."""

    def __init__(self, param_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.param_dtype = param_dtype
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype)
        for m in (self.body[0], self.body[2], self.head, self):
            fully_shard(m, mesh=mesh, mp_policy=policy)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        e = self.head(self.body(x)).exp()
        p = e / e.sum(-1, keepdim=True)
        return -p.gather(1, y[:, None]).float().log().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def one_rank_overflows(row: int = 16 * 2 * 5 + 1, factor: float = 60.0) -> TensorDataset:
    """Separable data; one row scaled so that its logits' exp overflows float16 but not float32. Row 161 is rank
    1's batch 5 (batch size 16, rows alternate between the ranks): only rank 1 ever sees it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(-1)
    x[row] *= factor
    return TensorDataset(x, y)


class Dump(pl.Callback):
    """Each rank writes its diagnoses, its summary counts and the run's own: the optimizer's real steps (a post-hook
    on it; the scaler skips a step by not calling it) and the scaler's final scale, for the parent to compare."""

    def __init__(self, watch: AmpWatch, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir
        self.taken = 0

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        def count(*_: Any) -> None:
            self.taken += 1

        trainer.optimizers[0].register_step_post_hook(count)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stats = RunStats.of_run(self.watch.watcher.machine, self.watch.watcher.ledger.mirror)
        out = {"diagnoses": [d.to_dict() for d in self.watch.diagnoses], "steps": stats.steps,
               "skipped": stats.skipped, "scale": stats.scale, "run_steps": trainer.global_step,
               "run_skipped": trainer.global_step - self.taken,
               "run_scale": float(trainer.precision_plugin.scaler.get_scale())}
        (Path(self.out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def _fit(tmp_path: Path, module: Any, data: TensorDataset, max_steps: int = 10, init_scale: float = 2.0**8,
         fsdp1: bool = False, **watch_kw: Any) -> list[dict[str, Any]]:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, **watch_kw)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_fsdp1() if fsdp1 else cpu_fsdp2(),
        plugins=[fsdp1_fp16(init_scale=init_scale) if fsdp1 else true_fp16_plugin(init_scale=init_scale)],
        max_steps=max_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[watch, Dump(watch, str(tmp_path))], use_distributed_sampler=False)
    trainer.fit(module(), datamodule=RowsByRank(data))  # made after seeding: the same weights every run
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _alarm(rank: dict[str, Any]) -> dict[str, Any]:
    return next(d for d in rank["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)


def test_fsdp2_a_forward_overflow_on_one_rank_is_located_the_same_on_both(tmp_path: Path) -> None:
    rank0, rank1 = _fit(tmp_path, ShardedSoftmax, one_rank_overflows(), snapshot_every=2)
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    d = _alarm(rank0)
    assert (d["finding"], d["step"]) == (Finding.FORWARD_OVERFLOW.value, 5)
    assert d["location"] == "ShardedSoftmax.training_step"  # exp overflows outside any module
    ev = d["evidence"]
    assert ev["fault_ranks"] == [1] and ev["investigated_on_rank"] == 1
    assert ev["replay_loss"] == "inf" and isinstance(ev["fp32_control_loss"], float)
    assert "replay_grads" not in ev  # the sharded gradients were measured (reduced across the ranks)
    # the trajectory control ran on the sharded state (snapshots of each rank's shards) and confirms float16, from
    # the newest snapshot before step 4, whose update may already have done the damage seen at step 5
    assert ev["trajectory_verdict"] == "amp_confirmed" and ev["trajectory_snapshot_step"] == 2
    assert ev["trajectory_rank"] == 1  # every rank replayed its own batches: the evidence is the faulty rank's
    # every step and every skip counted as the run made them
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 10
        assert rank["skipped"] == rank["run_skipped"] == 1 and rank["scale"] == rank["run_scale"] == 2.0**7


def test_fsdp2_half_param_dtype_runs_no_false_fp32_control(tmp_path: Path) -> None:
    rank0, rank1 = _fit(tmp_path, lambda: ShardedSoftmax(param_dtype=torch.float16), one_rank_overflows(), snapshot_every=2)
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = _alarm(rank0)
    assert d["finding"] != Finding.FP32_UNSTABLE.value  # a pure float16 overflow is not blamed on FP32
    assert d["finding"] == Finding.FORWARD_OVERFLOW.value
    ev = d["evidence"]
    assert ev["fp32_control"].startswith("not run: FSDP gathers the parameters in float16")
    assert "FSDP gathers the parameters in float16" in ev["trajectory_control"]


class Loud(ShardedSoftmax):
    """A plain cross-entropy whose gradients, at a start-up scale of 2**24, overflow float16 in backward."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.body(x)).float(), y) * 64


class LoudUnsharded(Loud):
    def configure_model(self) -> None:  # FSDP1 wraps the whole module at the root
        pass


@pytest.mark.parametrize("fsdp1", [False, True], ids=["fsdp2", "fsdp1"])
def test_fsdp_a_start_up_gradient_overflow_gets_a_measured_safe_scale(tmp_path: Path, fsdp1: bool) -> None:
    rank0, rank1 = _fit(tmp_path, LoudUnsharded if fsdp1 else Loud, one_rank_overflows(factor=1.0), max_steps=14,
                        init_scale=2.0**24, fsdp1=fsdp1, remediate="lower_init_scale")
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = _alarm(rank0)
    assert d["finding"] == Finding.GRADIENT_OVERFLOW.value and d["evidence"]["pattern"] == "startup"
    ev = d["evidence"]
    # measured from the sharded gradients, every rank's shard reduced: not "finite" by default
    assert ev["replay_grads_finite"] is False and ev["replay_unscaled_grads_finite"] is True
    absmax = ev["replay_grad_absmax"]
    assert isinstance(absmax, float) and 0 < absmax < 65504
    # the scale is the largest that replayed the window without a skip where the ranks could replay it together
    # (FSDP2), else the single replay's largest unscaled gradient's (FSDP1): either way within float16 with room
    assert ev["safe_scale"] * absmax <= 65504 / 2
    assert ("replayed steps" in ev["safe_scale_from"]) != fsdp1
    assert fsdp1 <= ("replay's largest unscaled gradient" in ev["safe_scale_from"])
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 14 and rank["skipped"] == rank["run_skipped"] >= 2


class Unsharded(ShardedSoftmax):
    """The same model for FSDP1, which wraps it whole at the root (no ``fully_shard`` of its own)."""

    def configure_model(self) -> None:
        pass


def test_fsdp1_replays_through_the_root_wrapper_and_runs_no_false_fp32_control(tmp_path: Path) -> None:
    rank0, rank1 = _fit(tmp_path, Unsharded, one_rank_overflows(), fsdp1=True, snapshot_every=2)
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    d = _alarm(rank0)
    # replayed through FSDP's root forward (past it the parameters are flat shards): located, not failed
    assert (d["finding"], d["step"], d["location"]) == (Finding.FORWARD_OVERFLOW.value, 5,
                                                        "Unsharded.training_step")
    ev = d["evidence"]
    assert ev["fault_ranks"] == [1] and ev["replay_loss"] == "inf" and "replay" not in ev
    # Lightning's FSDP "16-mixed" gathers float16 parameters: no FP32 control pretends otherwise
    assert ev["fp32_control"].startswith("not run: FSDP gathers the parameters in float16")
    assert ev["trajectory_control"].startswith("not run:")
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 10
        assert rank["skipped"] == rank["run_skipped"] == 1 and rank["scale"] == rank["run_scale"] == 2.0**7


def _fit_bf16(out_dir: str) -> None:
    """Run in a child process (the parent enforces the time limit): FSDP2, bf16 (no scaler), NaN on rank 1 only."""
    from _sharded import RowsByRank, cpu_fsdp2
    from test_ddp import DumpDiagnoses

    from lightning_ampwatch.scenarios import regression_data

    class Sharded(ShardedSoftmax):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.body(x[:, :8])).sum(-1).float(), y)

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_fsdp2(), precision="bf16-mixed", max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
        callbacks=[watch, DumpDiagnoses(watch, out_dir)], use_distributed_sampler=False)
    trainer.fit(Sharded(), datamodule=RowsByRank(regression_data(n=256, nan_rows=(67,))))


def test_fsdp2_without_a_scaler_no_rank_replays_alone_and_the_evidence_says_why(tmp_path: Path) -> None:
    # Without a scaler the ranks meet the NaN at different steps; a sharded replay on one rank alone would wait for
    # the others' all-gathers for ever. The child must finish well inside the limit.
    _rank1_judged_alone_in_a_child(tmp_path, "_fit_bf16")


def test_fsdp2_an_lr_jump_rolls_back_each_rank_s_shard_and_reduce_lr_recovers(tmp_path: Path) -> None:
    from test_trajectory_e2e import LrJump

    from lightning_ampwatch.scenarios import regression_data

    class ShardedLrJump(LrJump):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for m in (self.encoder[0], self.encoder[2], self.head, self):
                fully_shard(m, mesh=mesh)

    class Weights(pl.Callback):
        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            full = {k: v.full_tensor() for k, v in pl_module.state_dict().items()}  # every rank takes part
            torch.save(full, tmp_path / f"weights{trainer.global_rank}.pt")

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_fsdp2(), plugins=[true_fp16_plugin()], max_steps=40,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, Dump(watch, str(tmp_path)), Weights()],
        use_distributed_sampler=False)
    trainer.fit(ShardedLrJump(), datamodule=RowsByRank(regression_data(n=1024)))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d.get("remedy") == "reduce_lr")
    assert d["finding"] == Finding.LR_SCHEDULE.value and d["outcome"] == "recovered"
    assert "the in-memory snapshot taken after step" in d["evidence"]["rollback"]
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 40 and rank["skipped"] == rank["run_skipped"]
    weights = [torch.load(tmp_path / f"weights{r}.pt") for r in range(2)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]) and torch.isfinite(weights[0][name]).all()


def test_fsdp2_rolls_back_to_a_sharded_checkpoint_directory_through_lightnings_loading(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_trajectory_e2e import LrJump

    from lightning_ampwatch.scenarios import regression_data

    class ShardedLrJump(LrJump):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for m in (self.encoder[0], self.encoder[2], self.head, self):
                fully_shard(m, mesh=mesh)

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=0)  # no snapshots: the checkpoint
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_fsdp2(), plugins=[true_fp16_plugin()], max_steps=40,
        logger=False, enable_checkpointing=True, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, Dump(watch, str(tmp_path)), ckpt],
        use_distributed_sampler=False)
    trainer.fit(ShardedLrJump(), datamodule=RowsByRank(regression_data(n=1024)))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d.get("remedy") == "reduce_lr")
    rollback = d["evidence"]["rollback"]
    assert "rolled back from step" in rollback and str(tmp_path / "ckpt") in rollback, rollback
    path = rollback.split("(the checkpoint file ")[1].split(")")[0]
    assert Path(path).is_dir()  # a sharded checkpoint is a directory
    assert d["outcome"] == "recovered"


class FullWeights(pl.Callback):
    """Each rank writes the whole model (every rank takes part in gathering it), and what its snapshots held."""

    def __init__(self, watch: AmpWatch, out_dir: Path) -> None:
        self.watch, self.out_dir = watch, out_dir
        self.snapshot_bytes: int | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        control = self.watch.watcher.trajectory  # (let go when the fit ends)
        self.snapshot_bytes = control.ring.bytes_per_snapshot if control is not None else None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True))
        torch.save({"weights": full, "snapshot_bytes": self.snapshot_bytes},
                   self.out_dir / f"weights{trainer.global_rank}.pt")


def _fit_fsdp1_lr_jump(tmp_path: Path, strategy: Any, snapshot_every: int, module: Any = None,
                       **trainer_kw: Any) -> list[dict[str, Any]]:
    from test_trajectory_e2e import LrJump

    from lightning_ampwatch.scenarios import regression_data

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=snapshot_every)
    callbacks = [watch, Dump(watch, str(tmp_path)), FullWeights(watch, tmp_path), *trainer_kw.pop("callbacks", [])]
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=[fsdp1_fp16()], max_steps=40, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=callbacks,
        use_distributed_sampler=False, **{"enable_checkpointing": False, **trainer_kw})
    trainer.fit((module or LrJump)(), datamodule=RowsByRank(regression_data(n=1024)))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_fsdp1_an_lr_jump_rolls_back_each_rank_s_shard_and_reduce_lr_recovers(tmp_path: Path) -> None:
    rank0, rank1 = _fit_fsdp1_lr_jump(tmp_path, cpu_fsdp1(), snapshot_every=5)
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d.get("remedy") == "reduce_lr")
    assert d["finding"] == Finding.LR_SCHEDULE.value and d["outcome"] == "recovered"
    assert "the in-memory snapshot taken after step" in d["evidence"]["rollback"]
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 40 and rank["skipped"] == rank["run_skipped"]
    saved = [torch.load(tmp_path / f"weights{r}.pt") for r in range(2)]
    weights = [s["weights"] for s in saved]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]) and torch.isfinite(weights[0][name]).all()
    # each rank's snapshot held its shard: about half of the whole trained state (the weights, Adam's two moments
    # and step counts, the scaler), not all of it
    whole = 3 * sum(t.nbytes for t in weights[0].values())
    for s in saved:
        assert 0.4 * whole < s["snapshot_bytes"] < 0.6 * whole, (s["snapshot_bytes"], whole)
    print(f"FSDP1 snapshot bytes per rank: {[s['snapshot_bytes'] for s in saved]}, the whole trained state: {whole}")


def test_fsdp1_rolls_back_to_a_sharded_checkpoint_directory_through_lightnings_loading(tmp_path: Path) -> None:
    # (a "full" checkpoint cannot be saved on the CPU: see tests/_sharded.py)
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=5, save_top_k=-1)
    rank0, rank1 = _fit_fsdp1_lr_jump(tmp_path, cpu_fsdp1(state_dict_type="sharded"), snapshot_every=0,
                                      callbacks=[ckpt], enable_checkpointing=True)  # no snapshots: the checkpoint
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d.get("remedy") == "reduce_lr")
    rollback = d["evidence"]["rollback"]
    assert "rolled back from step" in rollback and str(tmp_path / "ckpt") in rollback, rollback
    path = rollback.split("(the checkpoint file ")[1].split(")")[0]
    assert Path(path).is_dir()  # a sharded checkpoint is a directory
    assert d["outcome"] == "recovered"
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 40 and rank["skipped"] == rank["run_skipped"]
    weights = [torch.load(tmp_path / f"weights{r}.pt")["weights"] for r in range(2)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]) and torch.isfinite(weights[0][name]).all()


def test_fsdp1_a_frozen_part_is_left_out_of_each_rank_s_snapshot_and_the_rollback_holds(tmp_path: Path) -> None:
    # a frozen first layer sharing the root's flat parameter with trained ones (use_orig_params, Lightning's default)
    from test_trajectory_e2e import LrJump

    class FrozenFirst(LrJump):
        def __init__(self) -> None:
            super().__init__()
            self.encoder[0].requires_grad_(False)

        def configure_optimizers(self) -> Any:
            config = super().configure_optimizers()
            opt = torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=3e-2)
            config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda step: 100.0 if step >= 20 else 1.0)
            return {**config, "optimizer": opt}

    rank0, rank1 = _fit_fsdp1_lr_jump(tmp_path, cpu_fsdp1(), snapshot_every=5, module=FrozenFirst)
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d.get("remedy") == "reduce_lr")
    assert d["outcome"] == "recovered" and "the in-memory snapshot taken after step" in d["evidence"]["rollback"]
    saved = [torch.load(tmp_path / f"weights{r}.pt") for r in range(2)]
    for name in saved[0]["weights"]:
        assert torch.equal(saved[0]["weights"][name], saved[1]["weights"][name])
    trained = sum(v.nbytes for k, v in saved[0]["weights"].items() if not k.startswith("encoder.0."))
    frozen = sum(v.nbytes for k, v in saved[0]["weights"].items() if k.startswith("encoder.0."))
    # the ranks' snapshots together: the trained weights and Adam's two moments once, plus a few scalars (Adam's
    # step counts, each rank's scale and growth tracker); the frozen layer's bytes are in none of them
    total = sum(s["snapshot_bytes"] for s in saved)
    assert 3 * trained <= total < 3 * trained + 64 < 3 * trained + frozen


class HalfLoss:
    """A loss left in the output's dtype (float16 under autocast): an L1 loss written by hand. FSDP1's
    ShardedGradScaler casts the scaled float16 loss back to float16, a cast AmpWatch must know for the scaler's."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        return (out - y.to(out.dtype)).abs().mean()


@pytest.mark.parametrize("half_loss", [False, True], ids=["mse", "float16-loss"])
def test_fsdp1_fp16_a_healthy_run_reports_no_finding(tmp_path: Path, half_loss: bool) -> None:
    # Lightning's FSDP precision with real float16 autocast and a ShardedGradScaler: nothing to report (before the
    # harness autocast on the CPU, and before AmpWatch knew the cast ShardedGradScaler adds, this read as
    # LOSS_OUTSIDE_AUTOCAST and MANUAL_PRESCALE at step 0)
    from lightning_ampwatch.scenarios import Regressor, regression_data

    module = type("HalfLossRegressor", (HalfLoss, Regressor), {})() if half_loss else Regressor()
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_fsdp1(), plugins=[fsdp1_fp16(init_scale=2.0**8)], max_steps=20,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), callbacks=[watch, Dump(watch, str(tmp_path))], use_distributed_sampler=False)
    trainer.fit(module, datamodule=RowsByRank(regression_data(n=1024)))
    for rank in (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)):
        assert rank["diagnoses"] == []
        assert rank["steps"] == rank["run_steps"] == 20 and rank["skipped"] == rank["run_skipped"] == 0


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig-params", "flat-params"])
def test_fsdp1_with_float32_parameters_runs_the_trajectory_control_and_puts_the_live_shards_back_exactly(
        tmp_path: Path, use_orig_params: bool) -> None:
    # FSDP1 gathering float32 parameters (its MixedPrecision without a param_dtype) under float16 autocast: the FP32
    # replay is an FP32 run, so every rank restores its own shard from the agreed snapshot and replays together
    from torch.distributed.fsdp import MixedPrecision as FsdpMixedPrecision

    def fit(out: Path, snapshot_every: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        out.mkdir()
        pl.seed_everything(0, verbose=False)
        watch = AmpWatch(verbose=False, snapshot_every=snapshot_every)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, plugins=[fsdp1_fp16(init_scale=2.0**8)], max_steps=10, logger=False,
            strategy=cpu_fsdp1(mixed_precision=FsdpMixedPrecision(), use_orig_params=use_orig_params),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=str(out), callbacks=[watch, Dump(watch, str(out)), FullWeights(watch, out)],
            use_distributed_sampler=False)
        trainer.fit(Unsharded(), datamodule=RowsByRank(one_rank_overflows()))
        return ([json.loads((out / f"rank{r}.json").read_text()) for r in range(2)],
                [torch.load(out / f"weights{r}.pt") for r in range(2)])

    (rank0, rank1), saved = fit(tmp_path / "snapshots", snapshot_every=2)
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    d = _alarm(rank0)
    assert (d["finding"], d["step"], d["location"]) == (Finding.FORWARD_OVERFLOW.value, 5, "Unsharded.training_step")
    ev = d["evidence"]
    assert ev["trajectory_verdict"] == "amp_confirmed" and ev["trajectory_snapshot_step"] == 2
    assert ev["trajectory_rank"] == 1  # every rank replayed its own batches: the evidence is the faulty rank's
    for rank in (rank0, rank1):
        assert rank["steps"] == rank["run_steps"] == 10
        assert rank["skipped"] == rank["run_skipped"] == 1 and rank["scale"] == rank["run_scale"] == 2.0**7
    # this rank's shard of the trained state (weights, Adam's moments), not the whole of it
    whole = 3 * sum(t.nbytes for t in saved[0]["weights"].values())
    assert 0.45 * whole < ev["trajectory_snapshot_bytes"] < 0.55 * whole
    # three replays from a snapshot, each followed by putting the live shards back: the run is the one it would have
    # been without them, bit for bit
    _, unreplayed = fit(tmp_path / "no-snapshots", snapshot_every=0)
    for r in range(2):
        for name, value in unreplayed[r]["weights"].items():
            assert torch.equal(saved[r]["weights"][name], value), name


def _fit_fsdp1_bf16(out_dir: str) -> None:
    """Run in a child process (the parent enforces the time limit): FSDP1, bf16 (no scaler), NaN on rank 1 only,
    snapshots every 2 steps; each rank also writes what its snapshots held."""
    from _sharded import RowsByRank, cpu_fsdp1, fsdp1_bf16
    from test_ddp import DumpDiagnoses

    from lightning_ampwatch.scenarios import regression_data

    class Sharded(Unsharded):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.body(x[:, :8])).sum(-1).float(), y)

    class Held(pl.Callback):
        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            control = watch.watcher.trajectory
            held = control.ring.bytes_per_snapshot if control is not None and control.ring.enabled else 0
            (Path(out_dir) / f"held{trainer.global_rank}.json").write_text(json.dumps(held))

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_fsdp1(), plugins=[fsdp1_bf16()], max_steps=8, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
        callbacks=[watch, DumpDiagnoses(watch, out_dir), Held()], use_distributed_sampler=False)
    trainer.fit(Sharded(), datamodule=RowsByRank(regression_data(n=256, nan_rows=(67,))))


def test_fsdp1_without_a_scaler_keeps_snapshots_and_no_rank_replays_alone(tmp_path: Path) -> None:
    # FSDP1 in bf16: the snapshots stay on (for rollback; the FP32 replay is not run), and a NaN on rank 1 alone is
    # judged there without a replay (a sharded forward would wait for rank 0) and reported by rank zero. The child
    # must finish well inside the limit.
    _rank1_judged_alone_in_a_child(tmp_path, "_fit_fsdp1_bf16")
    # the snapshots were on, on both ranks (they are kept for rollback though FSDP gathers bf16 parameters)
    assert all(json.loads((tmp_path / f"held{r}.json").read_text()) > 0 for r in range(2))


def _one_rank_snapshots_alone(rank: int, out_dir: str, port: int) -> None:
    import datetime
    import os

    from torch.distributed.fsdp import FullyShardedDataParallel

    from lightning_ampwatch.trajectory.snapshot import Snapshot
    from lightning_ampwatch.trajectory.state import TrainState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=HANG_S))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    root = FullyShardedDataParallel(module, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.Adam(root.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        root(torch.randn(4, 8)).square().mean().backward()
        opt.step()

    step()
    state = TrainState(module=module, optimizers=[opt], root=root)
    if rank == 0:  # rank 0 alone, as when the other rank is in an episode (no snapshot) or judged a fault alone
        held = [p for p in root.parameters() if p in opt.state]  # (a parameter of which this rank holds nothing: none)
        before = [p.detach().clone() for p in root.parameters()]
        moments = [opt.state[p]["exp_avg"].clone() for p in held]
        snapshot = Snapshot.take(state, 0)
        with torch.no_grad():  # not a step: a step's backward would reduce gradients with rank 1
            for p in root.parameters():
                p.add_(1.0)
            for p in held:
                opt.state[p]["exp_avg"].mul_(3.0)
        snapshot.restore(state)
        restored = bool(held) and all(torch.equal(p, b) for p, b in zip(root.parameters(), before)) and all(
            torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(held, moments))
        Path(out_dir, "rank0.json").write_text(json.dumps({"restored": restored, "bytes": snapshot.nbytes}))
    dist.barrier()  # rank 1 waits here the whole time
    step()  # and both ranks train on together
    dist.destroy_process_group()


def _free_port() -> int:
    """A port the OS reports free (tests run side by side under pytest-xdist: a port made from the pid could clash)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_fsdp1_a_rank_takes_and_restores_its_snapshot_alone(tmp_path: Path) -> None:
    # FSDP1's own state-dict calls are collectives (one rank alone waits for the other until gloo gives up): a
    # snapshot or restore taken by one rank and not another, as an episode on one rank's data makes them, would
    # hang the run. AmpWatch's read and write this rank's shards only.
    import torch.multiprocessing as mp

    mp.start_processes(_one_rank_snapshots_alone, args=(str(tmp_path), _free_port()), nprocs=2,
                       start_method="fork")
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result["restored"] is True
    assert 0 < result["bytes"] < 0.6 * 3 * 4 * (8 * 16 + 16 + 16 * 4 + 4)  # this rank's shard, not the whole


def _rank1_judged_alone_in_a_child(tmp_path: Path, fit: str) -> None:
    """Run ``fit`` (a function of this module writing each rank's diagnoses) in a child process, which must finish
    well inside the limit (a replay on one rank alone would wait for ever), then check that the NaN in rank 1's data
    was judged there without a replay, and that rank zero, which prints and logs, reports it."""
    import subprocess
    import sys

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_sharded_fsdp as t; "
            f"t.{fit}({str(tmp_path)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "internal error" not in done.stderr, done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    d = rank1[0]
    assert (d["finding"], d["step"]) == (Finding.DATA_NONFINITE.value, 2)
    assert d["evidence"]["replay"].startswith("not run: the model is sharded")
    assert any(r["evidence"].get("reported_from_rank") == 1 and r["step"] == 2 for r in rank0)


def test_fsdp1_a_weights_only_sharded_checkpoint_is_passed_over_and_the_live_state_put_back(tmp_path: Path) -> None:
    # a newer weights-only directory (step 18) is loaded into the live model before it can be checked: the live
    # state goes back as it was, and the full one at step 14 is the one rolled back to, on both ranks alike
    from lightning.pytorch.callbacks import ModelCheckpoint

    weights_only = ModelCheckpoint(dirpath=str(tmp_path / "weights"), save_weights_only=True, every_n_train_steps=3,
                                   save_top_k=-1)
    full = ModelCheckpoint(dirpath=str(tmp_path / "full"), every_n_train_steps=7, save_top_k=-1)
    rank0, rank1 = _fit_fsdp1_lr_jump(tmp_path, cpu_fsdp1(state_dict_type="sharded"), snapshot_every=0,
                                      callbacks=[weights_only, full], enable_checkpointing=True)
    assert rank0["diagnoses"] == rank1["diagnoses"]
    d = next(d for d in rank0["diagnoses"] if d.get("remedy") == "reduce_lr")
    rollback = d["evidence"]["rollback"]
    assert f"(the checkpoint file {tmp_path / 'full'}" in rollback and "step=14.ckpt" in rollback, rollback
    assert any(p.name.endswith("step=18.ckpt") for p in (tmp_path / "weights").iterdir())
    assert d["outcome"] == "recovered"
    weights = [torch.load(tmp_path / f"weights{r}.pt")["weights"] for r in range(2)]
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]) and torch.isfinite(weights[0][name]).all()
