"""Deterministic counts of AmpWatch's own work per kind of step (ordinary, log, snapshot), which load from elsewhere
on the machine cannot change: Python calls inside the hooks (cProfile, as ``overhead.py --anatomy`` counts them)
and bytecodes executed in ``lightning_ampwatch``'s frames from one batch start to the next (``sys.settrace``
opcode events; the toy's own ``training_step``, which lives in ``lightning_ampwatch.scenarios``, left out).

    python benchmarks/step_counts.py                      # toy, snapshot_every=20, both counts
    python benchmarks/step_counts.py --workload mlp --snapshot-every auto --by-function

Used for benchmarks/FINDINGS.md (section 10). Steps 30 to 430 of one run are counted.
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402

import overhead as ob  # noqa: E402
from lightning_ampwatch.callback import AmpWatch  # noqa: E402

WARMUP, STEPS = 30, 400


def _watch(snapshot_every: str) -> AmpWatch:
    return AmpWatch(verbose=False, **({} if snapshot_every == "auto" else {"snapshot_every": int(snapshot_every)}))


def calls(workload: ob.Workload, snapshot_every: str, top: int) -> None:
    timer = ob.hook_times(STEPS, WARMUP, 0, workload=workload, anatomy=True, make_watch=lambda: _watch(snapshot_every))
    total = []
    print(f"Python calls in AmpWatch's hooks ({workload.name}, snapshot_every={snapshot_every}):")
    for kind in ob.STEP_KINDS:
        n, prof = timer.step_count(kind), timer.profilers.get(kind)
        if not n or prof is None:
            continue
        own = {k: r for k, r in pstats.Stats(prof).stats.items()  # type: ignore[attr-defined]
               if "_lsprof.Profiler" not in k[2]}
        count = sum(r[1] for r in own.values())
        total.append((n, count))
        print(f"  {kind:9} {n:4d} steps {count / n:8.1f} calls per step")
        for (filename, line, func), row in sorted(own.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"      {row[1] / n:7.2f}  {os.path.basename(filename)}:{line}({func})")
    print(f"  all kinds spread over the window: {sum(c for _, c in total) / sum(n for n, _ in total):.2f} per step")


def bytecodes(workload: ob.Workload, snapshot_every: str, top: int, by_function: bool) -> None:
    counts: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    state: dict[str, Any] = {"step": -1}

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            name = os.path.basename(frame.f_code.co_filename)
            counts[state["step"]][f"{name}:{frame.f_code.co_name}" if by_function else name] += 1
        return local

    def outer(frame: Any, event: str, arg: Any) -> Any:
        if "lightning_ampwatch" in frame.f_code.co_filename:
            frame.f_trace_opcodes = True
            return local
        return None

    watch = _watch(snapshot_every)
    snapshot_steps: set[int] = set()

    class Marker(pl.Callback):  # first in the list: a step's count runs from its batch start to the next one's
        newest = -1

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            sys.settrace(None)
            control = watch.watcher.trajectory
            held = control.ring.snapshots if control is not None else ()
            newest = held[-1].step if held else -1
            if newest != self.newest:
                self.newest = newest
                snapshot_steps.add(state["step"])
            state["step"] = trainer.global_step
            if WARMUP <= trainer.global_step < WARMUP + STEPS:
                sys.settrace(outer)

        def on_train_end(self, *args: Any) -> None:
            sys.settrace(None)

    with tempfile.TemporaryDirectory() as root:
        ob.train_once(ob.WATCHED, STEPS, WARMUP, 0, root, None, workload, ob.Setup([Marker(), watch]))
    per_kind: dict[str, list[int]] = collections.defaultdict(list)
    where: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for step, counter in counts.items():
        if not WARMUP <= step < WARMUP + STEPS:
            continue
        kind = "snapshot" if step in snapshot_steps else \
            ("log" if (step + 1) % ob.LOG_EVERY_N_STEPS == 0 else "ordinary")
        own = collections.Counter({k: v for k, v in counter.items() if not k.startswith("scenarios.py")})
        per_kind[kind].append(sum(own.values()))
        where[kind].update(own)
    print(f"Bytecodes in lightning_ampwatch's frames per step ({workload.name}, snapshot_every={snapshot_every}):")
    for kind in ob.STEP_KINDS:
        values = per_kind.get(kind)
        if not values:
            continue
        print(f"  {kind:9} {len(values):4d} steps: median {statistics.median(values):.0f}, mean "
              f"{statistics.mean(values):.1f}")
        for name, n in where[kind].most_common(top):
            print(f"      {n / len(values):8.1f}  {name}")
    all_values = [v for values in per_kind.values() for v in values]
    print(f"  all kinds spread over the window (mean): {statistics.mean(all_values):.1f} per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(ob.WORKLOADS), default="toy")
    parser.add_argument("--snapshot-every", default="20", help="a number of steps, or 'auto' (the default's)")
    parser.add_argument("--only", choices=("calls", "bytecodes"), help="one of the two counts (default: both)")
    parser.add_argument("--by-function", action="store_true", help="bytecodes by function, not by file")
    parser.add_argument("--top", type=int, default=12, help="the biggest entries shown per kind of step")
    args = parser.parse_args()
    workload = ob.WORKLOADS[args.workload]
    if args.only in (None, "calls"):
        calls(workload, args.snapshot_every, args.top)
    if args.only in (None, "bytecodes"):
        bytecodes(workload, args.snapshot_every, args.top, args.by_function)


if __name__ == "__main__":
    main()
