"""AmpWatch in a real Trainer on the CPU: true float16 autocast, a real GradScaler, faults from real mechanisms.

Each finding comes from a scenario in :mod:`lightning_ampwatch.scenarios` (or a small model here) whose fault is
produced by the actual arithmetic; the tests assert what the user sees: the finding, its onset, the advice,
the console panel and the JSON line in ``<default_root_dir>/ampwatch/diagnoses.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_ampwatch import AmpWatch, AmpWatchError, Diagnosis, Finding, Thresholds
from lightning_ampwatch.machine import AmpStateMachine, Observation
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, build_trainer, regression_data

from conftest import make_trainer


def fit_scenario(name: str, root: Path, watch: AmpWatch, model: pl.LightningModule | None = None,
                 extra_callbacks: tuple[Any, ...] = (), ckpt_path: str | None = None,
                 **overrides: Any) -> pl.Trainer:
    """Like ``scenarios.run_scenario`` but hands back the trainer, so tests can look at its step count."""
    scenario = SCENARIOS[name]
    pl.seed_everything(0, verbose=False)
    model = model if model is not None else scenario.model()
    trainer = build_trainer(scenario, [watch, *extra_callbacks], str(root), **overrides)
    trainer.fit(model, scenario.dataloader(), ckpt_path=ckpt_path)
    return trainer


def event_log(root: Path) -> list[dict[str, Any]]:
    path = root / "ampwatch" / "diagnoses.jsonl"
    assert path.is_file(), f"no event log at {path}"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def alarms(watch: AmpWatch) -> list[Diagnosis]:
    return [d for d in watch.diagnoses if d.is_alarm]


@pytest.fixture
def rank_zero_info() -> Any:
    """The messages AmpWatch says once through Lightning's rank-zero logger."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = Collect(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield messages
    logger.removeHandler(handler)
    logger.setLevel(level)


# ------------------------------------------------------------------------------------------ one test per finding

FINDING_CASES = [
    # scenario, finding, earliest onset, latest onset, words the advice must hold
    pytest.param("gradient_overflow", Finding.GRADIENT_OVERFLOW, 0, 0, ["GradScaler(init_scale=2**"],
                 id="gradient_overflow-startup"),
    # the gradients pass float16 at the default scale, but a scale below 1 replays the window clean: the advice names
    # it (it used to send the user to bf16 by a rule, "no scale can help", that the replays disprove; the scale it
    # names is held to ten clean steps of a fresh run in test_a_replayed_safe_scale_holds_for_ten_real_steps)
    pytest.param("scale_collapse", Finding.GRADIENT_OVERFLOW, 0, 0, ["GradScaler(init_scale=2**-"],
                 id="gradient_overflow-collapse"),
    pytest.param("growth_overflow", Finding.GROWTH_OVERFLOW, 2, 12, ["growth_interval=30", "growth_factor="],
                 id="growth_overflow"),
    pytest.param("lr_schedule", Finding.LR_SCHEDULE, 30, 36, ["(0.02 -> 0.8)"], id="lr_schedule"),
    pytest.param("nan_data", Finding.DATA_NONFINITE, 6, 6, ["rows [8]"], id="data_nonfinite"),
    pytest.param("input_range", Finding.INPUT_RANGE, 0, 0, ["65504"], id="input_range"),
    pytest.param("forward_overflow", Finding.FORWARD_OVERFLOW, 0, 0, ["autocast"], id="forward_overflow"),
    pytest.param("fp32_unstable", Finding.FP32_UNSTABLE, 1, 39, ["learning rate"], id="fp32_unstable"),
]


@pytest.mark.parametrize("scenario, finding, first, last, advice_words", FINDING_CASES)
def test_scenario_is_diagnosed_end_to_end(scenario: str, finding: Finding, first: int, last: int,
                                         advice_words: list[str], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch()
    trainer = fit_scenario(scenario, tmp_path, watch)

    found = alarms(watch)
    named = [d for d in found if d.finding is finding]
    assert named, f"{scenario}: no {finding.value}; diagnoses: {watch.diagnoses}"
    diagnosis = named[0]
    assert first <= diagnosis.step <= last, diagnosis
    for words in advice_words:
        assert words in diagnosis.advice, diagnosis.advice
    assert len(named) == 1  # one alarm for the one fault: announced once, not every step

    out = capsys.readouterr().out
    assert f"AmpWatch: {finding.value} at step {diagnosis.step}" in out
    assert out.count(f"AmpWatch: {finding.value} at step") == 1

    logged = event_log(tmp_path)
    assert [Diagnosis.from_dict(line) for line in logged] == watch.diagnoses
    assert logged[watch.diagnoses.index(diagnosis)]["finding"] == finding.value
    assert trainer.global_step == SCENARIOS[scenario].max_steps  # "warn" lets the run go on


def test_startup_overflow_advice_names_the_scale_the_real_scaler_settled_at(
        tmp_path: Path, observations: list[Observation]) -> None:
    watch = AmpWatch()
    fit_scenario("gradient_overflow", tmp_path, watch)
    diagnosis = alarms(watch)[0]
    assert diagnosis.evidence["pattern"] == "startup"
    skipped = [o for o in observations if o.skipped]
    first_taken = next(o for o in observations if not o.skipped)
    assert [o.step for o in skipped[: first_taken.step]] == list(range(first_taken.step))  # a streak from step 0
    assert diagnosis.evidence["init_scale"] == 2.0**16
    # the safe scale is measured over the replayed window, not read off the one step where the scaler first got
    # through: never above that step's scale (which the window's later steps may still overflow)
    safe = diagnosis.evidence["safe_scale"]
    assert safe <= first_taken.scale and "replayed" in diagnosis.evidence["safe_scale_from"]
    assert f"init_scale=2**{int(math.log2(safe))}" in diagnosis.advice


def _skips_from(name: str, root: Path, init_scale: float, steps: int) -> int:
    """The scaler's skips over a fresh run's first ``steps`` steps started at ``init_scale``, without AmpWatch: each
    skip halves the scale (growth_interval is far longer than the run)."""
    scales: list[float] = []

    class Scales(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            scales.append(trainer.precision_plugin.scaler.get_scale())

    scenario = SCENARIOS[name]
    pl.seed_everything(0, verbose=False)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))
    trainer = build_trainer(scenario, [Scales()], str(root), max_steps=steps, plugins=[plugin])
    trainer.fit(scenario.model(), scenario.dataloader())
    return sum(b < a for a, b in zip([init_scale, *scales], scales))


@pytest.mark.parametrize("name", ["gradient_overflow", "scale_collapse"])
def test_a_replayed_safe_scale_holds_for_ten_real_steps(tmp_path: Path, name: str) -> None:
    watch = AmpWatch(verbose=False)
    fit_scenario(name, tmp_path / "watched", watch)
    safe = alarms(watch)[0].evidence["safe_scale"]
    assert f"init_scale=2**{int(math.log2(safe))}" in alarms(watch)[0].advice
    # the truth, measured without AmpWatch: started at the advised scale, the run skips nothing in ten steps
    assert _skips_from(name, tmp_path / "fresh", safe, steps=10) == 0
    # and the scale the scaler started at did skip (the advice changes something)
    assert _skips_from(name, tmp_path / "default", 2.0**16, steps=10) > 0


def test_healthy_fp16_run_reports_normal_scaling_once_and_no_alarm(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch()
    trainer = fit_scenario("healthy", tmp_path, watch)
    assert [d.finding for d in watch.diagnoses] == [Finding.NORMAL_SCALING]
    assert not watch.diagnoses[0].is_alarm
    assert watch.machine is not None and watch.machine.steps_seen == trainer.global_step == 40
    out = capsys.readouterr().out
    assert out.count("AmpWatch: NORMAL_SCALING at step") == 1
    assert [line["finding"] for line in event_log(tmp_path)] == ["NORMAL_SCALING"]


# ------------------------------------------------------------------------------------------ other precisions


def test_bf16_mixed_healthy_run_has_no_alarm(tmp_path: Path, rank_zero_info: list[str]) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch()
    trainer = make_trainer(tmp_path, [watch], precision="bf16-mixed", max_steps=12)
    trainer.fit(Regressor(), torch.utils.data.DataLoader(regression_data(), batch_size=32))
    assert watch.diagnoses == []
    assert watch.machine is not None and watch.machine.mode.value == "bf16"
    assert watch.machine.steps_seen == trainer.global_step == 12
    assert watch.machine.nonfinite_total == 0
    assert sum("no scale to watch" in m for m in rank_zero_info) == 1


def test_fp32_healthy_run_says_once_there_is_no_scaler(tmp_path: Path, rank_zero_info: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch()
    trainer = make_trainer(tmp_path, [watch], precision="32-true", max_steps=40)  # 16 batches an epoch: 3 epochs
    trainer.fit(Regressor(), torch.utils.data.DataLoader(regression_data(), batch_size=32))
    assert watch.diagnoses == []
    assert watch.machine is not None and watch.machine.steps_seen == trainer.global_step == 40
    said = [m for m in rank_zero_info if "no loss scaler to watch" in m]
    assert len(said) == 1 and said[0].startswith("AmpWatch:")
    assert "at step" not in capsys.readouterr().out  # no diagnosis panel


# ------------------------------------------------------------------------------------------ training loop shapes


class RecordingRegressor(Regressor):
    """Remembers each micro-batch loss (read here, in the test's model, never by the callback)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.micro_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.micro_losses.append(float(loss.detach().float()))
        return loss


def test_gradient_accumulation_observes_each_optimizer_step_once(tmp_path: Path,
                                                                 observations: list[Observation]) -> None:
    watch = AmpWatch(control_replay=False, localize=False)  # no replays: the model sees each micro-batch once
    model = RecordingRegressor(lr=1e-4, reduction="sum")  # the gradient_overflow model
    trainer = fit_scenario("gradient_overflow", tmp_path, watch, model=model, max_steps=20,
                           accumulate_grad_batches=4)
    assert watch.machine is not None
    assert watch.machine.steps_seen == trainer.global_step == 20
    assert [o.step for o in observations] == list(range(20))
    assert len(model.micro_losses) == 80

    skipped = [o for o in observations if o.skipped]
    assert skipped, "the default scale should overflow these gradients"
    for obs in skipped:
        micro = model.micro_losses[4 * obs.step: 4 * obs.step + 4]
        # Lightning divides each micro-batch loss by 4 before backward: the step's loss is their mean
        assert obs.loss == pytest.approx(sum(micro) / 4, rel=1e-5), (obs.step, micro)
    assert alarms(watch)[0].finding is Finding.GRADIENT_OVERFLOW
    assert alarms(watch)[0].step == 0


class ManualRegressor(Regressor):
    """Manual optimization: its own zero_grad / manual_backward / step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y, reduction=self.reduction)
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_fault_is_detected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    watch = AmpWatch()
    trainer = fit_scenario("gradient_overflow", tmp_path, watch, model=ManualRegressor(lr=1e-4, reduction="sum"),
                           max_steps=30)
    assert watch.machine is not None and watch.machine.steps_seen == trainer.global_step == 30
    diagnosis = alarms(watch)[0]
    assert diagnosis.finding is Finding.GRADIENT_OVERFLOW and diagnosis.step == 0
    assert "init_scale=2**" in diagnosis.advice
    assert "AmpWatch: GRADIENT_OVERFLOW at step 0" in capsys.readouterr().out


class TwoOptimizerRegressor(Regressor):
    """Manual optimization with two optimizers stepped in turn on each batch, as a GAN steps its two."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        for opt in self.optimizers():
            opt.zero_grad()
            self.manual_backward(nn.functional.mse_loss(self(x), y))
            opt.step()

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.encoder.parameters(), lr=self.lr),
                torch.optim.SGD(self.head.parameters(), lr=self.lr))


@pytest.mark.parametrize("remediate", [False, True])
def test_a_nan_batch_under_two_optimizers_is_the_datas_fault(tmp_path: Path, remediate: bool) -> None:
    """The first optimizer's step of a batch is judged with that batch: its NaN rows are named, the finding is the
    data's, and no precision remedy is applied or called a fix (it once read as a FORWARD_OVERFLOW, which
    bf16_fallback was then said to fix)."""
    watch = AmpWatch(verbose=False, remediate=remediate)
    fit_scenario("nan_data", tmp_path, watch, model=TwoOptimizerRegressor(), max_steps=24)
    found = alarms(watch)
    assert found and all(d.finding is Finding.DATA_NONFINITE for d in found), [d.finding for d in found]
    assert found[0].evidence["nonfinite_where"].startswith("batch[0] rows")
    assert watch.applied == [] and all(d.remedy is None and d.outcome is None for d in watch.diagnoses)


class MaskedRegressor(Regressor):
    """Each batch carries an additive attention-style mask whose masked entries are -inf, as transformer batches
    do; the model uses it through a softmax, so it never makes anything non-finite, in any precision."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, mask = batch
        return super().training_step((x * torch.softmax(mask, -1) * x.shape[-1], y), batch_idx)


def _masked(data: torch.utils.data.TensorDataset) -> torch.utils.data.DataLoader:
    x, y = data.tensors
    mask = torch.zeros_like(x)
    mask[:, ::3] = float("-inf")
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, mask), batch_size=32)


@pytest.mark.parametrize("scenario, model, finding", [
    ("gradient_overflow", lambda: MaskedRegressor(lr=1e-4, reduction="sum"), Finding.GRADIENT_OVERFLOW),
    ("forward_overflow", lambda: MaskedRegressor(attention=True), Finding.FORWARD_OVERFLOW),
])
def test_a_minus_inf_mask_in_the_batch_does_not_make_an_amp_fault_the_datas(
        tmp_path: Path, scenario: str, model: Any, finding: Finding) -> None:
    """-inf entries that never reach the loss are not what went wrong: a finite loss that overflowed its gradients
    is a gradient overflow, and a loss that went non-finite only at float16, the float32 control finite on the same
    batch, is a forward overflow in the module that did it (both once read as DATA_NONFINITE, "changing the
    precision will not help")."""
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = build_trainer(SCENARIOS[scenario], [watch], str(tmp_path), max_steps=12)
    trainer.fit(model(), _masked(SCENARIOS[scenario].dataloader().dataset))
    first = alarms(watch)[0]
    assert first.finding is finding, (first.finding, first.evidence)
    assert not any(d.finding is Finding.DATA_NONFINITE for d in watch.diagnoses)
    if finding is Finding.FORWARD_OVERFLOW:
        assert first.location == "attention"
        assert "control finite although the batch holds non-finite values" in first.evidence["control_verdict"]


class _ExpAttention(nn.Module):
    """Attention that takes exp() of raw scores, returning (output, weights) as many attention modules do."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = (self.q(x).unsqueeze(2) * self.k(x).unsqueeze(1) + mask).exp()  # a float32 mask: exp in float32
        w = w / w.sum(-1, keepdim=True)
        return (w @ self.v(x).unsqueeze(-1)).squeeze(-1), w


class _AttentionRegressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.attn, self.head = _ExpAttention(16), nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.attn(self.enc(x), torch.zeros(16, 16))[0]
        return nn.functional.mse_loss(self.head(h).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def test_a_withdrawn_normal_scaling_names_the_alarm_as_published(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A skip at step 1 is called normal scaling; an alarm begins within the window and the FP32 control renames
    it: the withdrawal names the alarm by the name it was published with, and the summary says it was withdrawn
    (it once named the machine's first guess, and the summary still called the skip "normal")."""
    torch.manual_seed(0)
    watch = AmpWatch(remediate=True)
    trainer = build_trainer(SCENARIOS["forward_overflow"], [watch], str(tmp_path), max_steps=30)
    trainer.fit(_AttentionRegressor(), torch.utils.data.DataLoader(regression_data(n=256, x_scale=18.0),
                                                                  batch_size=32))
    out = " ".join(capsys.readouterr().out.split())
    (call,) = [d for d in watch.diagnoses if d.finding is Finding.NORMAL_SCALING]
    assert call.withdrawn
    published = {(d.finding.value, d.step) for d in alarms(watch)}
    assert (call.evidence["withdrawn_by"], call.evidence["withdrawn_at"]) in published, (call.evidence, published)
    assert call.evidence["withdrawn_by"] != "FORWARD_OVERFLOW"  # the control renamed the machine's first guess
    assert f"step {call.step} NORMAL_SCALING (withdrawn: a {call.evidence['withdrawn_by']} episode followed)" in out


class DictRegressor(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": super().training_step(batch, batch_idx), "batch_idx": torch.tensor(batch_idx)}


def test_dict_returning_training_step(tmp_path: Path, observations: list[Observation]) -> None:
    watch = AmpWatch()
    trainer = fit_scenario("gradient_overflow", tmp_path, watch, model=DictRegressor(lr=1e-4, reduction="sum"),
                           max_steps=20)
    assert watch.machine is not None and watch.machine.steps_seen == trainer.global_step == 20
    assert alarms(watch)[0].finding is Finding.GRADIENT_OVERFLOW
    assert all(o.loss is not None and o.loss > 0 for o in observations if o.skipped)


class SometimesNoneRegressor(Regressor):
    """Returns None (Lightning skips backward and the step) on every third batch."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        if batch_idx % 3 == 1:
            return None
        return super().training_step(batch, batch_idx)


def test_none_returning_training_step_is_not_counted(tmp_path: Path, observations: list[Observation]) -> None:
    watch = AmpWatch()
    model = SometimesNoneRegressor(lr=1e-2)
    trainer = fit_scenario("healthy", tmp_path, watch, model=model, max_steps=30)
    assert watch.machine is not None
    batches = trainer.fit_loop.epoch_loop.batch_progress.total.completed
    real_steps = sum(1 for i in range(batches) if (i % 16) % 3 != 1)  # 16 batches per epoch
    assert watch.machine.steps_seen == len(observations) == real_steps
    assert real_steps < batches
    assert alarms(watch) == []


# ------------------------------------------------------------------------------------------ on_unrecoverable


def test_on_unrecoverable_stop_ends_the_run_early(tmp_path: Path, rank_zero_info: list[str]) -> None:
    watch = AmpWatch(on_unrecoverable="stop")
    trainer = fit_scenario("gradient_overflow", tmp_path, watch)
    diagnosis = alarms(watch)[0]
    assert diagnosis.finding is Finding.GRADIENT_OVERFLOW
    assert trainer.global_step < SCENARIOS["gradient_overflow"].max_steps
    assert trainer.global_step <= diagnosis.step + 20
    assert any("on_unrecoverable='stop'" in m for m in rank_zero_info)
    assert event_log(tmp_path)[0]["finding"] == "GRADIENT_OVERFLOW"


def test_on_unrecoverable_raise_carries_the_diagnosis(tmp_path: Path) -> None:
    watch = AmpWatch(on_unrecoverable="raise", verbose=False)
    with pytest.raises(AmpWatchError) as err:
        fit_scenario("nan_data", tmp_path, watch)
    assert err.value.diagnosis is not None
    assert err.value.diagnosis.finding is Finding.DATA_NONFINITE
    assert err.value.diagnosis.step == 6
    assert "DATA_NONFINITE at step 6" in str(err.value)
    assert event_log(tmp_path)[0]["finding"] == "DATA_NONFINITE"  # logged before raising


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs, names", [
    ({"remediate": "lower_the_scale"}, ["'lower_the_scale'", "lower_init_scale", "bf16_fallback"]),
    ({"remediate": ["slow_growth", "magic"]}, ["'magic'", "slow_growth"]),
    ({"remediate": 3}, ["remediate=3", "True", "False"]),
    ({"on_unrecoverable": "explode"}, ["'explode'", "'warn'", "'stop'", "'raise'"]),
    ({"control_replay": "yes"}, ["control_replay='yes'", "True or False"]),
    ({"localize": 1}, ["localize=1", "True or False"]),
    ({"hold_lr_on_skip": None}, ["hold_lr_on_skip=None", "True or False"]),
    ({"verbose": "loud"}, ["verbose='loud'", "True or False"]),
    ({"thresholds": {"streak": 2}}, ["thresholds={'streak': 2}", "Thresholds"]),
])
def test_invalid_constructor_arguments_name_the_value_and_the_valid_ones(kwargs: dict[str, Any],
                                                                         names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        AmpWatch(**kwargs)
    for name in names:
        assert name in str(err.value), str(err.value)


def test_valid_constructor_arguments_are_accepted() -> None:
    watch = AmpWatch(remediate=["slow_growth", "reduce_lr"], on_unrecoverable="stop", control_replay=False,
                     localize=False, hold_lr_on_skip=True, verbose=False, thresholds=Thresholds(streak=6))
    assert watch.remedies == {"slow_growth", "reduce_lr"}
    assert "reduce_lr" not in AmpWatch(remediate=True).remedies
    assert AmpWatch(remediate=False).remedies == frozenset()


# ------------------------------------------------------------------------------------------ failure containment


def test_internal_failure_is_warned_once_and_training_finishes(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: AmpStateMachine, obs: Observation) -> list[Diagnosis]:
        raise RuntimeError("synthetic failure inside the machine")

    monkeypatch.setattr(AmpStateMachine, "observe", broken)
    watch = AmpWatch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit_scenario("gradient_overflow", tmp_path, watch, max_steps=30)
    ours = [w for w in caught if "AmpWatch" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert issubclass(ours[0].category, RuntimeWarning)
    assert "synthetic failure inside the machine" in str(ours[0].message)
    assert trainer.global_step == 30
    assert trainer.state.finished
    assert watch.diagnoses == []


# ------------------------------------------------------------------------------------------ checkpoint + resume


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_resume_restores_diagnoses_and_does_not_reannounce(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            observations: list[Observation]) -> None:
    # scale_collapse: every step overflows; the alarm comes once the scale is below 1 (~step 17) and the
    # episode is still open when the checkpoint is written, so a machine that forgot it would announce again.
    ckpt_dir = tmp_path / "ckpt"
    first = AmpWatch()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=22, save_top_k=-1)
    trainer = fit_scenario("scale_collapse", tmp_path, first, max_steps=22, enable_checkpointing=True,
                           extra_callbacks=(checkpoint,))
    assert [d.finding for d in first.diagnoses] == [Finding.GRADIENT_OVERFLOW]
    assert first.machine is not None and first.machine.episode is not None
    scale_at_checkpoint = trainer.precision_plugin.scaler.get_scale()
    assert capsys.readouterr().out.count("AmpWatch: GRADIENT_OVERFLOW") == 1
    (path,) = ckpt_dir.glob("*.ckpt")
    observations.clear()

    second = AmpWatch()
    same_checkpointing = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=22, save_top_k=-1)
    resumed = fit_scenario("scale_collapse", tmp_path, second, max_steps=30, ckpt_path=str(path),
                           enable_checkpointing=True, extra_callbacks=(same_checkpointing,))
    assert resumed.global_step == 30
    assert second.diagnoses == first.diagnoses
    assert "AmpWatch: GRADIENT_OVERFLOW" not in capsys.readouterr().out
    assert [line["finding"] for line in event_log(tmp_path)] == ["GRADIENT_OVERFLOW"]
    assert second.machine is not None
    assert second.machine.steps_seen == 30
    assert second.machine.skipped_total == first.machine.skipped_total + sum(o.skipped for o in observations)
    # the resumed watch carries on from the scaler's restored scale, not from the default 2**16
    assert [o.step for o in observations][0] == 22
    assert observations[0].scale == scale_at_checkpoint


@pytest.mark.parametrize("remediate", [False, True])
def test_a_nan_batch_inside_a_start_up_overflow_hides_neither_fault(tmp_path: Path, remediate: bool) -> None:
    """The scaler skips the first steps (its scale is too high for the summed loss) and the third batch holds a NaN
    row: both are named, the overflow from step 0 and the data at step 2 (the data's episode once hid the
    overflow), and the overflow's trajectory replay is not run over the NaN batch (FP32 training would take the NaN
    in and blame the optimisation)."""
    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, remediate=remediate)
    trainer = build_trainer(SCENARIOS["gradient_overflow"], [watch], str(tmp_path), max_steps=40)
    trainer.fit(Regressor(lr=1e-4, reduction="sum"),
                torch.utils.data.DataLoader(regression_data(y_scale=4.0, nan_rows=(70,)), batch_size=32))
    found = {(d.finding, d.step) for d in alarms(watch)}
    assert {(Finding.GRADIENT_OVERFLOW, 0), (Finding.DATA_NONFINITE, 2)} <= found, found
    assert not any(d.finding is Finding.FP32_UNSTABLE for d in watch.diagnoses)
    overflow = next(d for d in watch.diagnoses if d.finding is Finding.GRADIENT_OVERFLOW)
    if remediate:
        assert overflow.remedy == "lower_init_scale"
        assert "the batch of step 2 holds NaN/inf" in overflow.evidence["trajectory_control"]


class RaisesWhenReplayed(Regressor):
    """A training_step that refuses a batch it has already seen (a user's own bookkeeping): a replay makes it raise."""

    def __init__(self) -> None:
        super().__init__(attention=True)
        self.seen: set[int] = set()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        key = self.current_epoch * 10_000 + batch_idx
        if key in self.seen:
            raise RuntimeError("batch seen twice")
        self.seen.add(key)
        return super().training_step(batch, batch_idx)


def test_a_training_step_that_raises_in_a_replay_is_said_as_the_users_code_not_an_internal_error(
        tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watch = AmpWatch(verbose=False)
        fit_scenario("forward_overflow", tmp_path, watch, model=RaisesWhenReplayed())
    said = [str(w.message) for w in caught if "AmpWatch" in str(w.message)]
    assert not any("internal error" in s for s in said), said
    assert any("through RaisesWhenReplayed.training_step, which raised RuntimeError: batch seen twice" in s
               for s in said), said
    assert alarms(watch)[0].finding is Finding.FORWARD_OVERFLOW  # the step's own measurements stand
