"""Recipe guards: each AMP recipe mistake made for real in a LightningModule, named at the offending line.

Every training here is a real Trainer on the CPU with real float16 autocast and a real GradScaler (or bf16 /
16-true where the case needs it). The offending statements carry a ``# <- NAME`` marker; the expected
``file:line`` is looked up from this file's source, so a finding that names the wrong line fails.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import make_trainer
from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch import call_sites, recipe_checks
from lightning_ampwatch import guards as guards_module
from lightning_ampwatch.guards import (
    PRESCALE_MIN_FACTOR,
    analyze_loss,
    eps_too_small_for_float16,
    optimizer_stage,
    returned_at,
    stepped_by_scaler,
    user_call_site,
)

_SOURCE_LINES = inspect.getsource(sys.modules[__name__]).splitlines()


def line_of(marker: str) -> int:
    """The line number of the one statement in this file marked ``# <- marker``."""
    hits = [i for i, text in enumerate(_SOURCE_LINES, 1) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, f"marker {marker!r} must mark exactly one line, found {hits}"
    return hits[0]


def assert_at(location: str | None, marker: str) -> None:
    """``location`` is ``file:line`` naming this test file at the marked line."""
    assert location is not None
    path, _, line = location.rpartition(":")
    assert os.path.samefile(path, __file__), location
    assert int(line) == line_of(marker), f"{location} should be line {line_of(marker)} ({marker})"


def recipe(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.finding.is_recipe]


def regression_loader(n: int = 64, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, generator=g)),
                      batch_size=batch_size)


def classification_loader(n: int = 64, batch_size: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)),
                      batch_size=batch_size)


def fit(tmp_path: Any, model: pl.LightningModule, loader: DataLoader | None = None, precision: str = "fp16",
        **overrides: Any) -> AmpWatch:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    overrides.setdefault("max_steps", 4)
    trainer = make_trainer(tmp_path, [watch], precision, **overrides)
    trainer.fit(model, loader or regression_loader())
    return watch


class Net(pl.LightningModule):
    """A small MLP; subclasses make one mistake each."""

    def __init__(self, outputs: int = 1, manual: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, outputs))
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


# ------------------------------------------------------------------------------ LOSS_OUTSIDE_AUTOCAST


class LossWithAutocastOffManual(Net):
    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        out = self(x)  # float16 under autocast
        with torch.autocast("cpu", enabled=False):
            loss = F.mse_loss(out, y.half())  # runs in float16: autocast would have run it in float32
        opt.zero_grad()
        self.manual_backward(loss)  # <- LOSS_MANUAL
        opt.step()


class LossWithAutocastOffAutomatic(Net):
    def __init__(self) -> None:
        super().__init__(outputs=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        with torch.autocast("cpu", enabled=False):
            return F.cross_entropy(logits, y)  # <- LOSS_AUTOMATIC


def test_loss_outside_autocast_manual(tmp_path: Any) -> None:
    watch = fit(tmp_path, LossWithAutocastOffManual())
    [d] = recipe(watch)
    assert d.finding is Finding.LOSS_OUTSIDE_AUTOCAST
    assert_at(d.location, "LOSS_MANUAL")
    assert d.evidence["loss_op"] == "MseLoss" and d.evidence["loss_dtype"] == "float16"
    assert d.evidence["code"].startswith("self.manual_backward(loss)")
    assert d.step == 0


def test_loss_outside_autocast_automatic_names_the_return(tmp_path: Any) -> None:
    watch = fit(tmp_path, LossWithAutocastOffAutomatic(), classification_loader())
    [d] = recipe(watch)
    assert d.finding is Finding.LOSS_OUTSIDE_AUTOCAST
    assert_at(d.location, "LOSS_AUTOMATIC")
    assert d.evidence["loss_op"] == "NllLoss" and d.evidence["optimization"] == "automatic"


# ------------------------------------------------------------------------------ CLIP_BEFORE_UNSCALE


class ClipGradientsBeforeStepManual(Net):
    """Lightning's own manual clipping before ``opt.step()``: the gradients are still scaled (Lightning #18089)."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self(x), y))
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")  # <- CLIP_LIGHTNING
        opt.step()


class ClipInOnAfterBackward(Net):
    """Automatic optimization, clipping in ``on_after_backward``: before Lightning unscales."""

    def on_after_backward(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=2.0)  # <- CLIP_NORM
        torch.nn.utils.clip_grad.clip_grad_value_(self.parameters(), clip_value=1.0)  # <- CLIP_VALUE


def test_clip_before_unscale_lightning_manual_clip_gradients(tmp_path: Any) -> None:
    watch = fit(tmp_path, ClipGradientsBeforeStepManual())
    [d] = recipe(watch)  # four steps, one call site: one diagnosis
    assert d.finding is Finding.CLIP_BEFORE_UNSCALE
    assert_at(d.location, "CLIP_LIGHTNING")
    ev = d.evidence
    assert ev["via"] == "LightningModule.clip_gradients" and ev["optimizer_state"] == "READY"
    assert ev["scale"] == 2.0**16 and ev["clip_limit"] == 0.5 and ev["limit_in_real_units"] == 0.5 / 2**16
    assert "on_before_optimizer_step" in d.advice  # the fix that works in manual optimization


def test_clip_before_unscale_direct_calls_each_named(tmp_path: Any) -> None:
    watch = fit(tmp_path, ClipInOnAfterBackward())
    found = recipe(watch)
    assert [d.finding for d in found] == [Finding.CLIP_BEFORE_UNSCALE] * 2
    norm, value = found
    assert_at(norm.location, "CLIP_NORM")
    assert_at(value.location, "CLIP_VALUE")
    assert norm.evidence["clip_function"] == "torch.nn.utils.clip_grad_norm_"
    assert value.evidence["clip_function"] == "torch.nn.utils.clip_grad_value_"
    assert norm.evidence["via"] == "direct call" and norm.evidence["optimization"] == "automatic"


# ------------------------------------------------------------------------------ STEP_OUTSIDE_SCALER


class RawStepManual(Net):
    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(F.mse_loss(self(x), y))
        opt.optimizer.step()  # <- STEP_MANUAL


class RawStepAutomatic(Net):
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.optimizer.step(closure=optimizer_closure)  # <- STEP_AUTOMATIC


def test_step_outside_scaler_manual(tmp_path: Any) -> None:
    # a raw step never advances Lightning's step counter: bound the run by batches instead
    watch = fit(tmp_path, RawStepManual(), max_steps=-1, max_epochs=1, limit_train_batches=3)
    [d] = recipe(watch)
    assert d.finding is Finding.STEP_OUTSIDE_SCALER
    assert_at(d.location, "STEP_MANUAL")
    assert d.evidence["optimizer"] == "SGD" and d.evidence["optimizer_state"] == "READY"
    assert "self.optimizers()" in d.advice


def test_step_outside_scaler_automatic_optimizer_step_override(tmp_path: Any) -> None:
    watch = fit(tmp_path, RawStepAutomatic(), max_steps=-1, max_epochs=1, limit_train_batches=3)
    [d] = recipe(watch)
    assert d.finding is Finding.STEP_OUTSIDE_SCALER
    assert_at(d.location, "STEP_AUTOMATIC")


# ------------------------------------------------------------------------------ MANUAL_PRESCALE


class PrescaleManual(Net):
    def __init__(self, twice: bool = False) -> None:
        super().__init__(manual=True)
        self.twice = twice

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        loss = F.mse_loss(self(x), y)
        if self.twice:
            self.manual_backward(self.trainer.precision_plugin.scaler.scale(loss))  # <- PRESCALE_TWICE
        else:
            self.manual_backward(loss * 1024)  # <- PRESCALE_1024
        opt.step()


class PrescaleAutomatic(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        return loss * 4096  # <- PRESCALE_AUTOMATIC


def test_manual_prescale_constant(tmp_path: Any) -> None:
    watch = fit(tmp_path, PrescaleManual())
    [d] = recipe(watch)
    assert d.finding is Finding.MANUAL_PRESCALE
    assert_at(d.location, "PRESCALE_1024")
    assert d.evidence["factor"] == 1024.0 and d.evidence["second_scaler_scale"] is False
    assert d.evidence["scale"] == 2.0**16 and d.evidence["effective_scale"] == 1024.0 * 2**16
    assert "2**10" in d.advice


def test_manual_prescale_second_scaler_scale(tmp_path: Any) -> None:
    watch = fit(tmp_path, PrescaleManual(twice=True))
    [d] = recipe(watch)
    assert d.finding is Finding.MANUAL_PRESCALE
    assert_at(d.location, "PRESCALE_TWICE")
    assert d.evidence["second_scaler_scale"] is True and d.evidence["factor"] == 2.0**16


def test_manual_prescale_automatic_with_accumulation(tmp_path: Any) -> None:
    # Lightning divides by the 2 accumulated batches: 4096 / 2 is still a hand-made scale
    watch = fit(tmp_path, PrescaleAutomatic(), max_steps=2, accumulate_grad_batches=2)
    [d] = recipe(watch)
    assert d.finding is Finding.MANUAL_PRESCALE
    assert_at(d.location, "PRESCALE_AUTOMATIC")
    assert d.evidence["factor"] == 2048.0


# ------------------------------------------------------------------------------ FP16_PARAMETERS, EPS_UNDERFLOW


class HalfParameters(Net):
    def __init__(self) -> None:
        super().__init__()
        self.net[2].half()  # the head in float16 under 16-mixed


class AdamDefaultEps(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)  # <- EPS


def test_fp16_parameters_named_before_the_scaler_refuses_them(tmp_path: Any) -> None:
    watch = AmpWatch(verbose=False)
    trainer = make_trainer(tmp_path, [watch], max_steps=2)
    before = dict(vars(torch.nn.utils))
    with pytest.raises(ValueError, match="FP16 gradients"):  # GradScaler.unscale_ refuses them
        trainer.fit(HalfParameters(), regression_loader())
    [d] = recipe(watch)
    assert d.finding is Finding.FP16_PARAMETERS
    assert d.location == "net.2.weight"
    assert d.evidence["float16_parameters"] == 2 and d.evidence["trainable_parameters"] == 4
    assert d.evidence["first_float16"] == ["net.2.weight", "net.2.bias"]
    assert _same_namespace(before, vars(torch.nn.utils))


def test_eps_underflow_under_16_true(tmp_path: Any) -> None:
    watch = fit(tmp_path, AdamDefaultEps(), precision="16-true", max_steps=2)
    [d] = recipe(watch)
    assert d.finding is Finding.EPS_UNDERFLOW
    assert_at(d.location, "EPS")
    assert d.evidence["eps"] == 1e-8 and d.evidence["eps_in_float16"] == 0.0
    assert "eps=1e-4" in d.advice


def test_eps_is_fine_under_16_mixed(tmp_path: Any) -> None:
    assert recipe(fit(tmp_path, AdamDefaultEps(), max_steps=2)) == []


# ------------------------------------------------------------------------------ the correct recipes: silence


class ClipInOnBeforeOptimizerStepManual(Net):
    """The manual recipe that works: clip where Lightning has already unscaled; accumulate with loss / 2."""

    def __init__(self) -> None:
        super().__init__(manual=True)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(F.mse_loss(self(x), y) / 2)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")


class WatchesClipping(Net):
    """Records whether the clipping functions were wrapped while Lightning clipped (the negative can fail)."""

    clip_wrapped: list[bool]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.clip_wrapped = getattr(self, "clip_wrapped", [])
        self.clip_wrapped.append(hasattr(torch.nn.utils.clip_grad_norm_, "__ampwatch_original__"))


class FusedAdam(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)


def test_gradient_clip_val_is_not_flagged(tmp_path: Any) -> None:
    model = WatchesClipping()
    watch = fit(tmp_path, model, gradient_clip_val=0.5)
    assert recipe(watch) == []
    assert model.clip_wrapped == [True] * 4  # the guard was in place and saw Lightning's clipping


def test_accumulation_division_is_not_flagged(tmp_path: Any) -> None:
    assert recipe(fit(tmp_path, Net(), accumulate_grad_batches=4, max_steps=2)) == []
    assert recipe(fit(tmp_path, ClipInOnBeforeOptimizerStepManual())) == []


def test_fused_optimizer_is_not_flagged(tmp_path: Any) -> None:
    assert recipe(fit(tmp_path, FusedAdam())) == []


def test_bf16_mixed_run_is_not_flagged(tmp_path: Any) -> None:
    watch = fit(tmp_path, LossWithAutocastOffAutomatic(), classification_loader(), precision="bf16-mixed")
    assert recipe(watch) == []  # no scaler, no float16: the recipe guards have nothing to say


# ------------------------------------------------------------------------------ leaving torch as found


def _same_namespace(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return before.keys() == after.keys() and all(after[k] is v for k, v in before.items())


class RaisesAtStepTwo(Net):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        assert hasattr(torch.nn.utils.clip_grad_norm_, "__ampwatch_original__")  # wrapped while fit runs
        if batch_idx == 2:
            raise RuntimeError("user code failed")
        return super().training_step(batch, batch_idx)


def test_torch_nn_utils_restored_after_fit_and_after_a_failed_fit(tmp_path: Any) -> None:
    modules = (torch.nn.utils, torch.nn.utils.clip_grad)
    before = [dict(vars(m)) for m in modules]
    fit(tmp_path, WatchesClipping(), gradient_clip_val=1.0)
    assert all(_same_namespace(b, vars(m)) for b, m in zip(before, modules))
    with pytest.raises(RuntimeError, match="user code failed"):
        fit(tmp_path, RaisesAtStepTwo())
    assert all(_same_namespace(b, vars(m)) for b, m in zip(before, modules))


# ------------------------------------------------------------------------------ no work on a healthy step


def _profile_fit(tmp_path: Any, steps: int) -> tuple[Counter[str], Counter[str]]:
    """Python functions of the guards (guards.py, and the detection it calls: recipe_checks.py, call_sites.py) that
    ran, and the C functions they called, over a healthy fit."""
    guards_files = {guards_module.__file__, recipe_checks.__file__, call_sites.__file__}
    python_calls: Counter[str] = Counter()
    c_calls: Counter[str] = Counter()

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if frame.f_code.co_filename not in guards_files:
            return
        if event == "call":
            python_calls[frame.f_code.co_name] += 1
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            c_calls[f"{type(owner).__name__}.{arg.__name__}" if owner is not None else arg.__name__] += 1

    pl.seed_everything(0, verbose=False)  # the model's weights too (fit seeds after they are made): the same in every fit
    model = WatchesClipping()
    sys.setprofile(profiler)
    try:
        fit(tmp_path / str(steps), model, gradient_clip_val=1.0, max_steps=steps)
    finally:
        sys.setprofile(None)
    return python_calls, c_calls


def test_guards_add_constant_host_work_and_no_tensor_reads_per_step(tmp_path: Any) -> None:
    short_py, short_c = _profile_fit(tmp_path, 3)
    long_py, long_c = _profile_fit(tmp_path, 7)
    per_step = {name: (long_py[name] - short_py[name]) / 4 for name in long_py}
    assert sum(per_step.values()) <= 12, per_step  # a handful of small Python calls per step, no more
    assert all(n == int(n) for n in per_step.values()), per_step  # exactly the same work every step
    for heavy in ("user_call_site", "analyze_loss", "returned_at", "_current_scale", "_emit"):
        assert per_step.get(heavy, 0) == 0, heavy  # stack walks, graph walks and scale reads: never per step
    for slow in ("_check_step", "stepped_by_scaler"):
        assert per_step.get(slow, 0) == 0, slow  # a step through scaler.step takes the pre-hook's fast exit
    added_c = {name for name in long_c if long_c[name] != short_c[name]}
    assert not {name for name in added_c if "Tensor" in name}, added_c  # no tensor method on the step path


# ------------------------------------------------------------------------------ the pure pieces


def test_analyze_loss_reads_factors_and_float16_loss_ops() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    w = torch.randn(4, 3, requires_grad=True)
    x = torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        out = x @ w
        inside = F.mse_loss(out, torch.zeros_like(out))
    outside = F.mse_loss(out, torch.zeros_like(out))  # float16 in, autocast off: float16 loss op

    assert analyze_loss(scaler.scale(inside), scaler).factor == 1.0
    assert analyze_loss(scaler.scale(inside), scaler).float16_loss_op is None
    assert analyze_loss(scaler.scale(inside / 4), scaler).factor == 0.25
    assert not analyze_loss(scaler.scale(inside * (PRESCALE_MIN_FACTOR / 2)), scaler).prescaled  # a loss weight
    graph = analyze_loss(scaler.scale(1024 * inside.float()), scaler)
    assert graph.factor == 1024.0 and graph.prescaled and not graph.second_scale
    twice = analyze_loss(scaler.scale(scaler.scale(inside)), scaler)
    assert twice.second_scale and twice.factor == 2.0**12
    bad = analyze_loss(scaler.scale(outside), scaler)
    assert bad.float16_loss_op == "MseLossBackward0" and bad.loss_dtype == torch.float16
    assert analyze_loss(scaler.scale(outside.float() * 2), scaler).float16_loss_op == "MseLossBackward0"


def test_analyze_loss_steps_over_the_cast_fsdp1_s_sharded_scaler_makes() -> None:
    # FSDP1's ShardedGradScaler multiplies a float16 loss by its float32 scale and casts the product back to float16:
    # that cast and product are the scaler's own, not a hand-made scale under a second one
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**8)
    w = torch.randn(4, 3, requires_grad=True)
    loss = (torch.randn(5, 4).half() @ w.half()).sum()  # a float16 loss, as a float16 model's sum is
    scaled = scaler.scale(loss)
    assert scaled.grad_fn.name() == "ToCopyBackward0"  # the mechanism this test is about
    graph = analyze_loss(scaled, scaler)
    assert graph.factor == 1.0 and not graph.second_scale and not graph.prescaled
    by_hand = analyze_loss(scaler.scale(loss * 1024), scaler)
    assert by_hand.factor == 1024.0 and by_hand.prescaled and not by_hand.second_scale
    twice = analyze_loss(scaler.scale(scaler.scale(loss)), scaler)
    assert twice.second_scale and twice.prescaled


def test_scaler_stage_and_who_steps() -> None:
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    seen: list[tuple[str, bool]] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append((optimizer_stage(scaler, o), stepped_by_scaler(scaler, o, k))))
    scaler.scale(p.sum()).backward()
    assert optimizer_stage(scaler, opt) == "READY"
    assert id(opt) not in scaler._per_optimizer_states  # looking did not add an entry
    scaler.step(opt)
    scaler.update()
    opt.step()
    assert seen == [("UNSCALED", True), ("READY", False)]


def test_returned_at_and_user_call_site() -> None:
    site = returned_at(PrescaleAutomatic.training_step)
    assert site is not None and site.lineno == line_of("PRESCALE_AUTOMATIC") and site.function == "training_step"
    assert returned_at(pl.LightningModule.training_step) is None  # Lightning's own code is never named
    here, _ = user_call_site()
    assert here is not None and here.function == "test_returned_at_and_user_call_site"


def test_eps_check_reads_float16_groups_only() -> None:
    half = nn.Linear(2, 2).half()
    assert [p.eps for p in eps_too_small_for_float16([torch.optim.Adam(half.parameters())])] == [1e-8]
    assert eps_too_small_for_float16([torch.optim.Adam(half.parameters(), eps=1e-4)]) == []
    assert eps_too_small_for_float16([torch.optim.Adam(nn.Linear(2, 2).parameters())]) == []  # float32
