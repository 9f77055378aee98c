"""Shared fixtures: a real true-fp16 CPU trainer factory, quiet Lightning logs, and an observation spy."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch

from lightning_ampwatch.machine import AmpStateMachine, Observation
from lightning_ampwatch.scenarios import true_fp16_plugin

_LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric")

# The test models are tiny: one intra-op thread is several times faster than two fighting over 2 cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _quiet_lightning() -> Any:
    """Lightning's start-up chatter ("GPU available", tips) drowns a failing test's output."""
    loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    yield
    for lg, level in zip(loggers, levels):
        lg.setLevel(level)


def make_trainer(root_dir: Any, callbacks: list[Any], precision: str = "fp16", scaler: dict[str, Any] | None = None,
                 **overrides: Any) -> pl.Trainer:
    """A small CPU trainer; ``precision="fp16"`` is real float16 autocast with a real GradScaler."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=20, default_root_dir=str(root_dir), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=10, callbacks=callbacks,
    )
    if precision == "fp16":
        kwargs["plugins"] = [true_fp16_plugin(**(scaler or {}))]
    else:
        kwargs["precision"] = precision
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


@pytest.fixture
def fp16_trainer(tmp_path: Any) -> Callable[..., pl.Trainer]:
    """``fp16_trainer(callbacks, scaler={...}, **trainer_kwargs)``: a true-fp16 CPU trainer rooted in tmp_path."""

    def factory(callbacks: list[Any], scaler: dict[str, Any] | None = None, **overrides: Any) -> pl.Trainer:
        return make_trainer(tmp_path, callbacks, "fp16", scaler, **overrides)

    return factory


@pytest.fixture
def observations(monkeypatch: pytest.MonkeyPatch) -> list[Observation]:
    """Every step the callback feeds its machine, in order, as Observations (the machine still runs as usual).
    Clean steps on the fast path (``observe_clean``, or ``observe_clean_run`` for the ones taken in later) are
    recorded as the Observation they stand for."""
    seen: list[Observation] = []
    original, original_clean = AmpStateMachine.observe, AmpStateMachine.observe_clean

    def recording(self: AmpStateMachine, obs: Observation) -> Any:
        seen.append(obs)
        return original(self, obs)

    def recording_clean(self: AmpStateMachine, step: int, scale: float | None, grew: bool,
                        lrs: tuple[float, ...], loss: float | None = None) -> None:
        seen.append(Observation(step=step, skipped=False, scale=scale, grew=grew, lrs=lrs, loss=loss,
                                loss_finite=None if loss is None else loss == loss and abs(loss) != float("inf")))
        original_clean(self, step, scale, grew, lrs, loss)

    original_run = AmpStateMachine.observe_clean_run

    def recording_run(self: AmpStateMachine, steps: Any, scales: Any, grews: Any, lrss: Any) -> None:
        # a run of clean steps the watcher took in later (at its next log step): the same Observations, in order
        seen.extend(Observation(step=step, skipped=False, scale=scale, grew=grew, lrs=lrs, loss=None, loss_finite=None)
                    for step, scale, grew, lrs in zip(steps, scales, grews, lrss))
        original_run(self, steps, scales, grews, lrss)

    monkeypatch.setattr(AmpStateMachine, "observe", recording)
    monkeypatch.setattr(AmpStateMachine, "observe_clean", recording_clean)
    monkeypatch.setattr(AmpStateMachine, "observe_clean_run", recording_run)
    return seen


class FileSizes(pl.Callback):
    """Runs after AmpWatch: a file's size (the timeline's) at the end of every batch, and the steps it grew after."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sizes: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.sizes.append((trainer.global_step, self.path.stat().st_size if self.path.exists() else 0))

    def grew_at(self) -> list[int]:
        return [step for (step, size), (_, before) in zip(self.sizes[1:], self.sizes) if size != before]
