"""A fault FP32 has too gets no precision fix, measured or applied (a model of our own: SGD with momentum warmed up
to a peak learning rate that FP32 does not survive either; real float16 autocast and a real GradScaler on the CPU).
Measured without AmpWatch: FP32 climbs from the warmup's later steps on, and the same run at a tenth of the peak
trains down. AmpWatch once replayed a scale search there, "cured" the skips with it, and applied lower_init_scale
(2**16 -> 2**16, a change in name only) before the lower LR."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from conftest import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding


class Warmed(pl.LightningModule):
    def __init__(self, peak: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
        self.peak = peak

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.peak, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(steps: int = 50, batch: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(steps * batch, 20, generator=g)
    y = x[:, :5].sum(1) + 0.1 * torch.randn(x.shape[0], generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def test_a_peak_lr_fp32_does_not_survive_gets_the_lower_lr_and_no_precision_fix(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(remediate="all", verbose=False, log_dir=str(tmp_path / "log"))
    make_trainer(tmp_path, [watch], "fp16", max_steps=50).fit(Warmed(peak=0.3), data())
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert [d.finding for d in alarms] == [Finding.LR_SCHEDULE], [(d.finding, d.step) for d in alarms]
    [d] = alarms
    assert d.remedy == "reduce_lr" and "remedies_tried" not in d.evidence, d.evidence.get("remedies_tried")
    assert "fails too" in d.evidence["control_verdict"]
    lines = " ".join(d.evidence["interventions"]) if isinstance(d.evidence["interventions"], list) \
        else str(d.evidence["interventions"])
    assert "lower loss scale" in lines and "FP32 training fails over the same steps" in lines, lines
    assert "2**1 clean" not in lines and "safe scale" not in lines, lines  # no scale search was replayed
    assert d.outcome == "recovered", d.evidence.get("recovery")
