"""Small real trainings that hit real AMP faults on a CPU: the demo, the examples and the tests share them.

Every fault here comes from the real mechanism (float16 autocast and a real GradScaler), never a mock:
``true_fp16_plugin`` gives real float16 autocast on the CPU, where ``precision="16-mixed"`` silently means bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def true_fp16_plugin(**scaler_kwargs: Any) -> MixedPrecision:
    """Real float16 autocast with a real GradScaler on the CPU."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


class ExpAttention(nn.Module):
    """A hand-written softmax attention: ``exp`` of raw scores, no max-subtraction. Overflows float16."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        scores = self.q(x).unsqueeze(2) * self.k(x).unsqueeze(1)  # (b, d, d) outer product, in float16
        weights = scores.exp()
        weights = weights / weights.sum(-1, keepdim=True)
        return (weights @ self.v(x).unsqueeze(-1)).squeeze(-1)


class Regressor(pl.LightningModule):
    """A small MLP regressor whose loss, LR schedule and layers the scenarios vary."""

    def __init__(self, dim: int = 16, lr: float = 1e-2, loss_scale: float = 1.0, reduction: str = "mean",
                 attention: bool = False, lr_lambda: Callable[[int], float] | None = None,
                 optimizer: str = "sgd") -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Linear(32, dim))
        self.attention = ExpAttention(dim) if attention else None
        self.head = nn.Linear(dim, 1)
        self.lr = lr
        self.loss_scale = loss_scale
        self.reduction = reduction
        self.lr_lambda = lr_lambda
        self.optimizer_name = optimizer

    def forward(self, x: Tensor) -> Tensor:
        h = self.encoder(x)
        if self.attention is not None:
            h = self.attention(h)
        return self.head(h).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y, reduction=self.reduction) * self.loss_scale
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.lr_lambda is None:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def regression_data(n: int = 512, dim: int = 16, seed: int = 0, x_scale: float = 1.0, y_scale: float = 1.0,
                    nan_rows: tuple[int, ...] = ()) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, generator=g) / math.sqrt(dim)
    y = (x @ w + 0.1 * torch.randn(n, generator=g)) * y_scale
    x = x * x_scale
    for row in nan_rows:
        x[row, 0] = float("nan")
    return TensorDataset(x, y)


class StepSchedule:
    """``LambdaLR`` factor: 1 until ``at``, then ``factor`` (a picklable stand-in for a restart or step-up)."""

    def __init__(self, at: int, factor: float) -> None:
        self.at, self.factor = at, factor

    def __call__(self, step: int) -> float:
        return self.factor if step >= self.at else 1.0


@dataclass
class Scenario:
    """One reproducible fault: the model, the data, the precision, and what AmpWatch should say."""

    name: str
    description: str
    expected: str
    model: Callable[[], pl.LightningModule]
    data: Callable[[], TensorDataset]
    precision: str = "fp16"  # "fp16" (true float16 + GradScaler on CPU), "bf16", "32"
    scaler: dict[str, Any] = field(default_factory=dict)
    max_steps: int = 60
    batch_size: int = 32

    def trainer_kwargs(self) -> dict[str, Any]:
        if self.precision == "fp16":
            return {"plugins": [true_fp16_plugin(**self.scaler)]}
        if self.precision == "bf16":
            return {"precision": "bf16-mixed"}
        return {"precision": "32-true"}

    def dataloader(self) -> DataLoader:
        return DataLoader(self.data(), batch_size=self.batch_size, shuffle=False)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "gradient_overflow",
            "A loss summed over the batch gives gradients far above 1; at the default scale 2**16 they overflow "
            "float16, and the scaler throws away step after step until it finds a safe scale.",
            "GRADIENT_OVERFLOW",
            lambda: Regressor(lr=1e-4, reduction="sum"),
            lambda: regression_data(y_scale=4.0),
        ),
        Scenario(
            "scale_collapse",
            "A summed loss over 512 samples with targets in the thousands: the gradients exceed float16 even "
            "unscaled, so the scale collapses below 1 and most steps are thrown away.",
            "GRADIENT_OVERFLOW",
            lambda: Regressor(lr=1e-3, reduction="sum", optimizer="adam"),
            lambda: regression_data(n=2048, y_scale=1000.0),
            max_steps=24,
            batch_size=512,
        ),
        Scenario(
            "growth_overflow",
            "A GradScaler told to grow every 3 clean steps: each growth lands on a scale the gradients cannot "
            "take, and the very next step overflows.",
            "GROWTH_OVERFLOW",
            lambda: Regressor(lr=1e-2),
            lambda: regression_data(),
            scaler={"growth_interval": 3},
        ),
        Scenario(
            "lr_schedule",
            "The learning rate is raised 40x at step 30 (a schedule restart); a few steps later the activations "
            "overflow float16.",
            "LR_SCHEDULE",
            lambda: Regressor(lr=0.02, lr_lambda=StepSchedule(30, 40.0)),
            lambda: regression_data(),
        ),
        Scenario(
            "nan_data",
            "A few rows of the dataset hold NaN; the loss goes NaN on that batch whatever the precision.",
            "DATA_NONFINITE",
            lambda: Regressor(),
            lambda: regression_data(nan_rows=(200,)),
            max_steps=12,
        ),
        Scenario(
            "input_range",
            "Features of magnitude ~1e5: fine in float32, past float16's 65504 as soon as autocast casts them.",
            "INPUT_RANGE",
            lambda: Regressor(lr=1e-3, optimizer="adam"),
            lambda: regression_data(x_scale=1e5),
            max_steps=8,
        ),
        Scenario(
            "forward_overflow",
            "A hand-written attention takes exp() of raw scores in float16; the scores pass ~11 and exp overflows.",
            "FORWARD_OVERFLOW",
            lambda: Regressor(attention=True),
            lambda: regression_data(x_scale=10.0),
            max_steps=8,
        ),
        Scenario(
            "fp32_unstable",
            "Plain float32 with a learning rate far too high: the loss diverges without any reduced precision.",
            "FP32_UNSTABLE",
            lambda: Regressor(lr=5.0),
            lambda: regression_data(),
            precision="32",
            max_steps=40,
        ),
        Scenario(
            "diverging_lr",
            "A float16 run with a learning rate far too high: float16 overflows first, but the FP32 control "
            "shows the loss exploding at full precision too, so AMP is cleared.",
            "FP32_UNSTABLE",
            lambda: Regressor(lr=5.0),
            lambda: regression_data(),
            max_steps=12,
        ),
        Scenario(
            "healthy",
            "A well-behaved float16 run: a couple of skipped steps while the scaler settles, nothing to fix.",
            "NORMAL_SCALING",
            lambda: Regressor(lr=1e-2),
            lambda: regression_data(),
            scaler={"init_scale": 2.0**18},
            max_steps=40,
        ),
    ]
}


def build_trainer(scenario: Scenario, callbacks: list[Any], root_dir: str, **overrides: Any) -> pl.Trainer:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=scenario.max_steps, default_root_dir=root_dir,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=10, logger=False, callbacks=callbacks,
    )
    kwargs.update(scenario.trainer_kwargs())
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def run_scenario(name: str, root_dir: str, watch: Any = None, seed: int = 0, **trainer_overrides: Any) -> Any:
    """Train the scenario with ``watch`` (an :class:`AmpWatch`) attached; returns the watch."""
    from lightning_ampwatch.callback import AmpWatch

    scenario = SCENARIOS[name]
    watch = watch if watch is not None else AmpWatch()
    pl.seed_everything(seed, verbose=False)
    model = scenario.model()
    trainer = build_trainer(scenario, [watch], root_dir, **trainer_overrides)
    trainer.fit(model, scenario.dataloader())
    return watch


def expect(watch: Any, expected: Any, *, script: str | None = None, marker: str | None = None,
           location: str | None = None) -> int:
    """The examples' last line: was ``expected`` diagnosed (at the line of ``script`` that ends with ``marker``,
    or at ``location``)? Prints one line a person or a test can read; returns the exit status."""
    import os

    found = [d for d in watch.diagnoses if d.finding is expected]
    if not found:
        seen = ", ".join(d.finding.value for d in watch.diagnoses) or "nothing"
        print(f"FAILED: expected {expected.value}, AmpWatch diagnosed {seen}.")
        return 1
    where = found[0].location
    if script is not None and marker is not None:
        with open(script, encoding="utf-8") as fh:
            line = next(i for i, text in enumerate(fh, 1) if text.rstrip().endswith(marker))
        path, _, at = str(where).rpartition(":")
        if not (os.path.exists(path) and os.path.samefile(path, script) and at == str(line)):
            print(f"FAILED: {expected.value} was placed at {where}, not at line {line} of {script}.")
            return 1
    elif location is not None and where != location:
        print(f"FAILED: {expected.value} was placed at {where}, not at {location}.")
        return 1
    at_text = f"at {where}" if (script or location) else f"at step {found[0].step}"
    print(f"Diagnosed {expected.value} {at_text}. Event log: {watch.event_log.path}")
    return 0
