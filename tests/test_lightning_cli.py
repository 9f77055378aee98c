"""AmpWatch from LightningCLI: a ``callbacks:`` list in a YAML config and ``--trainer.callbacks+=`` on the command
line, with every constructor argument typed so that jsonargparse parses and checks it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Thresholds
from lightning_ampwatch.remedies import DEFAULT_REMEDIES, RemedyName
from lightning_ampwatch.scenarios import regression_data
from lightning_ampwatch.timeline import read_timeline


class SummedLossRegressor(pl.LightningModule):
    """A loss summed over the batch: gradients far above 1, so fp16 overflows at the default scale 2**16."""

    def __init__(self, lr: float = 1e-4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y, reduction="sum")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(regression_data(y_scale=4.0), batch_size=32)


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when ``args=`` and pytest's own ``sys.argv`` are both present."""
    monkeypatch.setattr("sys.argv", ["ampwatch-cli-test"])


def watches(cli: LightningCLI) -> list[AmpWatch]:
    return [cb for cb in cli.trainer.callbacks if isinstance(cb, AmpWatch)]


def test_config_file_enables_ampwatch_on_a_true_fp16_fit(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"""
seed_everything: 0
trainer:
  accelerator: cpu
  max_steps: 10
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {tmp_path}
  plugins:
    - class_path: lightning.pytorch.plugins.precision.MixedPrecision
      init_args:
        precision: 16-mixed
        device: cpu
        scaler:
          class_path: torch.amp.GradScaler
          init_args: {{device: cpu}}
  callbacks:
    - class_path: lightning_ampwatch.AmpWatch
      init_args:
        remediate: [lower_init_scale, slow_growth]
        on_unrecoverable: warn
        verbose: false
        thresholds:
          startup_streak: 3
""")
    cli = LightningCLI(SummedLossRegressor, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True})
    (watch,) = watches(cli)
    assert watch.remedies == {"lower_init_scale", "slow_growth"}
    assert watch.thresholds == Thresholds(startup_streak=3)
    assert watch.verbose is False
    assert watch.precision is not None and watch.precision.mode.value == "fp16"  # it watched the real scaler
    assert [d.finding.value for d in watch.diagnoses][:1] == ["GRADIENT_OVERFLOW"]
    assert watch.diagnoses[0].evidence["init_scale"] == 2.0**16
    timeline = read_timeline(tmp_path / "ampwatch" / "timeline.jsonl")
    assert timeline.steps == list(range(10)) and timeline.skipped[:3] == [True, True, True]
    saved = (tmp_path / "config.yaml").read_text()  # LightningCLI's own copy of the parsed config
    assert "class_path: lightning_ampwatch.AmpWatch" in saved and "startup_streak: 3" in saved


def test_command_line_adds_ampwatch_with_remediate_true(tmp_path: Path) -> None:
    cli = LightningCLI(SummedLossRegressor, run=False, save_config_callback=None, args=[
        "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_ampwatch.AmpWatch",
        "--trainer.callbacks.remediate=true",
        "--trainer.callbacks.on_unrecoverable=stop",
        "--trainer.callbacks.thresholds.window=64",
    ])
    (watch,) = watches(cli)
    assert watch.remedies == set(DEFAULT_REMEDIES)
    assert watch.on_unrecoverable == "stop"
    assert watch.thresholds.window == 64


def test_command_line_takes_a_list_of_remedy_names(tmp_path: Path) -> None:
    cli = LightningCLI(SummedLossRegressor, run=False, save_config_callback=None, args=[
        "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_ampwatch.AmpWatch",
        "--trainer.callbacks.remediate=[fp32_island, reduce_lr]",
    ])
    (watch,) = watches(cli)
    assert watch.remedies == {"fp32_island", "reduce_lr"}


@pytest.mark.parametrize("arg, named", [
    ("--trainer.callbacks.on_unrecoverable=explode", "explode"),
    ("--trainer.callbacks.verbose=loud", "loud"),
])
def test_command_line_rejects_a_bad_value_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str], arg: str,
                                                  named: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        LightningCLI(SummedLossRegressor, run=False, save_config_callback=None, args=[
            "--trainer.accelerator=cpu", "--trainer.callbacks+=lightning_ampwatch.AmpWatch", arg])
    assert exit_info.value.code != 0
    assert named in capsys.readouterr().err


def test_help_lists_the_arguments_with_their_docs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LightningCLI(SummedLossRegressor, run=False, args=["--trainer.callbacks.help", "lightning_ampwatch.AmpWatch"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--trainer.callbacks.remediate" in text and "every remedy except `reduce_lr`" in text
    assert "--trainer.callbacks.on_unrecoverable {warn,stop,raise}" in text
    assert "--trainer.callbacks.thresholds" in text
    assert "``" not in text  # the docstring's markup is Markdown (single backticks), not RST


def test_command_line_takes_a_single_remedy_name(tmp_path: Path) -> None:
    cli = LightningCLI(SummedLossRegressor, run=False, save_config_callback=None, args=[
        "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_ampwatch.AmpWatch",
        "--trainer.callbacks.remediate=lower_init_scale",
    ])
    (watch,) = watches(cli)
    assert watch.remedies == {"lower_init_scale"}


def test_command_line_allows_every_remedy_with_all(tmp_path: Path) -> None:
    cli = LightningCLI(SummedLossRegressor, run=False, save_config_callback=None, args=[
        "--trainer.accelerator=cpu", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=lightning_ampwatch.AmpWatch",
        "--trainer.callbacks.remediate=all", "--trainer.callbacks.verbose=full",
    ])
    (watch,) = watches(cli)
    assert "reduce_lr" in watch.remedies and watch.remedies == frozenset(RemedyName)  # every one, skip_batch too
    assert watch.verbose == "full"
