"""What one AmpWatch snapshot costs each rank: bytes held and time to take, against model size and strategy.

Run it from the repository root::

    python benchmarks/snapshot_cost.py            # 1M and 10M parameters: one process, frozen base, DDP, FSDP2, FSDP1
    python benchmarks/snapshot_cost.py --sizes 1e6 # one size only (quicker)

Each configuration takes snapshots the way the ring does (``Snapshot.take`` on a ``TrainState``, through torch's
distributed state-dict machinery; under FSDP1 from its flat parameters' shards directly), after three float32 AdamW
steps so that the optimizer state is real. DDP, FSDP2 and FSDP1 run as two CPU processes with gloo; each rank reports
its own bytes and median time. On this machine the copy measures the CPU's memory bandwidth (one thread); on an
accelerator it would cross the bus into pinned memory. Timing on a shared machine is noisy: compare rows, do not tune on them.

``measure(state)`` and ``cost(kind, params)`` are plain functions another benchmark can call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from lightning_ampwatch.trajectory.snapshot import Snapshot  # noqa: E402
from lightning_ampwatch.trajectory.state import TrainState  # noqa: E402

WIDTH = 512
KINDS = ("single", "frozen_base", "ddp", "fsdp2", "fsdp1")


@dataclass
class Cost:
    kind: str
    params: int  # the model's parameters, all ranks together
    rank: int
    bytes: int  # what this rank's snapshot holds
    take_ms: float  # the median time of one Snapshot.take on this rank


def _model(params: int) -> nn.Sequential:
    layers = max(1, round(params / (WIDTH * (WIDTH + 1))))
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    x = torch.randn(16, WIDTH)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()


def measure(state: TrainState, repeats: int = 5) -> tuple[int, float]:
    """(bytes, median milliseconds) of ``Snapshot.take`` on ``state``, into a reused slot as the ring does."""
    slot = None
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        snap = Snapshot.take(state, 0, slot=slot, split=state.split)
        times.append(time.perf_counter() - start)
        slot = snap.host
    return snap.nbytes, statistics.median(times) * 1e3


def cost(kind: str, params: int, rank: int = 0) -> Cost:
    """One configuration on this process (under ``ddp``/``fsdp2``/``fsdp1`` the process group must be up)."""
    torch.manual_seed(0)
    model = _model(params)
    total = sum(p.numel() for p in model.parameters())
    root: nn.Module = model
    if kind == "frozen_base":  # everything but the last layer frozen: a base under a head
        for layer in list(model)[:-1]:
            layer.requires_grad_(False)
    elif kind == "ddp":
        root = nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    elif kind == "fsdp1":  # each layer its own FullyShardedDataParallel unit, as Lightning's auto-wrap makes them
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        root = FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy(
            {nn.Linear}), use_orig_params=True)
        model = root
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    _train(root, optimizer)
    # DDP: each rank keeps its share, as inside a fit with a scaler (the ranks restore together there)
    state = TrainState(module=model, optimizers=[optimizer], root=root, split=kind == "ddp")
    nbytes, ms = measure(state)
    return Cost(kind, total, rank, nbytes, ms)


def _worker(rank: int, kind: str, params: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = cost(kind, params, rank)
        with open(os.path.join(out, f"{rank}.txt"), "w") as f:
            f.write(repr(asdict(result)))
    finally:
        dist.destroy_process_group()


def run(kind: str, params: int) -> list[Cost]:
    """``kind`` in ``KINDS``; DDP, FSDP2 and FSDP1 in two CPU processes (one row per rank)."""
    if kind in ("single", "frozen_base"):
        torch.set_num_threads(1)
        return [cost(kind, params)]
    with tempfile.TemporaryDirectory() as out:
        port = 29500 + os.getpid() % 1000
        mp.start_processes(_worker, args=(kind, params, port, out), nprocs=2, start_method="fork")
        return [Cost(**eval(open(os.path.join(out, f"{r}.txt")).read())) for r in range(2)]  # noqa: S307


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e7])
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    args = parser.parse_args()
    print(f"{'kind':<12} {'params':>8} {'rank':>4} {'MB':>8} {'take ms':>8}  MB per 1M params")
    for params in args.sizes:
        for kind in args.kinds:
            for c in run(kind, int(params)):
                print(f"{c.kind:<12} {c.params / 1e6:>7.1f}M {c.rank:>4} {c.bytes / 1e6:>8.2f} {c.take_ms:>8.2f}  "
                      f"{c.bytes / 1e6 / (c.params / 1e6):.2f}")


if __name__ == "__main__":
    main()
