"""A rename and a "recovered" rest on measurements that can carry them, end to end: real fits on the CPU, true
float16 autocast with a real GradScaler, on a model of our own whose trouble comes from the real mechanism.

The model sits on a plateau (labels drawn at random: nothing to learn beyond their prior, the loss stays near
log(4) = 1.386) and computes its softmax by hand, with exp of its scores plus a constant offset: float16's exp
overflows (65504) as soon as SGD's wandering has pushed a score a little up, while float32 has room to spare. A
genuine float16 fault, on a run whose loss neither falls nor climbs: the noise of such a run must not rename it,
nor verify a remedy.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding, Thresholds


class PlateauExpSoftmax(pl.LightningModule):
    """exp(score + offset) / sum: the offset (which a softmax ignores) leaves float16 little headroom."""

    def __init__(self, offset: float, lr: float = 1.0) -> None:
        super().__init__()
        self.offset, self.lr = offset, lr
        self.net = nn.Linear(8, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        e = (self.net(x) + self.offset).exp()
        p = e / e.sum(-1, keepdim=True)
        return -p.gather(1, y[:, None]).float().log().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def random_labels(seed: int, n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _fit(tmp_path: Path, watch: AmpWatch, *, seed: int, offset: float, max_steps: int) -> None:
    pl.seed_everything(seed, verbose=False)
    trainer = make_trainer(tmp_path, [watch], "fp16", scaler={"init_scale": 2.0**8}, max_steps=max_steps)
    trainer.fit(PlateauExpSoftmax(offset), DataLoader(random_labels(seed), batch_size=32, shuffle=True))


def _alarms(watch: AmpWatch) -> list[Any]:
    return [d for d in watch.diagnoses if d.is_alarm]


def test_a_float16_overflow_on_a_plateau_is_not_renamed_on_the_noise_of_a_lower_lr_replay(tmp_path: Path) -> None:
    """Before: FP32 at the full LR "did not fall" (1.365 -> 1.413, noise) and the 0.1x-LR replay "fell" (1.365 ->
    1.333, noise as well), so the learning rate was called the cause and the overflow renamed FP32_UNSTABLE."""
    watch = AmpWatch(verbose=False)
    _fit(tmp_path, watch, seed=3, offset=8.5, max_steps=80)
    [d] = _alarms(watch)
    ev = d.evidence
    assert d.finding is Finding.FORWARD_OVERFLOW and ev["trajectory_verdict"] == "amp_confirmed"
    # the situation that renamed it: FP32 at the full LR stays at the level and does not train down ...
    # (through the alarm's step: the replays now run a few steps past it, on the window's batches again)
    through = d.step - ev["trajectory_window"][0] + 1
    fp32, lower = ev["trajectory_fp32_losses"][:through], ev["lower_lr_losses"][:through]
    level = ev["loss_reference"]
    assert level is not None and max(fp32) < 1.25 * level and statistics.median(fp32[-3:]) >= fp32[0]
    # ... while the lower-LR replay trains clean and ends a little under where it began: not a decisive fall
    assert sum(ev["lower_lr_skipped"]) <= 1 and statistics.median(lower[-3:]) < lower[0]
    assert ev["lower_lr_verdict"] == "inconclusive" and "inconclusive" in ev["lower_lr_reason"]
    assert ev["lower_lr_margin"] == pytest.approx(0.1)
    assert "not an AMP fault" not in ev["control_verdict"]
    assert "superseded_amp_evidence" not in ev


def test_a_remedy_on_a_plateau_is_judged_by_tracking_fp32_step_by_step_not_by_its_noise(tmp_path: Path) -> None:
    """Before: with no healthy level yet (the overflow comes at step 2), FP32 replayed over the remedied steps
    "trained down" by a few percent, its median became the reference and the remedy read as recovered on that
    noise. Now a run with no level is held to FP32 from the same state on the same batches, step by step (the noise
    cancels), within the stated tolerance: on a plateau it holds where FP32 holds, and that is said."""
    watch = AmpWatch(verbose=False, remediate=True)
    _fit(tmp_path, watch, seed=0, offset=8.7, max_steps=40)
    [d] = [d for d in watch.diagnoses if d.remedy]
    assert d.finding is Finding.FORWARD_OVERFLOW and d.evidence["loss_reference"] is None
    recovery = d.evidence["recovery"]
    assert d.outcome == "recovered", recovery["reason"]
    assert "tracks FP32 training from the same state" in recovery["reason"]
    assert "within the 10% allowed" in recovery["reason"] and "holds" in recovery["reason"]
    assert "trains down" not in recovery["reason"]  # a few percent on a plateau is no fall
    assert recovery["loss_ratio"] <= 1.1


def test_a_remedy_on_a_plateau_held_to_a_tighter_tolerance_is_not_called_recovered(tmp_path: Path) -> None:
    """The same run, with the tolerance tightened below what it tracks FP32 by: not recovered, never verified."""
    watch = AmpWatch(verbose=False, remediate=True, thresholds=Thresholds(track_tolerance=1e-4))
    _fit(tmp_path, watch, seed=0, offset=8.7, max_steps=40)
    assert all(x.outcome != "recovered" for x in watch.diagnoses)


@pytest.mark.parametrize("max_steps", [34, 36])
def test_a_run_that_ends_while_its_remedy_is_watched_says_it_was_not_verified(tmp_path: Path, max_steps: int) -> None:
    """Before: the watch was dropped and the record said nothing of its outcome."""
    watch = AmpWatch(verbose=False, remediate=True)
    _fit(tmp_path, watch, seed=2, offset=8.7, max_steps=max_steps)
    [d] = [d for d in watch.diagnoses if d.remedy]
    assert d.outcome == "not_verified"
    ran = max_steps - watch.applied[0].step
    assert 0 < ran < 8
    assert d.evidence["recovery"]["reason"] == (
        f"the run ended {ran} optimizer step{'s' if ran != 1 else ''} after the remedy, before the 8 its recovery is "
        "judged over")


def test_the_margin_is_the_users_threshold(tmp_path: Path) -> None:
    """``Thresholds.lr_cause_margin`` reaches the verdict: at 1% the same plateau noise passes for a cause (which is
    why the default asks for 10%)."""
    watch = AmpWatch(verbose=False, thresholds=Thresholds(lr_cause_margin=0.01))
    _fit(tmp_path, watch, seed=3, offset=8.5, max_steps=80)
    [d] = _alarms(watch)
    assert d.evidence["lower_lr_margin"] == pytest.approx(0.01)
    assert d.evidence["lower_lr_verdict"] == "lr_is_the_cause"
