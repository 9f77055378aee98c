"""Two optimizers sharing one GradScaler (issue 30): a GAN in manual optimization, its generator and discriminator
stepped through Lightning's one scaler, in true float16 on the CPU.

The model is a least-squares GAN whose real data are in raw units (tens, not normalised): the discriminator's
gradients on them are large, so the scaler skips every discriminator step from the start and halves the scale each
time, while the generator's steps go through at every one of those scales. Truth (measured without AmpWatch by the
step hooks below, 40 optimizer steps): the generator's first step is skipped at 2**16; the discriminator's steps are
skipped at every scale from 2**15 down to 2**5 (11 skips) and go through from 2**4 on. Before the fix, AmpWatch
advised the scale the generator had passed at (2**14: the largest scale at which ANY step went through), at which
every discriminator step is skipped again.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import AmpWatch, Finding
from lightning_ampwatch.machine import AmpStateMachine, Observation

STEPS = 40  # optimizer steps: 20 batches, a generator step then a discriminator step in each


class LsGan(pl.LightningModule):
    """A small least-squares GAN, written as users write one: manual optimization, one optimizer per network."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.disc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        (real,) = batch
        fake = self.gen(torch.randn(real.shape[0], 8, device=real.device))
        g_loss = ((self.disc(fake) - 1) ** 2).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = ((self.disc(real) - 1) ** 2).mean() + (self.disc(fake.detach()) ** 2).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.gen.parameters(), lr=1e-3), torch.optim.Adam(self.disc.parameters(), lr=1e-3)


def real_data(n: int = 1024, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset((torch.randn(n, 16, generator=g) * 3 + 1) * 30), batch_size=32)


class OptimizerSteps(pl.Callback):
    """Each optimizer step as it ran, apart from AmpWatch: (optimizer index, the scaler's scale, whether the scaler
    let it through: its step post-hook runs only then)."""

    def __init__(self) -> None:
        self.steps: list[list[Any]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        for opt in trainer.optimizers:
            opt.register_step_post_hook(lambda *_: self.steps[-1].__setitem__(2, True))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        index = next(i for i, o in enumerate(trainer.optimizers) if o is optimizer)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.steps.append([index, float(scaler.get_scale()) if scaler is not None else None, False])

    def skipped(self, index: int) -> list[float]:
        """The scales at which that optimizer's steps were skipped."""
        return [scale for i, scale, taken in self.steps if i == index and not taken]

    def taken(self, index: int) -> list[float]:
        return [scale for i, scale, taken in self.steps if i == index and taken]


def fit(tmp_path: Path, callbacks: list[Any], steps: int = STEPS, init_scale: float = 2.0 ** 16) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         plugins=[MixedPrecision("16-mixed", "cpu",
                                                 scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))],
                         callbacks=callbacks)
    trainer.fit(LsGan(), real_data())
    return trainer


def _panel_text(out: str) -> str:
    """The panels printed, their box and line breaks taken out (a long row wraps)."""
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", out))


def test_the_safe_scale_is_the_discriminators_own_and_holds_for_the_next_10_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    steps, watch = OptimizerSteps(), AmpWatch()
    fit(tmp_path / "run", [steps, watch])
    out = _panel_text(capsys.readouterr().out)
    # the truth, as the run itself had it: the discriminator skipped at every scale from 2**15 down, while the
    # generator stepped at those scales
    d_skipped, g_taken = steps.skipped(1), steps.taken(0)
    assert len(d_skipped) >= 8 and max(d_skipped) == 2.0 ** 15
    assert all(scale in g_taken for scale in d_skipped[1:])
    [alarm] = [d for d in watch.diagnoses if d.is_alarm]
    ev = alarm.evidence
    assert alarm.finding is Finding.GRADIENT_OVERFLOW
    safe = ev["safe_scale"]
    # before: 2**14, the largest scale at which the generator stepped, where every discriminator step was skipped
    assert safe < min(d_skipped) and safe in steps.taken(1)
    assert ev["pattern"] == "startup" and ev["optimizer"] == 1
    assert safe == steps.taken(1)[0]  # the scale the discriminator first stepped at
    assert f"init_scale=2**{int(math.log2(safe))}) instead of 2**16" in alarm.advice  # the scaler's own start
    assert ev["safe_scale_from"].startswith("the scale optimizer 1 first stepped at without a skip")
    line = (f"optimizer 1 (Adam over disc.*) skipped its first {len(d_skipped)} steps, at every scale from 2**15 "
            f"down to 2**{int(math.log2(min(d_skipped)))}, while optimizer 0 (Adam over gen.*) stepped")
    assert ev["optimizer_skips"] == line
    assert "the optimizer that skipped" in out and line in out  # the panel names it, in plain words
    assert ev["scale_history"] == d_skipped  # the discriminator's own skips, at the scales they ran at

    # the advice, followed: the same model from the advised scale; the discriminator's steps go through (no growth
    # is tried in 10 batches: the scaler grows after 2000 clean steps)
    again = OptimizerSteps()
    fit(tmp_path / "advised", [again], steps=20, init_scale=safe)
    assert len(again.steps) == 20
    assert again.skipped(1) == []
    assert again.skipped(0) == []


def test_one_optimizer_keeps_the_machines_single_safe_scale_and_an_older_checkpoint_loads() -> None:
    """The per-optimizer records exist only where observations carry an optimizer's index; a machine state written
    before them (no ``optimizers`` entry) loads, and one with them comes back as it was."""
    machine = AmpStateMachine("fp16")
    for step in range(3):
        machine.observe(Observation(step=step, scale=2.0 ** 16))
    assert machine.state.optimizers == {} and machine.max_safe_scale == 2.0 ** 16
    older = machine.state_dict()
    del older["optimizers"]
    restored = AmpStateMachine("fp16")
    restored.load_state_dict(older)
    assert restored.state.optimizers == {} and restored.max_safe_scale == 2.0 ** 16

    gan = AmpStateMachine("fp16")
    scale = 2.0 ** 16
    for batch in range(6):  # the generator steps, the discriminator skips, at each scale
        gan.observe(Observation(step=2 * batch, scale=scale, optimizer=0))
        gan.observe(Observation(step=2 * batch + 1, scale=scale, skipped=True, loss=1.0, loss_finite=True,
                                optimizer=1))
        scale /= 2
    assert [d.finding for d in gan.observe(Observation(step=12, scale=scale, optimizer=0))] == []
    [alarm] = gan.observe(Observation(step=13, scale=scale, optimizer=1))  # its first step through
    assert alarm.finding is Finding.GRADIENT_OVERFLOW and alarm.step == 1
    assert alarm.evidence["optimizer"] == 1 and alarm.evidence["safe_scale"] == scale
    assert gan.max_safe_scale == scale  # where both stepped: what lower_init_scale falls back to
    back = AmpStateMachine("fp16")
    back.load_state_dict(gan.state_dict())
    assert back.state.optimizers == gan.state.optimizers and back.max_safe_scale == scale


def test_a_burst_of_one_optimizers_skips_is_given_the_scale_it_stepped_at_not_anothers() -> None:
    """Later in the run: both optimizers stepped at 2**10, then the generator steps at 2**14 while the
    discriminator's steps are skipped. The burst's safe scale is the discriminator's (2**10), not the 2**14 at which
    the generator went on stepping (the machine's single record of the largest scale any step went through)."""
    gan = AmpStateMachine("fp16")
    gan.optimizer_names = ("Adam over gen.*", "Adam over disc.*")
    alarms = []
    for step in range(20):
        alarms += gan.observe(Observation(step=step, scale=2.0 ** 10, optimizer=step % 2))
    for step in range(20, 28):
        skipped = step % 2 == 1
        alarms += gan.observe(Observation(step=step, scale=2.0 ** (13 if skipped else 14), skipped=skipped,
                                          loss=1.0 if skipped else None, loss_finite=True if skipped else None,
                                          optimizer=step % 2))
    [alarm] = [d for d in alarms if d.is_alarm]
    ev = alarm.evidence
    assert alarm.finding is Finding.GRADIENT_OVERFLOW and ev["pattern"] == "burst" and alarm.step == 21
    assert ev["safe_scale"] == 2.0 ** 10 and ev["optimizer"] == 1
    assert ev["optimizer_skips"] == ("optimizer 1 (Adam over disc.*) skipped 4 steps in a row, at 2**13, while "
                                     "optimizer 0 (Adam over gen.*) stepped; the largest scale it stepped at is 2**10")
    assert "init_scale=2**10" in alarm.advice


def test_remediate_true_sets_the_discriminators_scale_and_its_steps_go_through(tmp_path: Path) -> None:
    """With ``remediate=True`` the start-up row is judged when the discriminator first steps (no replay measures a
    scale under manual optimization; the scaler halves its way down on the discriminator's skips meanwhile), and
    ``lower_init_scale`` holds the scale it stepped at, growing 4x more slowly: no bf16 fallback, and none of the
    discriminator's steps after it is skipped."""
    steps, watch = OptimizerSteps(), AmpWatch(remediate=True, verbose=False)
    fit(tmp_path, [steps, watch])
    [alarm] = [d for d in watch.diagnoses if d.is_alarm]
    [applied] = watch.applied
    assert applied.name.value == "lower_init_scale"
    assert applied.details["scale_after"] == alarm.evidence["safe_scale"] == steps.taken(1)[0]
    after = [row for row in steps.steps[applied.step + 1:]]
    assert len(after) >= 10 and all(taken for _, _, taken in after)


def test_the_two_losses_of_a_gan_are_not_taken_for_one_series(tmp_path: Path) -> None:
    # the generator's and the discriminator's losses alternate step by step: a level or a climb made of both would
    # be meaningless (a false FP32_UNSTABLE, found on a fresh GAN run), so the alarm says why it has no level
    watch = AmpWatch(verbose=False)
    fit(tmp_path / "run", [watch])
    [alarm] = [d for d in watch.diagnoses if d.is_alarm]
    assert alarm.evidence["loss_reference"] is None
    assert alarm.evidence["loss_reference_why"] == (
        "no healthy loss level: each batch steps several optimizers, each on a loss of its own (a GAN's "
        "discriminator and generator), so the losses are not one series to take a level or a climb from")
