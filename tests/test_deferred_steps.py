"""Clean steps taken in later: a healthy step's machine, timeline and snapshot-ring bookkeeping waits for the next
log step (or anything else that reads them) and is handed over as one run. What users see must be what they saw
with one hand-over per step: the run methods against their one-step originals, and whole fits with the deferral
on and off (``steps.route.MAX_DEFERRED = 0`` defers nothing), compared diagnosis by diagnosis and byte by byte."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ampwatch import AmpWatch, steps
from lightning_ampwatch.steps import route
from lightning_ampwatch.steps import CleanRuns
from lightning_ampwatch.machine import AmpStateMachine
from lightning_ampwatch.scenarios import SCENARIOS, build_trainer
from lightning_ampwatch.timeline import Timeline
from lightning_ampwatch.trajectory.ring import SnapshotRing

# ---------------------------------------------------------------------------------------------- a run, generated


def _run(rng: random.Random, start: int, n: int, gaps: bool) -> list[tuple[int, list[Any], float, bool, tuple]]:
    """``n`` clean steps as the ledger defers them: (step, batches, scale, grew, lrs), with growths, a tuple of LRs
    kept while the LR stays (the ledger's) or remade with the same or a new value, and gaps (a batch with no
    backward) when asked."""
    steps, step, scale = [], start, 2.0 ** rng.randint(8, 16)
    lrs: tuple[float, ...] = (0.1,) if rng.random() < 0.7 else (0.1, 0.01)
    for _ in range(n):
        grew = rng.random() < 0.08
        if grew:
            scale *= 2
        r = rng.random()
        if r < 0.1:
            lrs = tuple(v * rng.choice([0.5, 1.0, 1.01, 2.0, 40.0]) for v in lrs)
        elif r < 0.15:
            lrs = tuple(lrs)  # the same values, another tuple
        steps.append((step, [object()], scale, grew, lrs))
        step += 1 + (rng.random() < 0.1 if gaps else 0)
    return steps


def _columns(run: list[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
    return tuple(zip(*run))


def _machine_after(run: list[tuple[Any, ...]], per_step: bool, skips: list[int], lr_last: float | None,
                   first_scale: float | None) -> dict[str, Any]:
    machine = AmpStateMachine("fp16")
    s = machine.state
    s.recent_skips.extend(skips)
    s.lr_last = lr_last
    s.first_scale = first_scale
    s.max_safe_scale = first_scale
    if per_step:
        for step, _, scale, grew, lrs in run:
            machine.observe_clean(step, scale, grew, lrs)
    else:
        steps, _, scales, grews, lrss = _columns(run)
        machine.observe_clean_run(steps, scales, grews, lrss)
    return machine.state_dict()


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 80), gaps=st.booleans(), lr_known=st.booleans(),
       scaled=st.booleans())
def test_the_machine_takes_a_run_as_it_takes_each_step(seed: int, n: int, gaps: bool, lr_known: bool,
                                                       scaled: bool) -> None:
    rng = random.Random(seed)
    start = rng.randint(0, 500)
    run = _run(rng, start, n, gaps)
    skips = sorted(rng.sample(range(max(0, start - 40), start), min(start, rng.randint(0, 5))))
    lr_last = (0.1 if rng.random() < 0.5 else 0.2) if lr_known else None
    first = run[0][2] / 2 if scaled else None
    assert _machine_after(run, False, skips, lr_last, first) == _machine_after(run, True, skips, lr_last, first)


def _timeline_after(tmp_path: Path, name: str, prelude: list[tuple[int, bool]], run: list[tuple[Any, ...]],
                    per_step: bool, then_anomaly: bool) -> tuple[str, dict[str, Any]]:
    timeline = Timeline(tmp_path / name, healthy_rows_per_level=3)
    for step, skipped in prelude:  # some history: strides, kept rows, an anomaly just before the run
        timeline.record_step(step, skipped=skipped, scale=1024.0, lrs=(0.1,))
    if per_step:
        for step, _, scale, _, lrs in run:
            timeline.record_clean(step, scale, lrs)
    else:
        steps, _, scales, _, lrss = _columns(run)
        timeline.record_clean_run(steps, scales, lrss)
    if then_anomaly:  # the step after the run is anomalous: the held step must be kept
        timeline.record_step(run[-1][0] + 1, skipped=True, scale=512.0, lrs=run[-1][4])
    timeline.flush(lambda: 0.5)
    timeline.close()
    state = {k: v for k, v in vars(timeline).items() if k not in ("path", "_file", "_buffer")}
    return (tmp_path / name).read_text(), state


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 120), gaps=st.booleans(), history=st.integers(0, 60),
       anomaly_before=st.booleans(), then_anomaly=st.booleans())
def test_the_timeline_takes_a_run_as_it_takes_each_step(tmp_path_factory: pytest.TempPathFactory, seed: int, n: int,
                                                        gaps: bool, history: int, anomaly_before: bool,
                                                        then_anomaly: bool) -> None:
    rng = random.Random(seed)
    prelude = [(step, anomaly_before and step == history - 1) for step in range(history)]
    run = _run(rng, history, n, gaps)
    if rng.random() < 0.3:  # the run starts at the scale the prelude's rows have
        run = [(s, b, 1024.0, g, (0.1,)) for s, b, _, g, _ in run]
    tmp = tmp_path_factory.mktemp("timeline")
    text_run, state_run = _timeline_after(tmp, "run.jsonl", prelude, run, False, then_anomaly)
    text_each, state_each = _timeline_after(tmp, "each.jsonl", prelude, run, True, then_anomaly)
    assert text_run == text_each
    assert state_run == state_each


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10 ** 6), n=st.integers(1, 40), held_before=st.integers(0, 30),
       snapshots=st.booleans(), out_of_order=st.booleans())
def test_the_ring_keeps_a_run_as_it_keeps_each_step(seed: int, n: int, held_before: int, snapshots: bool,
                                                    out_of_order: bool) -> None:
    rng = random.Random(seed)
    run = _run(rng, held_before - (3 if out_of_order else 0), n, gaps=True)

    def ring_after(per_step: bool) -> tuple[Any, ...]:
        ring = SnapshotRing(None, 5, keep=2)
        if snapshots:
            ring._snapshots.append(object())  # type: ignore[arg-type]  # one held: the steps' batches are kept
        for step in range(held_before):
            ring.add_batches(step, [step])
        if per_step:
            for step, batches, *_ in run:
                ring.add_batches(step, batches)
        else:
            steps, batches, *_ = _columns(run)
            ring.add_run(steps, batches)
        return (list(ring._batches.items()), ring._in_order, ring._newest_held, ring._unheld, ring.dropped,
                len(ring._snapshots))

    assert ring_after(False) == ring_after(True)


# ---------------------------------------------------------------------------------------------- whole fits


def _count_hand_overs(monkeypatch: pytest.MonkeyPatch, runs: list[int]) -> None:
    """``runs`` gets the length of every run of deferred clean steps the watcher takes in."""
    settle = CleanRuns.settle

    def counting(self: CleanRuns) -> None:
        if self.deferred:
            runs.append(len(self.deferred))
        settle(self)

    monkeypatch.setattr(CleanRuns, "settle", counting)


def _fit(name: str, root: Path, defer: bool, monkeypatch: pytest.MonkeyPatch, runs: list[int], *,
         host_tape: bool = True, trainer_kwargs: dict[str, Any] | None = None, **watch_kwargs: Any) -> tuple[Any, ...]:
    """The scenario's fit, watched; what a user sees of it: diagnoses, remedies, the machine's checkpointed state,
    the timeline file, the event log's records. ``host_tape=False``: the losses kept as unread tensors, as on an
    accelerator (the CPU takes each one's value as it comes)."""
    monkeypatch.setattr(route, "MAX_DEFERRED", route.MAX_DEFERRED if defer else 0)
    monkeypatch.setattr(steps.losses, "HOST_TAPE_DEVICES", steps.losses.HOST_TAPE_DEVICES if host_tape else frozenset())
    _count_hand_overs(monkeypatch, runs)
    scenario = SCENARIOS[name]
    torch.manual_seed(0)
    random.seed(0)
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, log_dir=str(root / "log"), **watch_kwargs)
    trainer = build_trainer(scenario, [watch], str(root), max_steps=scenario.max_steps + 90, log_every_n_steps=10,
                            **(trainer_kwargs or {}))
    trainer.fit(scenario.model(), scenario.dataloader())
    assert watch.watcher.ledger is not None and watch.watcher.ledger._host_tape is host_tape
    timeline = (root / "log" / "ampwatch" / "timeline.jsonl").read_bytes()
    diagnoses = [d.to_dict() for d in watch.diagnoses]
    assert watch.machine is not None
    return diagnoses, [a.to_dict() for a in watch.applied], watch.machine.state_dict(), timeline


@pytest.mark.parametrize("name, watch_kwargs, deferred", [
    ("healthy", {"snapshot_every": 7}, True),
    ("growth_overflow", {"snapshot_every": 5}, True),
    ("gradient_overflow", {"snapshot_every": 6}, True),
    ("lr_schedule", {"snapshot_every": 4}, True),
    ("scale_collapse", {"snapshot_every": 3}, True),
    ("nan_data", {"snapshot_every": 0}, True),
    # no scaler (fp32: the host-loss path), and a remedy watched from step 0: nothing deferred, nothing changed
    ("fp32_unstable", {"snapshot_every": 5}, False),
    ("input_range", {"snapshot_every": 2}, False),
])
def test_a_fit_is_diagnosed_and_recorded_the_same_with_clean_steps_taken_in_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, watch_kwargs: dict[str, Any],
        deferred: bool) -> None:
    runs_on: list[int] = []
    runs_off: list[int] = []
    on = _fit(name, tmp_path / "on", True, monkeypatch, runs_on, **watch_kwargs)
    off = _fit(name, tmp_path / "off", False, monkeypatch, runs_off, **watch_kwargs)
    assert bool(runs_on) is deferred and not runs_off  # clean steps handed over in runs in the first fit only
    assert on[0] == off[0]
    assert on[0], "the scenario's fit was diagnosed"
    assert on[1] == off[1]
    assert on[2] == off[2]  # the machine's state: counts, skips, growths, LR history, loss level
    assert on[3] == off[3]  # the timeline file, byte for byte


def test_no_log_step_still_hands_clean_steps_over_and_the_end_takes_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``log_every_n_steps`` past the fit's length: no log step comes, and the deferral is capped
    (``MAX_DEFERRED``); the fit's end takes in what is left, so the machine counts every step."""
    runs: list[int] = []
    monkeypatch.setattr(route, "MAX_DEFERRED", 16)
    _count_hand_overs(monkeypatch, runs)
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    watch = AmpWatch(verbose=False, snapshot_every=0, log_dir=str(tmp_path / "log"))
    scenario = SCENARIOS["healthy"]
    trainer = build_trainer(scenario, [watch], str(tmp_path), max_steps=100, log_every_n_steps=1000)
    trainer.fit(scenario.model(), scenario.dataloader())
    assert max(runs) <= 16 and len(runs) >= 6
    assert watch.machine is not None and watch.machine.steps_seen == 100
    assert [d.finding.value for d in watch.diagnoses] == ["NORMAL_SCALING"] or not watch.diagnoses


def test_the_machine_a_user_reads_between_log_steps_counts_every_step(tmp_path: Path) -> None:
    """``AmpWatch.machine`` read mid-interval (a callback of the user's): every step taken so far is in it."""
    import lightning.pytorch as pl

    seen: list[tuple[int, int]] = []
    watch = AmpWatch(verbose=False, snapshot_every=0, log_dir=str(tmp_path / "log"))

    class Reader(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            seen.append((trainer.global_step, watch.machine.steps_seen))  # type: ignore[union-attr]

    pl.seed_everything(0, verbose=False)
    scenario = SCENARIOS["healthy"]
    trainer = build_trainer(scenario, [watch, Reader()], str(tmp_path), max_steps=30, log_every_n_steps=25)
    trainer.fit(scenario.model(), scenario.dataloader())
    assert seen and all(global_step == steps for global_step, steps in seen), seen
    assert seen[-1][1] == 30


@pytest.mark.parametrize("name, watch_kwargs, trainer_kwargs", [
    ("healthy", {"snapshot_every": 7}, {}),
    ("healthy", {"snapshot_every": 0}, {"accumulate_grad_batches": 3}),  # three losses per step
    ("growth_overflow", {"snapshot_every": 5}, {}),
    ("gradient_overflow", {"snapshot_every": 6}, {}),
    ("lr_schedule", {"snapshot_every": 4}, {}),
    ("scale_collapse", {"snapshot_every": 3}, {}),
    ("nan_data", {"snapshot_every": 0}, {}),
    ("fp32_unstable", {"snapshot_every": 5}, {}),  # no scaler: the host-loss path reads each step's loss
    ("fp32_unstable", {"snapshot_every": 0}, {"accumulate_grad_batches": 2}),
    ("input_range", {"snapshot_every": 2}, {}),
])
def test_a_fit_is_diagnosed_and_recorded_the_same_with_losses_taken_as_floats_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, watch_kwargs: dict[str, Any],
        trainer_kwargs: dict[str, Any]) -> None:
    """The CPU takes each loss's value as it comes (no synchronisation there), so a log step reads no tensor for
    them: everything a user sees is what the tensors kept unread and read in one packed read give, bit for bit."""
    floats = _fit(name, tmp_path / "floats", True, monkeypatch, [], trainer_kwargs=trainer_kwargs, **watch_kwargs)
    tensors = _fit(name, tmp_path / "tensors", True, monkeypatch, [], host_tape=False, trainer_kwargs=trainer_kwargs,
                   **watch_kwargs)
    assert floats[0] == tensors[0]
    assert floats[0] or name == "healthy", "the scenario's fit was diagnosed"
    assert floats[1] == tensors[1]
    assert floats[2] == tensors[2]  # the machine's state: counts, skips, growths, LR history, loss level
    assert floats[3] == tensors[3]  # the timeline file, byte for byte
    assert floats[2]["reference"] is not None or name != "healthy"  # losses were read and made a level


def test_without_snapshots_no_clean_steps_batch_is_held(tmp_path: Path) -> None:
    """``snapshot_every=0``: nothing replays a clean step, so AmpWatch holds no batch of one after its step, also
    between log steps, while it defers their bookkeeping (a held batch costs the allocator its reuse on the CPU).
    With snapshots on, the ring holds them until the next snapshot."""
    import gc
    import weakref

    import lightning.pytorch as pl

    class Refs(pl.Callback):
        def __init__(self) -> None:
            self.refs: list[tuple[int, weakref.ref[Any]]] = []
            self.alive_at: list[int] = []

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            self.refs.append((trainer.global_step, weakref.ref(batch[0])))
            if trainer.global_step == 45:  # mid-interval: log steps at 10, 20, 30, 40, 50
                gc.collect()
                self.alive_at = [step for step, ref in self.refs[:-2] if ref() is not None]

    alive = {}
    for every in (0, 20):
        pl.seed_everything(0, verbose=False)
        refs = Refs()
        watch = AmpWatch(verbose=False, snapshot_every=every, log_dir=str(tmp_path / f"log{every}"))
        scenario = SCENARIOS["healthy"]
        trainer = build_trainer(scenario, [watch, refs], str(tmp_path / str(every)), max_steps=60,
                                log_every_n_steps=10)
        trainer.fit(scenario.model(), scenario.dataloader())
        alive[every] = refs.alive_at
    assert alive[0] == []
    assert alive[20] and min(alive[20]) <= 40  # the ring's batches since its newest snapshots


def test_the_owner_hands_a_run_to_every_consumer_once_in_the_order_they_were_registered() -> None:
    """The ledger's batching (``steps.CleanRuns``): a run of held-back clean steps reaches each consumer once, as
    columns, in the order the roles were first registered (a role registered again, as the trajectory control is
    after a precision change, keeps its place and only the new consumer gets the run)."""
    runs = CleanRuns()
    got: list[tuple[str, tuple[Any, ...]]] = []
    runs.hand_to("trajectory", lambda *columns: got.append(("old control", columns)))
    runs.hand_to("machine", lambda *columns: got.append(("machine", columns)))
    runs.hand_to("trajectory", lambda *columns: got.append(("new control", columns)))
    runs.deferred.extend([(4, ["b4"], 1024.0, False, (0.1,)), (5, ["b5"], 2048.0, True, (0.1,))])
    runs.settle()
    runs.settle()  # nothing held back any more: nothing handed over twice
    columns = ((4, 5), (["b4"], ["b5"]), (1024.0, 2048.0), (False, True), ((0.1,), (0.1,)))
    assert got == [("new control", columns), ("machine", columns)]
    assert runs.deferred == []
