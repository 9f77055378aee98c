"""On a real GPU: the same real faults as the CPU tests, with CUDA kernels, the default ``GradScaler("cuda")``
(``precision="16-mixed"``) whose scale and ``found_inf`` stay on the device, and bf16 where the device has it.

Every test here is marked ``cuda`` and skipped without CUDA (the CPU build of torch imports this file and skips it
all). ``scripts/gpu-check.sh`` runs them with the benchmark in one go; docs/gpu.md says what they check.

Host syncs are counted with ``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing CUDA call becomes a
warning, recorded per training batch. What AmpWatch adds is the difference between the same seeded run with it and
without it (Lightning's and the scaler's own syncs cancel out), as tests/test_host_reads.py counts on the CPU.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from test_recovery_e2e import Classifier
from test_rollback_by_hand import rollback_against_hand
from test_trajectory import ExpSoftmax, separable
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Finding, snapshot_copy
from lightning_ampwatch.machine import Observation
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, regression_data

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA: skipped (this torch build or machine has no GPU)"),
]

SYNC_WARNING = "synchronizing CUDA operation"
LOG_EVERY, MAX_STEPS = 8, 24
LOG_STEPS = {7, 15, 23}  # Lightning logs when (global_step + 1) % LOG_EVERY == 0
COUNTED_STEPS = range(1, MAX_STEPS)  # step 0: AmpWatch reads the first loss once per fit


def gpu_trainer(root: Path, callbacks: list[Any], precision: str = "16-mixed", scaler: dict[str, Any] | None = None,
                **overrides: Any) -> pl.Trainer:
    """A one-GPU trainer. ``precision="16-mixed"`` with no ``scaler`` is Lightning's default: ``GradScaler("cuda")``
    at 2**16; ``scaler`` builds that same CUDA scaler with other settings."""
    kwargs: dict[str, Any] = dict(
        accelerator="gpu", devices=1, max_steps=20, default_root_dir=str(root), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=10,
        callbacks=callbacks,
    )
    if precision == "16-mixed" and scaler is not None:
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", **scaler))]
    else:
        kwargs["precision"] = precision
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def _alarms(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.is_alarm]


def _on_device_and_finite(module: torch.nn.Module) -> bool:
    return all(p.device.type == "cuda" and bool(torch.isfinite(p).all()) for p in module.parameters())


# ------------------------------------------------------------------------------------------------ counting syncs


class _SyncMarks(Callback):
    """Where each training batch starts in the list of recorded warnings (and where the fit's batches end)."""

    def __init__(self, log: list[warnings.WarningMessage]) -> None:
        self.log = log
        self.starts: list[tuple[int, int]] = []
        self.end = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append((trainer.global_step, len(self.log)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = len(self.log)


def syncs_per_step(fit: Callable[[list[Callback]], Any]) -> tuple[Counter[int], Any]:
    """Run ``fit(callbacks)`` (which puts the given callbacks first) with every synchronizing CUDA call warned, and
    count them per training batch (by ``trainer.global_step`` at its start)."""
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        marks = _SyncMarks(log)
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fit([marks])
        finally:
            torch.cuda.set_sync_debug_mode(before)
    counts: Counter[int] = Counter()
    bounds = [*marks.starts, (None, marks.end)]
    for (step, start), (_, end) in zip(bounds, bounds[1:]):
        counts[step] += sum(SYNC_WARNING in str(w.message) for w in log[start:end])
    return counts, result


def added_syncs(watched: Counter[int], bare: Counter[int]) -> dict[int, int]:
    """Per counted step, the syncs of the watched run beyond the bare one's; fewer is an error, not a count."""
    added = {step: watched[step] - bare[step] for step in COUNTED_STEPS}
    fewer = {step: n for step, n in added.items() if n < 0}
    assert not fewer, f"the watched run synced less than the bare one (not the same run?): {fewer}"
    return added


class AdamWRegressor(Regressor):
    """The regressor with AdamW, its multi-tensor (``foreach``) or its fused kernel (``fused=True``), whose fused
    step takes the scaler's ``found_inf`` and skips inside its own kernel."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kind = kind

    def configure_optimizers(self) -> Any:
        if self.kind == "fused":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        if self.kind == "foreach":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, foreach=True)
        return super().configure_optimizers()


def _healthy_fit(root: Path, callbacks: list[Callback], precision: str, optimizer: str) -> Callable[..., Any]:
    def fit(marks: list[Callback]) -> pl.Trainer:
        pl.seed_everything(0, verbose=False)
        trainer = gpu_trainer(root, [*marks, *callbacks], precision,
                              {"init_scale": 2.0**10, "growth_interval": 1000} if precision == "16-mixed" else None,
                              max_steps=MAX_STEPS, log_every_n_steps=LOG_EVERY,
                              logger=CSVLogger(str(root), name="csv", version=0))
        model = AdamWRegressor(optimizer, lr=1e-3) if optimizer != "sgd" else Regressor(lr=1e-2)
        trainer.fit(model, DataLoader(regression_data(), batch_size=32))
        return trainer

    return fit


class SyncingWatch(AmpWatch):
    """A positive control: AmpWatch with one ``.item()`` added at every batch end, the kind of read the watch
    must never add. The counter must see it."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        outputs["loss"].item()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def _between_log_steps(added: dict[int, int]) -> dict[int, int]:
    return {step: n for step, n in added.items() if step not in LOG_STEPS and n}


@pytest.mark.parametrize(("precision", "optimizer"), [
    ("16-mixed", "sgd"), ("16-mixed", "foreach"), ("16-mixed", "fused"), ("bf16-mixed", "sgd"),
], ids=["fp16-sgd", "fp16-adamw-foreach", "fp16-adamw-fused", "bf16-sgd"])
def test_a_healthy_step_adds_no_sync_and_a_log_step_at_most_one(tmp_path: Path, precision: str,
                                                                 optimizer: str) -> None:
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("bfloat16 is not supported on this GPU")
    copier = snapshot_copy.copier(torch.device("cuda", torch.cuda.current_device()))
    bare, _ = syncs_per_step(_healthy_fit(tmp_path / "bare", [], precision, optimizer))
    copies = copier.copies
    watch = AmpWatch(verbose=False, snapshot_every=4)  # snapshots on ordinary steps too: their copy must not sync
    watched, trainer = syncs_per_step(_healthy_fit(tmp_path / "watched", [watch], precision, optimizer))
    assert watch.machine is not None and watch.machine.steps_seen == trainer.global_step == MAX_STEPS
    assert watch.machine.skipped_total == 0 and _alarms(watch) == []
    added = added_syncs(watched, bare)
    assert _between_log_steps(added) == {}, f"syncs AmpWatch added on steps that are not log steps: {added}"
    assert all(added[step] <= 1 for step in LOG_STEPS), f"syncs AmpWatch added per log step: {added}"
    # snapshots were taken (the fit's start and every 4 steps while quiet), on the side stream
    assert copier.copies - copies >= 2


def test_the_sync_counter_sees_a_sync_added_to_the_watch(tmp_path: Path) -> None:
    bare, _ = syncs_per_step(_healthy_fit(tmp_path / "bare", [], "16-mixed", "sgd"))
    watched, _ = syncs_per_step(_healthy_fit(tmp_path / "syncing", [SyncingWatch(verbose=False)], "16-mixed", "sgd"))
    added = added_syncs(watched, bare)
    between = _between_log_steps(added)
    # the same check as above fails on this watch: every ordinary step has the added read
    assert set(between) == set(COUNTED_STEPS) - LOG_STEPS and all(n >= 1 for n in between.values()), added


# ------------------------------------------------------------------------------------------------ the faults


def _scenario_fit(name: str, root: Path, watch: AmpWatch, precision: str = "16-mixed",
                  scaler: dict[str, Any] | None = None, steps: int | None = None,
                  model: Callable[[], pl.LightningModule] | None = None) -> tuple[pl.LightningModule, pl.Trainer]:
    """The scenario's fit on the GPU; ``model`` builds another model in its place (after seeding)."""
    scenario = SCENARIOS[name]
    pl.seed_everything(0, verbose=False)
    module = (model or scenario.model)()
    trainer = gpu_trainer(root, [watch], precision, scaler, max_steps=steps or scenario.max_steps * 2)
    trainer.fit(module, scenario.dataloader())
    return module, trainer


def test_a_forward_overflow_is_located_at_its_module(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False)
    _scenario_fit("forward_overflow", tmp_path, watch)
    d = _alarms(watch)[0]
    assert (d.finding, d.location) == (Finding.FORWARD_OVERFLOW, "attention")


def test_a_startup_gradient_overflow_names_the_safe_scale_the_cuda_scaler_settled_at(
        tmp_path: Path, observations: list[Observation]) -> None:
    watch = AmpWatch(verbose=False)
    _, trainer = _scenario_fit("gradient_overflow", tmp_path, watch)  # Lightning's default GradScaler("cuda"), 2**16
    assert type(trainer.precision_plugin.scaler) is torch.amp.GradScaler  # Lightning's own, not a test's
    d = _alarms(watch)[0]
    assert d.finding is Finding.GRADIENT_OVERFLOW and d.evidence["pattern"] == "startup"
    first_taken = next(o for o in observations if not o.skipped)
    assert first_taken.step >= 1 and all(o.skipped for o in observations[:first_taken.step])
    assert d.evidence["init_scale"] == 2.0**16
    assert d.evidence["safe_scale"] == first_taken.scale == 2.0**16 / 2**first_taken.step
    assert f"init_scale=2**{16 - first_taken.step}" in d.advice


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_the_scalers_found_inf_is_seen_with_a_multi_tensor_or_fused_adamw(tmp_path: Path, optimizer: str,
                                                                         observations: list[Observation]) -> None:
    """A fused AdamW skips an overflowed step inside its own kernel (the scaler calls it anyway): the skips are
    read from the scaler's ``found_inf`` on the device, without a sync of their own (the test above)."""
    watch = AmpWatch(verbose=False)
    _, trainer = _scenario_fit("gradient_overflow", tmp_path, watch,
                               model=lambda: AdamWRegressor(optimizer, lr=1e-4, reduction="sum"))
    skipped = [o.step for o in observations if o.skipped]
    streak = next(i for i, o in enumerate(observations) if not o.skipped)
    assert streak >= 1 and skipped[:streak] == list(range(streak))  # a streak from step 0, as the scaler backed off
    # the real scaler's own count: it halved once per skipped step (it grows only after 2000 clean ones)
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**16 / 2**len(skipped)
    assert watch.machine is not None and watch.machine.skipped_total == len(skipped)
    d = _alarms(watch)[0]
    assert d.finding is Finding.GRADIENT_OVERFLOW and d.evidence["pattern"] == "startup"
    assert d.evidence["safe_scale"] == 2.0**16 / 2**streak


def test_the_fp32_trajectory_control_confirms_a_forward_overflow(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, snapshot_every=5)
    pl.seed_everything(0, verbose=False)
    module = ExpSoftmax()
    gpu_trainer(tmp_path, [watch], scaler={"init_scale": 2.0**8}, max_steps=24).fit(
        module, DataLoader(separable(), batch_size=32))
    d = _alarms(watch)[0]
    assert d.finding in (Finding.FORWARD_OVERFLOW, Finding.GRADIENT_OVERFLOW)
    assert d.evidence["control_verdict"].endswith(": an AMP fault")
    losses = d.evidence["trajectory_fp32_losses"]
    assert all(isinstance(v, float) and v < 4 * d.evidence["loss_level"] for v in losses)
    assert d.evidence["trajectory_snapshot_step"] < d.step <= d.evidence["trajectory_window"][1]
    assert _on_device_and_finite(module)


def test_a_learning_rate_too_high_for_fp32_too_is_cleared_by_the_trajectory_replay(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, snapshot_every=5)
    pl.seed_everything(0, verbose=False)
    gpu_trainer(tmp_path, [watch], max_steps=30).fit(Regressor(lr=0.5), DataLoader(regression_data(), batch_size=32))
    d = _alarms(watch)[0]
    assert d.finding is Finding.FP32_UNSTABLE
    assert "Lower the learning rate" in d.advice


def _gpu_classifier_fit(root: Path, callbacks: list[Any]) -> pl.LightningModule:
    pl.seed_everything(0, verbose=False)
    module = Classifier()
    gpu_trainer(root, callbacks, scaler={"init_scale": 2.0**8}, max_steps=40).fit(
        module, DataLoader(separable(), batch_size=32))
    return module


def test_a_rollback_from_a_snapshot_equals_the_fix_applied_by_hand_from_the_same_state(tmp_path: Path) -> None:
    d, treated, by_hand = rollback_against_hand(_gpu_classifier_fit, tmp_path)
    assert d.outcome == "recovered"
    assert "the in-memory snapshot taken after step" in d.evidence["rollback"]
    assert _on_device_and_finite(treated)
    for (name, a), b in zip(treated.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_fallback_switches_a_cuda_run_to_bf16(tmp_path: Path) -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("bfloat16 is not supported on this GPU: the refusal is tested instead")
    watch = AmpWatch(verbose=False, remediate=True)
    model, trainer = _scenario_fit("input_range", tmp_path, watch)
    [d] = [d for d in _alarms(watch) if d.remedy]
    assert (d.finding, d.remedy) == (Finding.INPUT_RANGE, "bf16_fallback")
    assert d.evidence["remedy_details"] == {"precision_before": "16-mixed", "precision_after": "bf16-mixed"}
    assert trainer.precision_plugin.precision == "bf16-mixed" and trainer.precision_plugin.scaler is None
    assert _on_device_and_finite(model)


def test_bf16_fallback_is_refused_with_the_reason_where_the_gpu_has_no_bf16(tmp_path: Path) -> None:
    if torch.cuda.is_bf16_supported():
        pytest.skip("bfloat16 is supported on this GPU: the fallback is tested instead")
    watch = AmpWatch(verbose=False, remediate=["bf16_fallback"])
    _, trainer = _scenario_fit("input_range", tmp_path, watch)
    d = _alarms(watch)[0]
    assert d.remedy is None and trainer.precision_plugin.precision == "16-mixed"
    assert any(f.startswith("bf16_fallback: bfloat16 autocast is not supported on cuda")
               for f in d.evidence["remedies_failed"]), d.evidence


@pytest.fixture
def replayable_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's backward donates its buffers unless told not to; a replay runs backward a second time."""
    import torch._functorch.config as functorch_config  # noqa: PLC0415 - the setting AmpWatch's warning names

    monkeypatch.setattr(functorch_config, "donated_buffer", False)
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_a_forward_overflow_in_a_compiled_module_is_located_by_its_users_name(tmp_path: Path,
                                                                           replayable_compile: None) -> None:
    def compiled() -> pl.LightningModule:
        model = SCENARIOS["forward_overflow"].model()
        model.attention = torch.compile(model.attention)  # Inductor, on the GPU
        return model

    watch = AmpWatch(verbose=False, remediate=True)
    model, _ = _scenario_fit("forward_overflow", tmp_path, watch, model=compiled)
    d = _alarms(watch)[0]
    assert (d.finding, d.location) == (Finding.FORWARD_OVERFLOW, "attention")
    assert "_orig_mod" not in str(d.evidence) and "_orig_mod" not in d.advice
    assert d.remedy == "fp32_island" and d.evidence["remedy_details"] == {"module": "attention"}
    assert _on_device_and_finite(model)


# ------------------------------------------------------------------------------------------------ the side stream


def test_a_snapshot_is_copied_on_a_side_stream_and_the_next_step_waits_on_the_device(tmp_path: Path) -> None:
    """The ring's copy runs on the copier's stream; the weights in the snapshot are those after its step, even
    though the next optimizer step changes them right after (its wait is on the device)."""
    from lightning_ampwatch.trajectory.ring import SnapshotRing
    from lightning_ampwatch.trajectory.state import TrainState

    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    # a few hundred MB of weights, so that the copy is still running when the next step is queued
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    state = TrainState(module=model, optimizers=[opt], device=device)
    ring = SnapshotRing(budget_bytes=2**33, every=1, keep=1)
    x = torch.randn(64, 4096, device=device)
    model(x).square().mean().backward()
    opt.step()
    expected = [p.detach().clone() for p in model.parameters()]
    ring.after_step(0, state)
    copier = snapshot_copy.copier(device)
    assert copier.pending is not None and copier.copies >= 1
    model(x).square().mean().backward()  # queued while the copy runs: no wait before the optimizer step
    opt.step()  # waits on the device for the copy, then changes the weights
    assert copier.pending is None
    torch.cuda.synchronize()
    [snap] = ring.snapshots
    assert snap.pinned and all(t.is_pinned() for t in snap.host)
    host = snap.host[:len(expected)]
    assert all(torch.equal(h, e.cpu()) for h, e in zip(host, expected))
    assert any(not torch.equal(h, p.detach().cpu()) for h, p in zip(host, model.parameters()))
    # the next snapshot reuses the pinned buffers of the one it replaces
    buffers = [t.data_ptr() for t in snap.host]
    ring.after_step(1, state)
    torch.cuda.synchronize()
    assert [t.data_ptr() for t in ring.snapshots[0].host] == buffers
