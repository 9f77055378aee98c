"""Collective-safe alarms, two CPU processes with gloo, real float16 autocast and a real GradScaler: no run waits
for ever because one rank's AmpWatch switched itself off, and what one rank alone sees reaches rank zero.

Each run is made in a child process: the parent enforces a time limit, so a rank left waiting in a collective the
others never enter fails the test (gloo would otherwise wait for its 30-minute timeout, NCCL for ever)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from _sharded import RowsByRank
from torch.utils.data import TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from _limits import HANG_S

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

HERE = Path(__file__).parent


def _child(function: str, out_dir: Path, timeout: float = HANG_S) -> subprocess.CompletedProcess[str]:
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_collective_safety as t; "
            f"t.{function}({str(out_dir)!r})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


class Dump(pl.Callback):
    """Each rank writes its diagnoses and its step count, for the parent to read."""

    def __init__(self, watch: AmpWatch, out_dir: str) -> None:
        self.watch, self.out_dir = watch, out_dir
        self.relayed_at: int | None = None  # the step after which a diagnosis from another rank was first held

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.relayed_at is None and any("reported_from_rank" in d.evidence for d in self.watch.diagnoses):
            self.relayed_at = trainer.global_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        out = {"diagnoses": [d.to_dict() for d in self.watch.diagnoses], "steps": trainer.global_step,
               "relayed_at": self.relayed_at}
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def _ranks(out_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


# ---------------------------------------------------------------------- a rank switched off, then an anomaly


def _fit_switched_off_then_nan(out_dir: str) -> None:
    """DDP, float16 with a GradScaler: rank 1's watch switches itself off after step 1 (its own failure
    containment, made to meet its limit); a NaN in rank 0's data at step 3 makes every rank skip that step, long
    before the first log step (every 50 steps): rank 0 meets the anomaly with a switched-off rank 1."""
    from test_sharded_ddp import SwitchOffOnRank1

    from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=8, plugins=[true_fp16_plugin()],
        log_every_n_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[watch, SwitchOffOnRank1(watch, at=1), Dump(watch, out_dir)])
    # row 98 is rank 0's 50th row: its batch 3 (batch size 16), row 1 within it; rank 1 never sees it
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=512, nan_rows=(98,))))


def test_a_rank_switched_off_before_an_anomaly_under_a_scaler_leaves_no_rank_waiting(tmp_path: Path) -> None:
    done = _child("_fit_switched_off_then_nan", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "switches itself off" in done.stderr
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 8
    # rank 0 still watches: it found the NaN in its own batch and replayed it alone (no rank to agree with)
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"]) == (Finding.DATA_NONFINITE.value, 3)
    assert d["evidence"]["nonfinite_where"] == "rank 0: batch[0] rows [1]"
    assert d["evidence"]["fp32_control_loss"] == "nan"
    assert d["evidence"]["judged_alone"].startswith("AmpWatch switched itself off on 1 other rank")
    # said once, on rank zero, at the skip where the ranks learnt it
    assert "AmpWatch switched itself off on 1 other rank: from step 3 each rank judges anomalies alone" in (
        done.stdout + done.stderr)


def _fit_switched_off_then_overflow(out_dir: str) -> None:
    """As above, with a forward overflow in rank 0's batch at step 5 (an alarm that blames float16, which the
    trajectory control would judge from a snapshot each DDP rank holds half of) and snapshots every 2 steps."""
    from test_sharded_ddp import SwitchOffOnRank1
    from test_sharded_fsdp import Unsharded, one_rank_overflows

    from lightning_ampwatch.scenarios import true_fp16_plugin

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=8, plugins=[true_fp16_plugin(init_scale=2.0**8)],
        log_every_n_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[watch, SwitchOffOnRank1(watch, at=1), Dump(watch, out_dir)])
    # row 160 is rank 0's batch 5, row 0
    trainer.fit(Unsharded(), datamodule=RowsByRank(one_rank_overflows(row=160, factor=200.0)))


def test_after_a_rank_switched_off_no_rank_restores_a_split_snapshot_alone(tmp_path: Path) -> None:
    done = _child("_fit_switched_off_then_overflow", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 8
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"]) == (Finding.FORWARD_OVERFLOW.value, 5)
    assert d["evidence"]["replay_loss"] == "inf"  # located on rank 0 alone
    # each DDP rank holds half of each snapshot: a restore needs rank 1, whose watch is off; not run, and said why
    assert d["evidence"]["trajectory_control"] == (
        "not run: the snapshot ring is off: AmpWatch switched itself off on 1 other rank, and a replay from its "
        "snapshots needs every rank")


# ---------------------------------------------------------------------- a finite divergence on rank 1 alone


class ShiftOnRank1(TensorDataset):
    """Regression rows in which rank 1's targets (odd rows) are 30x larger from its batch ``at`` on: rank 1's loss
    jumps about a thousandfold and stays there (a tiny learning rate keeps the shared weights from following),
    while rank 0's stays at its level. Rank 1 alone sees a finite divergence."""

    def __init__(self, at: int = 12, batch_size: int = 16, n: int = 1024) -> None:
        from lightning_ampwatch.scenarios import regression_data

        x, y = regression_data(n=n).tensors
        y = y.clone()
        first = 2 * batch_size * at
        y[first + 1::2] *= 30.0
        super().__init__(x, y)


def _fit_divergence_on_rank1(out_dir: str) -> None:
    from lightning_ampwatch.scenarios import Regressor, true_fp16_plugin

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=40, plugins=[true_fp16_plugin()],
        log_every_n_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[watch, Dump(watch, out_dir)])
    trainer.fit(Regressor(lr=1e-4), datamodule=RowsByRank(ShiftOnRank1()))


def test_a_finite_divergence_on_rank_one_alone_under_a_scaler_reaches_rank_zero(tmp_path: Path) -> None:
    done = _child("_fit_divergence_on_rank1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    own = [d for d in rank1["diagnoses"] if d["evidence"].get("pattern") == "finite_divergence"]
    assert own and own[0]["step"] >= 12
    assert not any(d["evidence"].get("pattern") == "finite_divergence" and "reported_from_rank" not in d["evidence"]
                   for d in rank0["diagnoses"]), "rank 0's own losses did not diverge"
    relayed = [d for d in rank0["diagnoses"] if d["evidence"].get("reported_from_rank") == 1]
    assert [(d["finding"], d["step"]) for d in relayed] == [(own[0]["finding"], own[0]["step"])]
    # rank zero alone writes the event log: the line is there, named with the rank
    lines = [json.loads(line) for line in (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()]
    assert any(line["evidence"].get("reported_from_rank") == 1 and line["step"] == own[0]["step"] for line in lines)
    # it came at a log step (every 4 steps), not only with the last exchange at the end of the fit
    assert rank0["relayed_at"] is not None and rank0["relayed_at"] % 4 == 0 and rank0["relayed_at"] < 40


# ---------------------------------------------------------------------- a sharded replay that fails on one rank


def _fit_sharded_replay_fails_on_rank1(out_dir: str) -> None:
    """FSDP2, float16 with a GradScaler: a forward overflow in rank 1's batch at step 5, the run's last step; every
    rank replays it (a sharded forward is collective). The model draws one auxiliary input per training step from a
    per-rank stream, and rank 1's holds exactly as many as the run takes: a replay of the last step asks rank 1 for
    one more, and its training_step raises (StopIteration) before the model's forward, on rank 1 alone."""
    import itertools

    from _sharded import cpu_fsdp2
    from test_sharded_fsdp import ShardedSoftmax, one_rank_overflows

    from lightning_ampwatch.scenarios import true_fp16_plugin

    class StreamFedSoftmax(ShardedSoftmax):
        def on_fit_start(self) -> None:
            self.stream = iter(range(6)) if self.global_rank == 1 else itertools.count()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            next(self.stream)
            return super().training_step(batch, batch_idx)

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=cpu_fsdp2(), plugins=[true_fp16_plugin(init_scale=2.0**8)],
        max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[watch, Dump(watch, out_dir)])
    trainer.fit(StreamFedSoftmax(), datamodule=RowsByRank(one_rank_overflows()))


def test_a_sharded_replay_that_raises_on_one_rank_is_stopped_on_every_rank_and_the_evidence_says_why(
        tmp_path: Path) -> None:
    done = _child("_fit_sharded_replay_fails_on_rank1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 6
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert d["step"] == 5
    ev = d["evidence"]
    # every rank stopped the replay where rank 1 raised, and says so: nothing located, no FP32 control
    reason = "the replay raised on rank 1: RuntimeError: generator raised StopIteration"
    assert ev["replay"].startswith(f"failed: {reason}")
    assert ev["fp32_control"].startswith(f"not run: {reason}")
    assert "replay_loss" not in ev and "fp32_control_loss" not in ev
    # the trajectory control's replays draw from the stream too: stopped on every rank alike, and said
    assert ev["trajectory_control"].startswith("failed: the trajectory replay failed: StopIteration")


# ---------------------------------------------------------------------- the lockstep itself, on plain modules


def _lockstep_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank 1's part raises at the start of its second micro-batch, before any module forward; rank 0 runs its
    forward. Each rank writes where it stopped and how many agreements it entered (the same on both, or one would
    wait)."""
    import os

    from lightning_ampwatch import distributed, protocol

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    gathers = 0
    real_gather, real_agree = protocol.gather, protocol._agree_vector

    def counted(votes: list[int]) -> list[int]:
        nonlocal gathers
        gathers += 1
        return real_agree(votes)

    protocol._agree_vector = counted  # counts the meetings' all-reduces; every one is the real collective
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    seen: list[str] = []
    try:
        with distributed.Lockstep(model) as lock:
            for i in range(3):
                lock.next()
                if i == 1 and rank == 1:
                    raise KeyError("a batch with no 'x'")
                if i == 0:
                    continue  # a micro-batch that runs no forward still meets the others once
                model(torch.ones(2, 4))
                seen.append(f"forward {i}")
    except Exception as err:  # noqa: BLE001
        seen.append(f"{type(err).__name__}: {err}")
    # afterwards both ranks are free to meet again: one more gather that each enters
    after = real_gather(rank)
    Path(out_dir, f"lock{rank}.json").write_text(json.dumps({"seen": seen, "gathers": gathers, "after": after,
                                                              "hooks": sum(len(m._forward_pre_hooks)
                                                                           for m in model.modules())}))
    dist.destroy_process_group()


def test_lockstep_stops_every_rank_where_one_raised_before_its_forward(tmp_path: Path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_lockstep_worker, args=(port, str(tmp_path)), nprocs=2, start_method="fork")
    rank0, rank1 = (json.loads((tmp_path / f"lock{r}.json").read_text()) for r in range(2))
    assert rank1["seen"] == ["KeyError: \"a batch with no 'x'\""]
    # rank 0 stopped at its second micro-batch's first module forward, before running it, naming rank 1's error
    assert rank0["seen"] == ["ReplayAborted: rank 1: KeyError: \"a batch with no 'x'\""]
    assert rank0["gathers"] == rank1["gathers"] == 2  # one meeting per micro-batch reached (rank 1: on leaving)
    assert rank0["after"] == rank1["after"] == [0, 1]
    assert rank0["hooks"] == rank1["hooks"] == 0  # the hooks are gone


# ---------------------------------------------------------------------- a rank switched off while a remedy is watched


class SwitchOffAfterRemedy(pl.Callback):
    """Rank 1's watch switches itself off (its failure containment, made to meet its limit) ``after`` steps after
    the remedy was applied, while the ranks still watch it (no skip nor log step in between)."""

    def __init__(self, watch: AmpWatch, after: int) -> None:
        self.watch, self.after = watch, after
        self.at: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        applied = self.watch.watcher.applied
        if self.at is None and applied:
            self.at = trainer.global_step + self.after
        if trainer.global_rank == 1 and self.at is not None and trainer.global_step == self.at:
            for i in range(5):
                self.watch.watcher.internal_failure(f"part {i}", RuntimeError("made to fail"))


def _fit_switched_off_while_a_remedy_is_watched(out_dir: str) -> None:
    """DDP, float16 with a GradScaler: the learning rate jumps 100x at step 20, reduce_lr is applied after a
    rollback and watched for 8 steps; 2 steps into the watch, rank 1's watch switches itself off. The watching
    rank judges the remedy 6 steps later, starting with a gather; no log step comes in between."""
    from test_trajectory_e2e import LrJump

    from lightning_ampwatch.scenarios import regression_data, true_fp16_plugin

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=["reduce_lr"], snapshot_every=5)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=40, plugins=[true_fp16_plugin()],
        log_every_n_steps=100, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[watch, SwitchOffAfterRemedy(watch, after=2), Dump(watch, out_dir)])
    trainer.fit(LrJump(), datamodule=RowsByRank(regression_data(n=1024)))


def test_a_rank_switched_off_while_a_remedy_is_watched_meets_the_judgement(tmp_path: Path) -> None:
    done = _child("_fit_switched_off_while_a_remedy_is_watched", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "switches itself off" in done.stderr
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 40
    [d] = [d for d in rank0["diagnoses"] if d["remedy"] == "reduce_lr"]
    # rank 0 judged the remedy alone, once it learnt at the judgement's gather that rank 1's watch was off
    assert d["outcome"] in ("recovered", "not_recovered", "not_verified")
    assert "AmpWatch switched itself off on 1 other rank" in done.stdout + done.stderr


# ---------------------------------------------------------------------- on_unrecoverable after an alarm judged alone


class Ended(pl.Callback):
    """Put ahead of AmpWatch: each rank writes the step it reached and how (a batch's end, before AmpWatch's; the
    fit's end); and a watchdog: a rank left waiting in a collective dumps its stack and exits, so that no process
    outlives the test."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import faulthandler

        faulthandler.dump_traceback_later(90, exit=True)

    def _write(self, trainer: pl.Trainer, how: str) -> None:
        Path(self.out_dir, f"end{trainer.global_rank}.json").write_text(
            json.dumps({"steps": trainer.global_step, "how": how}))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._write(trainer, "batch end")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, "fit end")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()


def _fit_judged_alone_then_unrecoverable(out_dir: str, mode: str, log_every: int = 4) -> None:
    """bf16-mixed (no scaler), a NaN in rank 1's data at step 2: each rank judges alone (rank 1 from its batch, rank 0
    a step later from the all-reduced weights), with on_unrecoverable=``mode``; log steps every ``log_every`` steps
    (0: none)."""
    from lightning_ampwatch.scenarios import Regressor, regression_data

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, on_unrecoverable=mode, snapshot_every=0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=12, precision="bf16-mixed",
        log_every_n_steps=log_every, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[Ended(out_dir), watch])
    # row 67 is rank 1's batch 2, row 1: rank 0 never sees it
    trainer.fit(Regressor(), datamodule=RowsByRank(regression_data(n=512, nan_rows=(67,))))


def _fit_judged_alone_then_stop(out_dir: str) -> None:
    _fit_judged_alone_then_unrecoverable(out_dir, "stop")


def _fit_judged_alone_then_raise(out_dir: str) -> None:
    _fit_judged_alone_then_unrecoverable(out_dir, "raise")


def _fit_judged_alone_then_stop_with_no_log_step(out_dir: str) -> None:
    _fit_judged_alone_then_unrecoverable(out_dir, "stop", log_every=0)


def _ended(out_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((out_dir / f"end{r}.json").read_text()) for r in range(2)]


def test_on_unrecoverable_stop_after_an_alarm_judged_alone_stops_every_rank_at_the_next_log_step(
        tmp_path: Path) -> None:
    # rank 1 alone reaches the alarm at step 2; had it stopped there, it would wait at the fit's end for rank 0,
    # which goes on training (and waits in its next step's collective)
    done = _child("_fit_judged_alone_then_stop", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ended(tmp_path)
    assert rank0 == rank1 == {"steps": 4, "how": "fit end"}  # both at the first log step after it
    assert "stopping the run on every rank at this log step (on_unrecoverable='stop')" in done.stdout + done.stderr


def test_on_unrecoverable_raise_after_an_alarm_judged_alone_raises_on_every_rank_at_the_next_log_step(
        tmp_path: Path) -> None:
    done = _child("_fit_judged_alone_then_raise", tmp_path)
    assert done.returncode != 0
    # every rank reached the end of step 4's batch (then AmpWatch raised there): none raised alone at step 2
    assert _ended(tmp_path) == [{"steps": 4, "how": "batch end"}] * 2
    assert "AmpWatchError" in done.stderr
    assert "every rank stops at this log step (on_unrecoverable='raise')" in done.stderr


def test_on_unrecoverable_stop_with_no_log_step_is_said_not_carried_out_by_one_rank_alone(tmp_path: Path) -> None:
    done = _child("_fit_judged_alone_then_stop_with_no_log_step", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _ended(tmp_path) == [{"steps": 12, "how": "fit end"}] * 2  # no rank stopped alone: the run went on
    assert "on_unrecoverable='stop' cannot be carried out by one rank alone" in done.stderr


# ---------------------------------------------------------------------- a trajectory replay from a split snapshot


def _fit_split_snapshot_replay_raises_on_rank1(out_dir: str) -> None:
    """Plain DDP, float16 with a GradScaler: each rank holds half of each snapshot, so each trajectory replay starts
    with a restore that broadcasts from every rank. A forward overflow in rank 1's batch at step 5 is replayed from
    the snapshot after step 2 (steps 3-5); rank 1's training_step raises on the second older batch a replay runs
    again (step 4 of the FP32 replay, after that replay's first forward), on rank 1 alone."""
    from test_sharded_fsdp import Unsharded, one_rank_overflows

    from lightning_ampwatch.scenarios import true_fp16_plugin

    class RaisesOnAnOldBatch(Unsharded):
        old = 0
        latest = -1

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx < self.latest:
                self.old += 1
                if self.global_rank == 1 and self.old == 2:
                    raise RuntimeError(f"batch {batch_idx} is run again")
            self.latest = max(self.latest, batch_idx)
            return super().training_step(batch, batch_idx)

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=8, plugins=[true_fp16_plugin(init_scale=2.0**8)],
        log_every_n_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[Ended(out_dir), watch, Dump(watch, out_dir)])
    trainer.fit(RaisesOnAnOldBatch(), datamodule=RowsByRank(one_rank_overflows()))


def test_a_trajectory_replay_from_a_split_snapshot_that_raises_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    done = _child("_fit_split_snapshot_replay_raises_on_rank1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 8
    assert rank0["diagnoses"] == rank1["diagnoses"], "both ranks must reach the same diagnoses"
    d = next(d for d in rank0["diagnoses"] if d["finding"] != Finding.NORMAL_SCALING.value)
    assert (d["finding"], d["step"]) == (Finding.FORWARD_OVERFLOW.value, 5)
    # every rank stopped its replays before the next restore, and says the trajectory control failed, and why
    assert d["evidence"]["trajectory_control"] == (
        "failed: the trajectory replay failed: RuntimeError: batch 4 is run again")


# ---------------------------------------------------------------------- an alarm judged alone while a remedy is watched


def _fit_fallback_then_nan_on_rank1(out_dir: str) -> None:
    """DDP, float16 with a GradScaler: rank 1's rows are 1e5 times too large, an INPUT_RANGE every rank meets at
    step 0, and bf16_fallback is applied on every rank at step 1 and watched (its judgement starts with a gather).
    With no scaler any more, a NaN in rank 1's data at step 2 is judged alone on each rank, while the remedy is
    watched."""
    from lightning_ampwatch.scenarios import Regressor, regression_data, true_fp16_plugin

    x, y = regression_data(n=256, nan_rows=(67,)).tensors
    x = x.clone()
    x[1::2] *= 1e5
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=14, plugins=[true_fp16_plugin()],
        log_every_n_steps=50, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out_dir, use_distributed_sampler=False,
        callbacks=[Ended(out_dir), watch, Dump(watch, out_dir)])
    trainer.fit(Regressor(lr=1e-3, optimizer="adam"), datamodule=RowsByRank(TensorDataset(x, y)))


def test_an_alarm_one_rank_judged_alone_does_not_end_a_remedy_every_rank_watches(tmp_path: Path) -> None:
    done = _child("_fit_fallback_then_nan_on_rank1", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rank0, rank1 = _ranks(tmp_path)
    assert rank0["steps"] == rank1["steps"] == 14
    # every rank judged the fallback together, after its whole watch, and holds the same outcome
    [fallback0] = [d for d in rank0["diagnoses"] if d["remedy"] == "bf16_fallback"]
    [fallback1] = [d for d in rank1["diagnoses"] if d["remedy"] == "bf16_fallback"]
    assert fallback0 == fallback1 and fallback0["outcome"] is not None
    assert fallback0["evidence"]["recovery"]["steps"] == 8
