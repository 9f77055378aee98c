"""The cost budget on a sub-millisecond step, held by counts that load from elsewhere cannot change: an ordinary
healthy step's hooks make at most 25 Python calls (``benchmarks/step_counts.py``). The times beside the counts
(an ordinary step's hooks within 8 us, a log step's extra within 400 us, the snapshot's share within 0.5%) are the
benchmark's to print (``benchmarks/overhead.py``), never a test's."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Iterator

import pytest
from _scripts import loaded_script

from lightning_ampwatch import AmpWatch

COUNTS = Path(__file__).resolve().parent.parent / "benchmarks" / "step_counts.py"
SETTLED = 100  # (step_counts.SETTLED: the "auto" cadences have decided by then)


@pytest.fixture(scope="module")
def step_counts() -> Iterator[ModuleType]:
    with loaded_script(COUNTS, "ampwatch_step_counts") as module:
        yield module


@pytest.fixture(scope="module")
def counts(step_counts: ModuleType) -> object:
    return step_counts.count_steps(steps=200, seed=0)


def test_an_ordinary_step_makes_at_most_25_calls_in_the_hooks(counts: object, step_counts: ModuleType) -> None:
    ordinary = counts.of_kind("ordinary", first=SETTLED)
    assert len(ordinary) >= 90  # 200 steps less the log steps and the snapshot steps
    assert step_counts.ORDINARY_CALLS_BUDGET == 25 and step_counts.SETTLED == SETTLED
    assert max(ordinary.values()) <= 25, {b: n for b, n in ordinary.items() if n > 25}


def test_the_counts_are_the_same_from_run_to_run(counts: object, step_counts: ModuleType) -> None:
    # ("auto" times its first snapshots, and the interval it then chooses depends on the machine: the steps compared
    # are those ordinary in both runs)
    again = step_counts.count_steps(steps=120, seed=0).of_kind("ordinary", first=SETTLED)
    first = counts.of_kind("ordinary", first=SETTLED)
    both = set(again) & set(first)
    assert len(both) >= 15 and {b: again[b] for b in both} == {b: first[b] for b in both}


def test_log_and_snapshot_steps_are_told_apart_and_cost_more(counts: object) -> None:
    # (the snapshots: "auto" takes its first ones 20 steps apart, then at the interval it chose, which depends on the
    # machine and may leave none after step 100 in this run)
    logs, snapshots = counts.of_kind("log", first=SETTLED), counts.of_kind("snapshot", first=1)
    assert sorted(logs) == [149, 199] and len(snapshots) >= 3
    typical = max(counts.of_kind("ordinary", first=SETTLED).values())
    assert min(logs.values()) > typical and min(snapshots.values()) > typical


def test_a_counted_step_counts_what_the_hooks_call_and_nothing_else(step_counts: ModuleType) -> None:
    """The count follows the watch's hooks: a subclass whose batch-end hook makes 100 more calls counts 100 more on
    every ordinary step (each call of ``abs`` is one); the training step's own calls are not counted."""

    class Busier(AmpWatch):
        def on_train_batch_end(self, *args: object, **kwargs: object) -> None:
            for _ in range(100):
                abs(1)
            super().on_train_batch_end(*args, **kwargs)

    plain = step_counts.count_steps(steps=110, seed=0)
    busier = step_counts.count_steps(steps=110, seed=0, make_watch=lambda: Busier(verbose=False))
    busy = busier.of_kind("ordinary", first=SETTLED)
    ordinary = {b: n for b, n in plain.of_kind("ordinary", first=SETTLED).items() if b in busy}
    assert len(ordinary) >= 5
    # the subclass's hook is one more Python call besides the 100 calls of abs (``super()`` makes an object, a call
    # of a type, which the profiler does not report as a call)
    assert {busier.calls[b] - n for b, n in ordinary.items()} == {101}


def test_the_script_prints_the_counts_and_exits_0_within_the_budget(step_counts: ModuleType,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert step_counts.main(["--steps", "200"]) == 0
    out = capsys.readouterr().out
    assert "Python calls in AmpWatch's hooks per step (toy, 200 steps, log every 50; from step 100 on" in out
    assert "(budget 25)" in out
    with pytest.raises(SystemExit):
        step_counts.main(["--steps", "10"])
    assert "--steps=10 is not valid; use at least 150" in capsys.readouterr().err
