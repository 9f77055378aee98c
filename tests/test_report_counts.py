"""The end-of-fit summary and ``ampwatch report`` count what the run counted: with Lightning's default
``log_every_n_steps`` on a run whose length is not a multiple of it, after a bf16 fallback dropped the scaler,
and with the ladder's end said plainly. Real trainings; the console and the files read as a user reads them."""

from __future__ import annotations

import html
import io
import itertools
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, Diagnosis, Finding
from lightning_ampwatch.cli import main
from lightning_ampwatch.report import load_run, locate_run, print_report, render_html, timeline_figure
from lightning_ampwatch.scenarios import ExpAttention, regression_data, run_scenario, true_fp16_plugin
from lightning_ampwatch.summary import RunStats, summary_lines

COUNTS = re.compile(r"(\d+ optimizer steps?[^;]*);")


def summary_counts(out: str) -> str:
    line = next(line for line in out.splitlines() if line.startswith("AmpWatch"))
    match = COUNTS.search(line)
    assert match is not None, line
    return match.group(1)


def report_out(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["report", str(path)]) == 0
    return capsys.readouterr().out


def test_report_counts_equal_the_runs_own_with_the_default_log_every_n_steps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 123 steps, Lightning's default log_every_n_steps=50: the run's last step is no log step, and its healthy
    # row is not among the sampled ones
    watch = run_scenario("gradient_overflow", str(tmp_path), AmpWatch(), max_steps=123, log_every_n_steps=50)
    summary = summary_counts(capsys.readouterr().out)
    assert summary.startswith("123 optimizer steps")
    out = report_out(tmp_path, capsys)
    assert f"  {summary};" in out, out  # the report's header says what the summary said
    _, timeline = load_run(locate_run(tmp_path))
    assert timeline is not None and timeline.steps[-1] < 122  # the case the end counters are for
    assert watch.diagnoses


def test_after_a_bf16_fallback_no_loss_scale_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    watch = run_scenario("input_range", str(tmp_path), AmpWatch(remediate=True), max_steps=23,
                         log_every_n_steps=50)
    assert [a.name.value for a in watch.applied] == ["bf16_fallback"]
    summary = summary_counts(capsys.readouterr().out)
    assert summary.startswith("23 optimizer steps") and "loss scale" not in summary
    out = report_out(tmp_path, capsys)
    assert f"  {summary}, bf16 from step" in out and "loss scale" not in out, out
    # a run that crashed before its end counters were written: the rows alone must not name a scale either
    timeline = tmp_path / "ampwatch" / "timeline.jsonl"
    timeline.write_text("".join(line for line in timeline.read_text().splitlines(keepends=True)
                                if '"event":"end"' not in line))
    out = report_out(tmp_path, capsys)
    assert "optimizer steps" in out and "loss scale" not in out and "bf16 from step" in out, out


def test_summary_lists_the_diagnoses_in_step_order(tmp_path: Path) -> None:
    # a NORMAL_SCALING withdrawn by a later alarm is replaced in place: the list is then out of step order
    alarm = Diagnosis(Finding.FP32_UNSTABLE, 32, advice="Lower the LR.")
    normal = Diagnosis(Finding.NORMAL_SCALING, 0, evidence={"withdrawn": True}, advice="Follow the alarm.")
    lines = summary_lines([alarm, normal], RunStats(50, skipped=6, scale=1024.0, precision="fp16"))
    steps = [int(m.group(1)) for m in map(re.compile(r"^  step +(\d+)").match, lines) if m]
    assert steps == [0, 32]
    assert "loss scale 2**10 at the end" in lines[0]
    bf16 = summary_lines([alarm], RunStats(50, skipped=6, scale=1024.0, precision="bf16"))
    assert "loss scale" not in bf16[0]


def test_the_ladders_end_is_said_plainly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_scenario("lr_schedule", str(tmp_path / "true"), AmpWatch(remediate=True))
    out = capsys.readouterr().out
    assert ('LR_SCHEDULE in head.weight (not fixed: see the advice above; remediate= leaves out its ladder '
            '(reduce_lr), remediate="all" allows it)') in out, out
    # a run unstable in float32 too: each rung of its ladder is tried for an alarm of its own, the third gets none
    watch = run_scenario("fp32_unstable", str(tmp_path / "all"), AmpWatch(remediate="all"))
    out = capsys.readouterr().out
    tried = [d.step for d in watch.diagnoses if d.finding is Finding.FP32_UNSTABLE and d.remedy]
    last = [d for d in watch.diagnoses if d.finding is Finding.FP32_UNSTABLE and not d.remedy]
    assert len(tried) == 2 and last, watch.diagnoses
    where = f" in {last[0].location}" if last[0].location else ""
    # (and where that alarm's weights went non-finite, the line says so after the ladder: issue 30's weights_lost)
    ended = "; the weights now hold NaN/inf)" if last[0].evidence.get("weights_lost") else ")"
    assert (f"{last[0].finding.value}{where} (not fixed: see the advice above; its ladder (reduce_lr, "
            f"reduce_lr) is used up, tried for the alarms at steps {tried[0]}, {tried[1]}{ended}") in out, out


def test_report_table_shows_the_fix_whole_in_a_narrow_terminal(tmp_path: Path) -> None:
    watch = run_scenario("gradient_overflow", str(tmp_path), AmpWatch(verbose=False))
    files = locate_run(tmp_path)
    diagnoses, timeline = load_run(files)
    buffer = io.StringIO()
    print_report(files, diagnoses, timeline, Console(file=buffer, width=80, highlight=False))
    out = buffer.getvalue()
    assert "…" not in out, out
    advice = next(d.advice for d in watch.diagnoses if d.is_alarm)
    header = next(line for line in out.splitlines() if "advice" in line and line.startswith("┃"))
    bars = [i for i, c in enumerate(header) if c == "┃"]
    column = next((a, b) for a, b in zip(bars, bars[1:]) if "advice" in header[a:b])
    cells = "".join(line[column[0] + 1:column[1]] for line in out.splitlines() if line.startswith("│"))
    assert "".join(advice.split()) in "".join(cells.split())  # every character of the fix, in order


def test_html_page_fits_leads_with_the_rows_that_matter_and_names_itself_once(tmp_path: Path) -> None:
    run_scenario("lr_schedule", str(tmp_path), AmpWatch(verbose=False))
    files = locate_run(tmp_path)
    diagnoses, timeline = load_run(files)
    page = tmp_path / "r.html"
    render_html(page, files, diagnoses, timeline)
    text = page.read_text(encoding="utf-8")
    body = text[text.index("<body>"):]
    assert body.count("AmpWatch report") == 1
    assert re.search(r"max-width:(\d+)px", text) and int(re.search(r"max-width:(\d+)px", text).group(1)) <= 1280
    assert "table-layout:fixed" in text and "overflow-wrap:anywhere" in text
    first_key = re.search(r'<table class="evidence"><tr><td>([a-z_0-9]+)</td>', body)
    assert first_key is not None and first_key.group(1) == "lr_event"
    assert body.index("<td>control_verdict</td>") < body.index("<td>batch_idx</td>")  # not alphabetical
    # the fold's count is the rows inside it
    folds = re.findall(r'<details><summary>the other evidence \((\d+) rows?\)</summary><table class="evidence">(.*?)'
                       r'</table></details>', body)
    assert folds and all(int(n) == rows.count("<tr>") for n, rows in folds), folds
    alarm = next(d for d in diagnoses.shown if d.is_alarm)
    assert html.escape(alarm.advice) in body  # the fix whole


def test_plot_labels_at_the_same_step_do_not_collide(tmp_path: Path) -> None:
    # the third alarm and the second remedy fall on one step
    watch = run_scenario("fp32_unstable", str(tmp_path), AmpWatch(remediate="all", verbose=False))
    files = locate_run(tmp_path)
    diagnoses, timeline = load_run(files)
    assert timeline is not None
    fig = timeline_figure(timeline, diagnoses.shown, "t")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.axes[0].texts if t.get_rotation() == 90]
    assert len(labels) >= len(watch.diagnoses) + len(watch.applied) - 1
    steps = sorted(float(t.get_position()[0]) for t in labels)
    assert any(a == b for a, b in zip(steps, steps[1:])), steps  # the case: two labels at one step
    boxes = [t.get_window_extent(renderer) for t in labels]
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b), (a, b)


class _Gan(LightningModule):
    """Manual optimization with two optimizers (generator, then discriminator), one GradScaler: Lightning's
    ``global_step`` counts both optimizers' steps. The discriminator's exp() overflows float16 on the large real
    data, so its own steps are the ones the scaler skips."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.d = nn.Sequential(nn.Linear(16, 16), ExpAttention(16), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        x, _ = batch
        fake = self.g(torch.randn_like(x))
        g_loss = -self.d(fake).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        d_loss = self.d(x).mean() - self.d(fake.detach()).mean()
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.g.parameters(), lr=1e-3), torch.optim.SGD(self.d.parameters(), lr=1e-3)


class _TakenSteps(Callback):
    """Counts, apart from AmpWatch, the optimizer steps the scaler let through (its step post-hook runs only for
    those)."""

    def __init__(self) -> None:
        self.taken = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for opt in trainer.optimizers:
            opt.register_step_post_hook(lambda *_: setattr(self, "taken", self.taken + 1))


def test_a_gans_summary_counts_every_optimizers_steps_as_lightning_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seed_everything(0, verbose=False)
    watch, taken = AmpWatch(), _TakenSteps()
    trainer = Trainer(accelerator="cpu", max_steps=20, plugins=[true_fp16_plugin()], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp_path), callbacks=[watch, taken])
    trainer.fit(_Gan(), DataLoader(regression_data(x_scale=10.0), batch_size=32))
    assert trainer.global_step == 20  # 10 batches, two optimizer steps each
    skipped = trainer.global_step - taken.taken
    assert skipped >= 10  # every discriminator step overflowed: its skips are the run's own, and counted
    scale = trainer.precision_plugin.scaler.get_scale()
    summary = summary_counts(capsys.readouterr().out)
    assert summary.startswith(f"20 optimizer steps, {skipped} skipped by the scaler"), summary
    assert summary.endswith(f"loss scale 2**{int(math.log2(scale))} at the end"), summary  # the scaler's own
    out = report_out(tmp_path, capsys)
    assert f"  {summary};" in out, out  # the report says what the summary said
    assert [d.finding for d in watch.diagnoses if d.is_alarm] == [Finding.FORWARD_OVERFLOW]


def test_a_run_resumed_into_a_new_directory_reports_the_alarms_its_checkpoint_brought_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint brings the first part's diagnoses back into the watch; the new directory's event log gets them
    too, so that ``ampwatch report`` on it counts the alarms the resumed run's summary counts (it once said "no
    alarm: a healthy run" for a run whose summary had one)."""
    from lightning_ampwatch.scenarios import SCENARIOS, build_trainer

    scenario = SCENARIOS["lr_schedule"]
    seed_everything(0, verbose=False)
    model = scenario.model()
    first = build_trainer(scenario, [AmpWatch(verbose=False)], str(tmp_path / "a"))
    first.fit(model, scenario.dataloader())
    ckpt = tmp_path / "a.ckpt"
    first.save_checkpoint(str(ckpt))
    watch = AmpWatch()
    build_trainer(scenario, [watch], str(tmp_path / "b"), max_steps=70).fit(
        scenario.model(), scenario.dataloader(), ckpt_path=str(ckpt))
    summary = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("AmpWatch summary"))
    alarms = [d for d in watch.diagnoses if d.is_alarm]
    assert alarms and alarms[0].finding is Finding.LR_SCHEDULE and alarms[0].step == 31
    assert f"; {len(alarms)} alarm" in summary, summary
    out = report_out(tmp_path / "b", capsys)
    assert f"; {len(alarms)} alarm" in out and "LR_SCHEDULE" in out and "healthy run" not in out, out
    assert main(["report", str(tmp_path / "b")]) == 0  # a second run of the report: nothing written twice
    assert capsys.readouterr().out.count("LR_SCHEDULE") == out.count("LR_SCHEDULE")


def test_a_fit_with_no_optimizer_step_is_not_called_healthy(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    run_scenario("healthy", str(tmp_path), AmpWatch(), max_steps=0)
    out = capsys.readouterr().out
    assert "AmpWatch: no optimizer step was seen, so nothing was judged." in out
    assert "Healthy run" not in out


def test_a_second_fit_of_the_same_trainer_is_counted_with_the_first(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A second ``fit`` of one Trainer and watch counts its own steps (the watch starts it afresh) into the same log
    directory; the report counts both fits, as it lists both fits' alarms (it once gave the second fit's counts
    beside the alarms of both)."""
    from lightning_ampwatch.scenarios import SCENARIOS, build_trainer

    scenario = SCENARIOS["lr_schedule"]
    seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False)
    trainer = build_trainer(scenario, [watch], str(tmp_path), max_steps=-1, max_epochs=3)
    model = scenario.model()
    trainer.fit(model, scenario.dataloader())
    first = (watch.machine.steps_seen, watch.machine.skipped_total)
    trainer.fit_loop.max_epochs = 6
    trainer.fit(model, scenario.dataloader())
    second = (watch.machine.steps_seen, watch.machine.skipped_total)
    assert first[0] == second[0] == 48  # each fit's own
    out = report_out(tmp_path, capsys)
    header = out.splitlines()[1]
    assert header.lstrip().startswith(f"{first[0] + second[0]} optimizer steps, {first[1] + second[1]} skipped"), out


def test_a_nan_loss_on_a_step_the_scaler_took_is_counted_and_the_run_not_called_healthy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty batch (a filtering collate left nothing) has a NaN mean loss whose gradients are finite, so the
    scaler takes the step: the loss is counted as non-finite and the run is not called healthy (it once said
    "nothing to report. Healthy run." and counted no non-finite loss)."""
    from torch.utils.data import Sampler, TensorDataset

    from lightning_ampwatch.scenarios import Regressor, build_trainer, SCENARIOS

    class WithAnEmptyBatch(Sampler[list[int]]):
        def __iter__(self) -> Any:
            for b in range(8):
                yield [] if b == 2 else list(range(32 * b, 32 * b + 32))

        def __len__(self) -> int:
            return 8

    def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not items:
            return torch.empty(0, 16), torch.empty(0)
        return torch.stack([i[0] for i in items]), torch.stack([i[1] for i in items])

    seed_everything(0, verbose=False)
    watch = AmpWatch()
    data = DataLoader(regression_data(n=256), batch_sampler=WithAnEmptyBatch(), collate_fn=collate)
    build_trainer(SCENARIOS["healthy"], [watch], str(tmp_path), max_steps=8, log_every_n_steps=1).fit(Regressor(), data)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("AmpWatch"))
    assert "1 non-finite loss" in line and "not a healthy run" in line and "Healthy run." not in line, line
    assert watch.machine.nonfinite_total == 1
    assert "healthy run" not in report_out(tmp_path, capsys)
