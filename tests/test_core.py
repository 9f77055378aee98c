"""RunWatcher behind a host that is not Lightning: a plain torch loop in true fp16 on the CPU, written the way the
core's contract says (core.py's docstring). What the Lightning adapter finds, the core finds without a Trainer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ContextManager, Sequence

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from torch import nn

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.config import WatchConfig
from lightning_ampwatch.core import Host, RunWatcher
from lightning_ampwatch.guards import RecipeGuards
from lightning_ampwatch.remedies import RemedyContext, RemedyName
from lightning_ampwatch.scenarios import Regressor, regression_data
from lightning_ampwatch.signals import PrecisionInfo
from lightning_ampwatch.machine import PrecisionMode
from lightning_ampwatch.trajectory.state import TrainState


class PlainHost:
    """A hand-written fp16 loop's answers to the Host protocol: one optimizer, one GradScaler, no framework."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 log_dir: Path) -> None:
        self.module, self.optimizer, self.scaler, self._log_dir = model, optimizer, scaler, str(log_dir)
        self.device = torch.device("cpu")
        self.automatic = True
        self.is_global_zero = True
        self.world_size = 1
        self.steps = 0
        self.said: list[str] = []
        self.stopped = False

    global_step = property(lambda self: self.steps)
    optimizers = property(lambda self: [self.optimizer])
    loggers: Sequence[Any] = ()
    log_every = 10
    log_dir = property(lambda self: self._log_dir)

    def precision(self) -> PrecisionInfo:
        return PrecisionInfo(PrecisionMode.FP16, self.scaler)

    def forward_context(self) -> ContextManager[Any]:
        return torch.autocast("cpu", dtype=torch.float16)

    def step_loss(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self.module(x).squeeze(-1), y)

    def train_state(self) -> TrainState:
        return TrainState(module=self.module, optimizers=[self.optimizer], scaler=self.scaler,
                          forward_context=self.forward_context, step_loss=self.step_loss)

    def step_schedulers(self) -> list[Any]:
        return []

    def remedy_context(self, scaler: Any, safe_scale: float | None, guards: RecipeGuards) -> RemedyContext:
        return RemedyContext(trainer=self, module=self.module, scaler=scaler, device=self.device,
                             safe_scale=safe_scale, guards=guards)

    def rollback_to_checkpoint(self, before: int) -> tuple[str | None, int | None]:
        return None, None

    def broadcast(self, value: Any) -> Any:
        return value

    def log_metrics(self, metrics: dict[str, float]) -> None:
        pass

    def stop(self) -> None:
        self.stopped = True

    def say(self, message: str) -> None:
        self.said.append(message)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def test_a_plain_loop_host_satisfies_the_protocol(tmp_path: Path) -> None:
    model = _model()
    host = PlainHost(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.amp.GradScaler("cpu"), tmp_path)
    assert isinstance(host, Host)


def test_the_lightning_adapter_hands_the_core_a_host(tmp_path: Path) -> None:
    seen: list[bool] = []

    class Spy(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen.append(isinstance(watch._host, Host))

    watch = AmpWatch(verbose=False)
    trainer = make_trainer(tmp_path, [watch, Spy()], max_steps=2)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(regression_data(n=64), batch_size=8))
    assert seen == [True]
    assert watch._host is None  # dropped at the end of the fit: the instance holds no trainer


def _startup_overflow_loop(config: WatchConfig, tmp_path: Path) -> RunWatcher:
    """A hand-written fp16 loop whose scaler starts far too high: 48 steps, the core driven call by call."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    host = PlainHost(model, optimizer, scaler, tmp_path)
    watcher = RunWatcher(config)
    watcher.start(host)
    watcher.begin_training()
    data = torch.utils.data.DataLoader(regression_data(n=8 * 48), batch_size=8)
    for batch_idx, (x, y) in enumerate(data):
        watcher.route.batch_start()
        with host.forward_context():
            loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        scaled = scaler.scale(loss)
        watcher.route.before_backward(scaled)
        scaled.backward()
        watcher.route.before_optimizer_step(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        host.steps += 1
        watcher.route.batch_end((x, y), batch_idx)
    watcher.finish()
    return watcher


def test_the_core_names_a_startup_overflow_in_a_hand_written_fp16_loop(tmp_path: Path) -> None:
    """A loop with no framework: the scale starts far too high, the scaler skips step after step, and the core
    names the start-up overflow with the scale that held, after replaying the step through ``step_loss``."""
    watcher = _startup_overflow_loop(WatchConfig(verbose=False, log_dir=tmp_path), tmp_path)

    assert watcher.machine is not None and watcher.machine.steps_seen == 48
    alarms = [d for d in watcher.diagnoses if d.is_alarm]
    assert [(d.finding, d.step, d.evidence["pattern"]) for d in alarms] == [
        (Finding.GRADIENT_OVERFLOW, 0, "startup")]
    d = alarms[0]
    assert d.evidence["skipped_in_row"] == 23  # 2**40 halved 23 times: 2**17, the first scale that holds
    # the safe scale is replayed over the window from the fit's start, not read from the step the scaler settled at
    # (2**17 went through there, but from the start, at 2**17, steps of the window overflow): issue 30
    assert d.evidence["safe_scale"] == 2.0**15 and "replayed steps 0-23" in d.evidence["safe_scale_from"]
    # replayed through the host's step_loss while the weights were the faulty steps' (at the streak's 4th skip)
    assert d.evidence["batch_idx"] == [3] and d.evidence["replay_grads_finite"] is False
    assert d.evidence["replay_unscaled_grads_finite"] is True and d.location == "2.weight"
    assert d.evidence["control_verdict"] == "control finite: an AMP fault"  # the FP32 control, autocast off
    logged = [json.loads(line) for line in (tmp_path / "ampwatch" / "diagnoses.jsonl").read_text().splitlines()]
    assert [e["finding"] for e in logged] == ["GRADIENT_OVERFLOW"]
    assert watcher.host is None  # close() dropped the host
    watcher.close()  # idempotent, never raises


def test_both_adapters_share_one_validation_of_verbose_and_remediate() -> None:
    """WatchConfig, which AmpWatch and FabricWatch both build, takes verbose="full" and remediate="all" and
    refuses the same bad values with the same words."""
    assert WatchConfig(verbose="full").verbose == "full"
    assert WatchConfig(remediate="all").remedies == frozenset(RemedyName)
    assert RemedyName.REDUCE_LR not in WatchConfig(remediate=True).remedies
    for bad in ("loud", "FULL", 1, None):
        with pytest.raises(ValueError, match="True or False, or \"full\""):
            WatchConfig(verbose=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'all'"):
        WatchConfig(remediate=3)  # type: ignore[arg-type]


def test_the_cores_summary_says_why_an_alarm_got_no_remedy(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The core hands the reporters what remediate= allows: with reduce_lr alone, the start-up overflow's ladder
    is left out, and the summary says so. The ladder is what cured its replays (issue 30): a lower loss scale
    (bf16 is left out by the replay-step cap here), not the finding's fixed row."""
    watcher = _startup_overflow_loop(WatchConfig(remediate=["reduce_lr"], log_dir=tmp_path), tmp_path)
    watcher.close()
    out = " ".join(capsys.readouterr().out.split())
    assert "GRADIENT_OVERFLOW in 2.weight (not fixed: see the advice above; remediate= leaves out its ladder " \
           "(lower_init_scale))" in out, out


def test_a_compiled_modules_donated_buffers_are_named_with_the_setting_that_allows_a_replay() -> None:
    """torch.compile (inductor) donates a backward's buffers, so a replay's second backward fails; the warning says
    which setting lets AmpWatch replay it (measured: with it, the forward_overflow fault is located in the
    compiled attention and fp32_island applied). Inductor compiles too slowly for a test of its own here."""
    from lightning_ampwatch.core import _known_cause

    err = RuntimeError("This backward function was compiled with non-empty donated buffers which requires "
                       "create_graph=False and retain_graph=False.")
    assert "torch._functorch.config.donated_buffer = False" in (_known_cause(err) or "")
    assert _known_cause(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
