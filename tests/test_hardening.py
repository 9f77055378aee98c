"""Faults, bad input and odd configurations that once broke the watch: each a real run, each asserting what the
user sees."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_ampwatch import AmpWatch, AmpWatchError, Finding
from lightning_ampwatch.scenarios import SCENARIOS, Regressor, regression_data

from conftest import make_trainer


def _fit(tmp_path: Path, watch: AmpWatch, nan_rows: tuple[int, ...] = (), max_steps: int = 12, **kw: Any) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [watch], "fp16", max_steps=max_steps, **kw)
    trainer.fit(Regressor(), DataLoader(regression_data(n=512, nan_rows=nan_rows), batch_size=32))
    return trainer


def test_an_instance_reused_for_a_second_fit_starts_afresh(tmp_path: Path) -> None:
    scenario = SCENARIOS["gradient_overflow"]
    watch = AmpWatch(verbose=False, remediate=True)
    pl.seed_everything(0, verbose=False)
    first = make_trainer(tmp_path / "a", [watch], "fp16", max_steps=30)
    first.fit(scenario.model(), scenario.dataloader())
    assert [d.remedy for d in watch.diagnoses if d.is_alarm] == ["lower_init_scale"]
    pickle.dumps(watch)  # after a fit the instance still pickles (a later ddp_spawn fit sends it to workers)

    # the same fault in a second Trainer gets the first rung again, not an escalation from the first run
    pl.seed_everything(0, verbose=False)
    second = make_trainer(tmp_path / "b", [watch], "fp16", max_steps=30)
    second.fit(scenario.model(), scenario.dataloader())
    assert [d.remedy for d in watch.diagnoses if d.is_alarm] == ["lower_init_scale"]

    # and a healthy third run reports nothing of the earlier ones
    _fit(tmp_path / "c", watch)
    assert watch.diagnoses == []
    assert watch.applied == []


def _checkpointed_run(tmp_path: Path) -> Path:
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    watch = AmpWatch(verbose=False)
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [watch, ckpt], "fp16", max_steps=6, enable_checkpointing=True)
    trainer.fit(Regressor(), DataLoader(regression_data(n=512), batch_size=32))
    return tmp_path / "ckpt" / "last.ckpt"


@pytest.mark.parametrize("corrupt", ["unknown_finding", "bad_applied", "not_a_dict", "future_version"])
def test_unreadable_checkpoint_state_is_warned_about_and_the_watch_goes_on(tmp_path: Path, corrupt: str) -> None:
    path = _checkpointed_run(tmp_path)
    ckpt = torch.load(path, weights_only=False)
    state = ckpt["callbacks"]["AmpWatch"]
    if corrupt == "unknown_finding":
        state["diagnoses"] = [{"finding": "NO_SUCH_FINDING", "step": 1}]
        state["machine"]["episode"] = {"finding": "NO_SUCH_FINDING", "onset": 1}
    elif corrupt == "bad_applied":
        state["applied"] = [{"nonsense": True}]
    elif corrupt == "not_a_dict":
        ckpt["callbacks"]["AmpWatch"] = ["not", "a", "dict"]
    else:
        state["version"] = 99
    torch.save(ckpt, path)

    # the resumed run (its dataloader starts the epoch again) meets a NaN in batch 6: it must still be diagnosed
    watch = AmpWatch(verbose=False)
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(tmp_path, [watch], "fp16", max_steps=20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regressor(), DataLoader(regression_data(n=512, nan_rows=(200,)), batch_size=32),
                    ckpt_path=str(path))
    said = [str(w.message) for w in caught if "checkpoint" in str(w.message) and "AmpWatch" in str(w.message)]
    assert len(said) >= 1, [str(w.message) for w in caught]
    assert "keeps watching" in said[0]
    assert watch.machine is not None and watch.machine.steps_seen >= 14  # the step hooks are attached
    assert watch.machine.skipped_total < watch.machine.steps_seen  # not "100% skipped"
    assert [d.finding for d in watch.diagnoses if d.is_alarm][-1] is Finding.DATA_NONFINITE


@pytest.mark.parametrize("bad, message", [
    ({"log_dir": 123}, "log_dir=123"),
    ({"name": ""}, "name=''"),
])
def test_bad_arguments_fail_at_construction(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AmpWatch(**bad)


def test_log_dir_with_a_tilde_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    watch = AmpWatch(verbose=False, log_dir="~/runs/x")
    _fit(tmp_path / "run", watch, nan_rows=(70,), max_steps=4)
    assert (tmp_path / "runs" / "x" / "ampwatch" / "diagnoses.jsonl").is_file()
    assert not Path("~").exists()


def test_two_named_instances_keep_their_own_state(tmp_path: Path) -> None:
    a, b = AmpWatch(verbose=False, name="a", log_dir=str(tmp_path / "a")), AmpWatch(verbose=False, name="b",
                                                                                      log_dir=str(tmp_path / "b"))
    assert (a.state_key, b.state_key) == ("AmpWatch[a]", "AmpWatch[b]")
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    trainer = make_trainer(tmp_path, [a, b, ckpt], "fp16", max_steps=4, enable_checkpointing=True)
    trainer.fit(Regressor(), DataLoader(regression_data(n=512, nan_rows=(70,)), batch_size=32))
    assert [d.finding for d in a.diagnoses] == [d.finding for d in b.diagnoses] == [Finding.DATA_NONFINITE]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    assert {"AmpWatch[a]", "AmpWatch[b]"} <= set(saved)


def test_two_unnamed_instances_get_lightnings_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="state_key"):
        make_trainer(tmp_path, [AmpWatch(), AmpWatch()], "fp16")


def test_an_unwritable_log_dir_does_not_cost_the_decision(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the log directory should be")
    watch = AmpWatch(log_dir=str(blocker / "logs"), on_unrecoverable="raise")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(AmpWatchError, match="DATA_NONFINITE"):
        warnings.simplefilter("always")
        _fit(tmp_path, watch, nan_rows=(70,))
    out = capsys.readouterr().out
    assert "DATA_NONFINITE" in out  # the console panel still appears
    named = [str(w.message) for w in caught if str(blocker) in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]


def test_after_fit_the_instance_holds_no_model_or_snapshot(tmp_path: Path) -> None:
    watch = AmpWatch(verbose=False, snapshot_every=2)
    _fit(tmp_path, watch, max_steps=8)
    # what it reports (diagnoses, counters) pickles; the model, its optimizer state and the snapshots of both do not
    # come along (before, a pickled instance was 5.8x this model's own pickle)
    assert len(pickle.dumps(watch)) < 2 * len(pickle.dumps(Regressor()))
    # not one parameter comes along, not even through the self.log Lightning binds onto every callback at fit start
    found: list[str] = []

    class Finds(pickle.Pickler):
        def persistent_id(self, obj: Any) -> str | None:
            if isinstance(obj, torch.nn.Parameter):
                found.append(str(tuple(obj.shape)))
                return "a parameter"
            return None

    import io
    Finds(io.BytesIO()).dump(watch)
    assert found == []
    assert watch.machine is not None and watch.machine.steps_seen == 8
