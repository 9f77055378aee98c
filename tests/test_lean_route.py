"""The lean route: under Lightning's automatic optimization in one process, AmpWatch takes each batch's loss and
the count of optimizer steps at the batch's end, and leaves Lightning no hook to dispatch on the per-step calls it
has no use for (each costs a profiler context and a call per step). Whole fits of the scenarios on the lean route
and on the full one (every hook called, as where Lightning would call a hook that is ``None``) give the same
diagnoses, remedies, machine state and timeline file, byte for byte; the hooks are put back after the fit."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, compat
from lightning_ampwatch.callback import IDLE_STEP_HOOKS, WANTED_STEP_HOOKS
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, build_trainer, regression_data
from lightning_ampwatch.steps import StepLedger

from conftest import make_trainer


class HookCalls(Callback):
    """Counts, per step, which of AmpWatch's per-step hooks Lightning would call (callable on the instance)."""

    def __init__(self, watch: AmpWatch) -> None:
        self.watch = watch
        self.callable: list[tuple[int, tuple[bool, ...]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        names = IDLE_STEP_HOOKS + WANTED_STEP_HOOKS
        self.callable.append((trainer.global_step, tuple(callable(getattr(self.watch, n)) for n in names)))


class ExpressCount:
    """Counts the batches offered to the ledger's express lane, and those it took (it is called through)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offered = self.taken = 0
        express = StepLedger.express

        def counted(ledger: StepLedger, *args: Any) -> bool:
            took = express(ledger, *args)
            self.offered += 1
            self.taken += took
            return took

        monkeypatch.setattr(StepLedger, "express", counted)


def _fit(name: str, root: Path, lean: bool, monkeypatch: pytest.MonkeyPatch, **watch_kwargs: Any
         ) -> tuple[Any, ...]:
    if not lean:  # as under a Lightning that calls every hook: nothing idled, the full route
        monkeypatch.setattr(compat, "skips_uncallable_hooks", lambda: False)
    else:
        monkeypatch.undo()
    scenario = SCENARIOS[name]
    torch.manual_seed(0)
    random.seed(0)
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, log_dir=str(root / "log"), **watch_kwargs)
    calls = HookCalls(watch)
    express = ExpressCount(monkeypatch)
    trainer = build_trainer(scenario, [watch, calls], str(root), max_steps=scenario.max_steps + 90,
                            log_every_n_steps=10)
    trainer.fit(scenario.model(), scenario.dataloader())
    timeline = (root / "log" / "ampwatch" / "timeline.jsonl").read_text()
    assert watch.machine is not None
    # the route the fit took: on the lean one Lightning had no backward hook of AmpWatch's to call at most steps
    idle_backward = sum(not flags[3] for _, flags in calls.callable)
    assert (idle_backward > len(calls.callable) // 2) if lean else idle_backward == 0
    # the lean route's express lane (a healthy step taken in one call) is never offered a step on the full route
    assert lean or express.offered == 0
    return ([d.to_dict() for d in watch.diagnoses], [a.to_dict() for a in watch.applied],
            watch.machine.state_dict(), timeline, express.taken)


@pytest.mark.parametrize("name, watch_kwargs", [
    ("healthy", {"snapshot_every": 7}),
    ("growth_overflow", {"snapshot_every": 5}),
    ("gradient_overflow", {"snapshot_every": 6}),
    ("lr_schedule", {"snapshot_every": 4, "remediate": True}),
    ("scale_collapse", {"snapshot_every": 3, "remediate": True}),
    ("nan_data", {"snapshot_every": 0}),
    ("fp32_unstable", {"snapshot_every": 5}),
    ("input_range", {"snapshot_every": 2, "remediate": True}),
])
def test_a_fit_is_diagnosed_and_recorded_the_same_on_the_lean_route(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, watch_kwargs: dict[str, Any]) -> None:
    full = _fit(name, tmp_path / "full", False, monkeypatch, **watch_kwargs)
    lean = _fit(name, tmp_path / "lean", True, monkeypatch, **watch_kwargs)
    assert full[0], "the scenario's fit was diagnosed"
    assert lean[0] == full[0]
    assert lean[1] == full[1]
    assert lean[2] == full[2]  # the machine's state: counts, skips, growths, LR history, loss level
    assert lean[3] == full[3]  # the timeline file, byte for byte
    # where the run has healthy stretches, the lean route took some of their steps by its express lane: the
    # comparison above covers it (a run unstable in FP32 or overflowing on every input has no such stretch; a scale
    # collapsing from the start has one once remediate=True starts the scaler at the scale its replays measured)
    assert (lean[4] > 0) == (name in ("healthy", "growth_overflow", "gradient_overflow", "lr_schedule", "nan_data",
                                      "scale_collapse"))


class SometimesNone(Regressor):
    """A model whose ``training_step`` returns None for the first of the two accumulated batches of every third
    step (Lightning runs no backward for it; the step goes on with the other batch's gradients)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        if batch_idx % 6 == 2:
            return None
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def test_the_lean_route_counts_steps_as_lightning_does_with_accumulation_and_skipped_batches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    for lean in (False, True):
        if not lean:
            monkeypatch.setattr(compat, "skips_uncallable_hooks", lambda: False)
        else:
            monkeypatch.undo()
        pl.seed_everything(0, verbose=False)
        watch = AmpWatch(verbose=False, snapshot_every=4)
        calls = HookCalls(watch)
        trainer = make_trainer(tmp_path / str(lean), [watch, calls], "fp16", {"init_scale": 2.0**20},
                               max_steps=30, accumulate_grad_batches=2)
        trainer.fit(SometimesNone(), DataLoader(regression_data(n=1024), batch_size=32))
        assert watch.machine is not None
        seen[lean] = ([d.to_dict() for d in watch.diagnoses], watch.machine.state_dict(), trainer.global_step)
        if lean:
            # after the first backward (the recipe guard's one look at the loss), Lightning has only
            # on_train_batch_end to call: the two idle hooks, batch start, backward and optimizer step are None
            later = [flags for step, flags in calls.callable if step >= 2]
            assert later and all(flags == (False,) * 5 for flags in later)
            # and every hook is callable again once the fit is over
            assert all(callable(getattr(watch, n)) for n in IDLE_STEP_HOOKS + WANTED_STEP_HOOKS)
        else:
            assert all(flags[2:] == (True, True, True) for _, flags in calls.callable)
    assert seen[True] == seen[False]
    assert seen[True][0], "the start-up overflow from 2**20 was diagnosed"
    assert seen[True][1]["steps_seen"] == seen[True][2] == 30


def test_manual_optimization_keeps_every_hook(tmp_path: Path) -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=0)
    calls = HookCalls(watch)
    trainer = make_trainer(tmp_path, [watch, calls], "fp16", max_steps=12)
    trainer.fit(Manual(), DataLoader(regression_data(n=512), batch_size=32))
    assert not watch.watcher.route.lean if watch.watcher.ledger is not None else True
    # backward and the optimizer step stay callable (their calls are how a manual step is seen)
    assert all(flags[3:] == (True, True) for _, flags in calls.callable)
    assert watch.machine is not None and watch.machine.steps_seen == 12


class NoneAtTheBoundary(Regressor):
    """A healthy model, two accumulated batches per step, whose ``training_step`` returns None for the *last* batch of
    every third step: Lightning then runs no scaler step at all (no ``scaler.step``, no ``scaler.update``), though it
    counts the step; the first batch's gradients are dropped with it."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        if batch_idx % 6 == 5:
            return None
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


@pytest.mark.parametrize("lean", [False, True])
def test_a_step_the_scaler_never_ran_is_not_counted_as_its_skip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lean: bool) -> None:
    if not lean:
        monkeypatch.setattr(compat, "skips_uncallable_hooks", lambda: False)
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=0)
    trainer = make_trainer(tmp_path, [watch], "fp16", {"init_scale": 2.0**10, "growth_interval": 10**6},
                           max_steps=30, accumulate_grad_batches=2, log_every_n_steps=10)
    trainer.fit(NoneAtTheBoundary(), DataLoader(regression_data(n=2048), batch_size=32))
    machine = watch.machine
    assert machine is not None and machine.steps_seen == trainer.global_step == 30
    # ten steps ran no scaler step: none of them is a skip, and the scale the host follows stays the scaler's
    assert machine.skipped_total == 0 and watch.diagnoses == []
    ledger = watch.watcher.ledger
    scaler = trainer.precision_plugin.scaler
    if ledger is not None and ledger.mirror is not None:
        assert ledger.mirror.scale == scaler.get_scale() == 2.0**10


def test_an_express_lane_that_raises_is_closed_and_the_run_watched_the_usual_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usual = _fit("gradient_overflow", tmp_path / "usual", True, monkeypatch, snapshot_every=6)
    assert usual[4] > 0
    monkeypatch.undo()
    calls = []

    def broken(ledger: StepLedger, *args: Any) -> bool:  # a fault in the lane's own work, once it is open
        if ledger.step_index >= ledger.express_until:
            return False
        calls.append(ledger.step_index)
        raise RuntimeError("a fault in the express lane")

    monkeypatch.setattr(StepLedger, "express", broken)
    scenario = SCENARIOS["gradient_overflow"]
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, log_dir=str(tmp_path / "broken" / "log"), snapshot_every=6)
    trainer = build_trainer(scenario, [watch], str(tmp_path / "broken"), max_steps=scenario.max_steps + 90,
                            log_every_n_steps=10)
    with pytest.warns(RuntimeWarning, match="internal error in express .*a fault in the express lane"):
        trainer.fit(scenario.model(), scenario.dataloader())
    assert len(calls) == 1  # tried once, then closed for the run
    assert not watch.watcher.disabled
    assert [d.to_dict() for d in watch.diagnoses] == usual[0]  # every step still taken in, the same diagnoses


def _fit_model(root: Path, lean: bool, monkeypatch: pytest.MonkeyPatch, model: Callable[[], Regressor],
               max_steps: int, **watch_kwargs: Any) -> tuple[Any, ...]:
    """One fit of a model of the test's own (built after the seed) on the lean route or the full one, as ``_fit``:
    its diagnoses, the machine's state, the timeline file and the steps the express lane took."""
    if not lean:
        monkeypatch.setattr(compat, "skips_uncallable_hooks", lambda: False)
    else:
        monkeypatch.undo()
    express = ExpressCount(monkeypatch)
    pl.seed_everything(0, verbose=False)
    log = root / "log"
    watch = AmpWatch(verbose=False, log_dir=str(log), **watch_kwargs)
    trainer = make_trainer(root, [watch], "fp16", max_steps=max_steps, log_every_n_steps=25)
    trainer.fit(model(), DataLoader(regression_data(n=4096), batch_size=32))
    assert watch.machine is not None
    timeline = (log / "ampwatch" / "timeline.jsonl").read_text()
    return [d.to_dict() for d in watch.diagnoses], watch.machine.state_dict(), timeline, express.taken


class Warmup:
    """A learning rate that changes at every step: a linear warmup over the first 60 steps (picklable)."""

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / 60)


def test_an_lr_that_changes_every_step_is_recorded_the_same_by_the_express_lane(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {lean: _fit_model(tmp_path / str(lean), lean, monkeypatch, lambda: Regressor(lr_lambda=Warmup()), 100,
                             snapshot_every=16) for lean in (False, True)}
    assert seen[True][:3] == seen[False][:3]  # diagnoses, machine state (its LR history) and timeline, byte for byte
    assert seen[False][3] == 0 and seen[True][3] > 50  # most steps by the lane, each with its own LR
    lrs = {line.split('"lrs":')[1] for line in seen[True][2].splitlines() if '"lrs":' in line}
    assert len(lrs) > 30  # the timeline holds many of the warmup's LRs: the comparison covers them


class ClipsOnceTooEarly(Regressor):
    """A healthy model that, at step 40 only, clips its gradients in ``on_after_backward``: before the scaler has
    unscaled them (a recipe mistake the guard reports from inside the step, while the express lane is open)."""

    def on_after_backward(self) -> None:
        if self.trainer.global_step == 40:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)


def test_a_recipe_mistake_in_the_middle_of_a_healthy_stretch_is_seen_the_same_by_the_lean_route(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {lean: _fit_model(tmp_path / str(lean), lean, monkeypatch, ClipsOnceTooEarly, 80, snapshot_every=16,
                             remediate=True) for lean in (False, True)}
    assert seen[True][:3] == seen[False][:3]
    found = [d for d in seen[True][0] if d["finding"] == "CLIP_BEFORE_UNSCALE"]
    assert len(found) == 1 and found[0]["step"] == 40  # reported at its step, once
    assert seen[True][3] > 40  # the lane took the healthy steps around it
