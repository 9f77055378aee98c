"""What ``AmpWatch()`` costs a realistic step on a GPU, what a snapshot stalls, and how many host syncs it adds.

Run it from the repository root on a machine with one CUDA GPU (``scripts/gpu-check.sh`` runs it with the CUDA
tests and prints its summary)::

    python benchmarks/gpu_bench.py                      # on the GPU: about two minutes on an H100
    python benchmarks/gpu_bench.py --json out.json      # the figures as JSON too
    python benchmarks/gpu_bench.py --device cpu --tiny  # the whole code path on the CPU, tiny sizes (a check, no figures)

Without CUDA (and without ``--device cpu``) it prints ``no CUDA: skipped`` and exits 0.

Three measures, all on synthetic data and models built from a config (nothing is downloaded):

1. **Watched against bare on a realistic step.** A GPT-2-shaped LightningModule in plain torch (12 layers, width
   768, 12 heads, sequence 512, batch 8, vocabulary 50257, AdamW; 10-50 ms a step on a current GPU) trains with
   ``precision="16-mixed"`` (Lightning's default ``GradScaler("cuda")``), in rounds of two fits, one with
   ``AmpWatch()`` (its defaults) and one without, in alternating order (bare first, then watched first). Each fit
   times its steps after a warm-up (wall clock between two ``torch.cuda.synchronize()``, the same in both); each
   round gives the ratio watched/bare; the median ratio comes with a distribution-free 95% confidence interval
   (order statistics: ``overhead.median_interval``).
2. **The snapshot's stall on the compute stream.** A plain torch loop (float16 autocast, GradScaler, SGD) on a
   stack of Linear layers of a few hundred MB feeds AmpWatch's snapshot ring every few steps. CUDA events around
   each step on the compute stream give its device time; the stall is the median step right after a snapshot
   less the median ordinary step. Three modes: snapshots off; the ring as it is (its copy on a side stream, the
   next optimizer step waiting for it on the device); and, for comparison, the same copy on the compute stream
   (how snapshots were taken before). The copy's own time on the compute stream is given too.
3. **Host syncs per step.** The same realistic fit, short, bare and watched, with
   ``torch.cuda.set_sync_debug_mode("warn")``: each synchronizing CUDA call is a warning, counted per step; the
   watched run's count less the bare run's, on log steps and on the others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.loggers.logger import DummyLogger  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_ampwatch import AmpWatch, compat, snapshot_copy  # noqa: E402
from lightning_ampwatch.trajectory.ring import SnapshotRing  # noqa: E402
from lightning_ampwatch.trajectory.state import TrainState  # noqa: E402
from lightning_ampwatch.scenarios import true_fp16_plugin  # noqa: E402
from overhead import median_interval  # noqa: E402

SYNC_WARNING = "synchronizing CUDA operation"


@dataclass
class GPTConfig:
    vocab: int = 50257
    seq: int = 512
    layers: int = 12
    width: int = 768
    heads: int = 12
    batch: int = 8

    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls(vocab=256, seq=32, layers=2, width=64, heads=4, batch=4)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.mlp = nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * c.width, c.width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(pl.LightningModule):
    """A GPT-2-shaped language model (GPT-2 small's shapes by default), built from its config."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c = c
        self.wte, self.wpe = nn.Embedding(c.vocab, c.width), nn.Embedding(c.seq, c.width)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.layers)])
        self.ln_f = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).float().view(-1, self.c.vocab), y.view(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)


def token_data(c: GPTConfig, steps: int, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, c.vocab, (c.batch * steps, c.seq + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=c.batch)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock(Callback):
    """Wall time of the steps from ``warmup`` on, between two synchronizations (the same in every fit)."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.start: tuple[int, float] | None = None
        self.ms_per_step = math.nan

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            _sync(self.device)
            self.start = (trainer.global_step, time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync(self.device)
        if self.start is not None and trainer.global_step > self.start[0]:
            self.ms_per_step = 1000 * (time.perf_counter() - self.start[1]) / (trainer.global_step - self.start[0])


def _trainer(device: torch.device, callbacks: list[Callback], steps: int, log_every: int) -> pl.Trainer:
    kwargs: dict[str, Any] = dict(max_steps=steps, logger=DummyLogger(), log_every_n_steps=log_every,
                                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                  callbacks=callbacks, devices=1, num_sanity_val_steps=0)
    if device.type == "cuda":
        return pl.Trainer(accelerator="gpu", precision="16-mixed", **kwargs)  # Lightning's default GradScaler("cuda")
    return pl.Trainer(accelerator="cpu", plugins=[true_fp16_plugin()], **kwargs)  # real float16 on the CPU


def fit_once(device: torch.device, c: GPTConfig, model: GPT, watched: bool, steps: int, warmup: int,
             log_every: int, extra: list[Callback] = ()) -> tuple[float, AmpWatch | None]:
    """One fit of ``steps`` steps, the model's weights carried on from the last: its ms per step after ``warmup``."""
    clock = StepClock(device, warmup)
    watch = AmpWatch(verbose=False) if watched else None
    trainer = _trainer(device, [*extra, clock, *([watch] if watch else [])], steps, log_every)
    trainer.fit(model, token_data(c, steps))
    return clock.ms_per_step, watch


@dataclass
class Realistic:
    config: dict[str, int]
    parameters: int
    rounds: int
    steps_per_fit: int
    warmup: int
    bare_ms: list[float]
    watched_ms: list[float]
    ratios: list[float]
    ratio_median: float
    ratio_ci95: tuple[float, float] | None
    bare_ms_median: float
    watched_ms_median: float


def realistic(device: torch.device, c: GPTConfig, rounds: int, steps: int, warmup: int, log_every: int) -> Realistic:
    pl.seed_everything(0, verbose=False)
    model = GPT(c)
    fit_once(device, c, model, False, warmup + 2, warmup, log_every)  # compile the kernels, warm the allocator
    bare: list[float] = []
    watched: list[float] = []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for on in order:
            ms, _ = fit_once(device, c, model, on, steps, warmup, log_every)
            (watched if on else bare).append(ms)
        print(f"  round {r + 1}/{rounds}: bare {bare[-1]:.2f} ms, watched {watched[-1]:.2f} ms a step", flush=True)
    ratios = [w / b for w, b in zip(watched, bare)]
    return Realistic(config=asdict(c), parameters=sum(p.numel() for p in model.parameters()), rounds=rounds,
                     steps_per_fit=steps, warmup=warmup, bare_ms=bare, watched_ms=watched, ratios=ratios,
                     ratio_median=statistics.median(ratios), ratio_ci95=median_interval(ratios),
                     bare_ms_median=statistics.median(bare), watched_ms_median=statistics.median(watched))


# ------------------------------------------------------------------------------------------------ host syncs


class _SyncMarks(Callback):
    def __init__(self, log: list[warnings.WarningMessage]) -> None:
        self.log, self.starts, self.end = log, [], 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.starts.append((trainer.global_step, len(self.log)))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = len(self.log)


def syncs_per_step(device: torch.device, c: GPTConfig, watched: bool, steps: int, log_every: int) -> Counter[int]:
    """Synchronizing CUDA calls per step of one short fit (``set_sync_debug_mode("warn")``, warnings recorded)."""
    pl.seed_everything(0, verbose=False)
    model = GPT(c)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        marks = _SyncMarks(log)
        before = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fit_once(device, c, model, watched, steps, 0, log_every, extra=[marks])
        finally:
            torch.cuda.set_sync_debug_mode(before)
    counts: Counter[int] = Counter()
    bounds = [*marks.starts, (None, marks.end)]
    for (step, start), (_, end) in zip(bounds, bounds[1:]):
        counts[step] += sum(SYNC_WARNING in str(w.message) for w in log[start:end])
    return counts


@dataclass
class Syncs:
    steps: int
    log_every: int
    bare_per_step: float
    watched_per_step: float
    added_per_ordinary_step: float
    added_per_log_step: float
    added_max_ordinary: int
    added_max_log: int


def host_syncs(device: torch.device, c: GPTConfig, steps: int, log_every: int) -> Syncs:
    bare = syncs_per_step(device, c, False, steps, log_every)
    watched = syncs_per_step(device, c, True, steps, log_every)
    counted = range(1, steps)  # step 0: the first loss is read once per fit
    log_steps = {s for s in counted if (s + 1) % log_every == 0}
    added = {s: watched[s] - bare[s] for s in counted}
    ordinary = [added[s] for s in counted if s not in log_steps]
    logged = [added[s] for s in sorted(log_steps)]
    return Syncs(steps=steps, log_every=log_every,
                 bare_per_step=statistics.mean(bare[s] for s in counted),
                 watched_per_step=statistics.mean(watched[s] for s in counted),
                 added_per_ordinary_step=statistics.mean(ordinary) if ordinary else math.nan,
                 added_per_log_step=statistics.mean(logged) if logged else math.nan,
                 added_max_ordinary=max(ordinary, default=0), added_max_log=max(logged, default=0))


# ------------------------------------------------------------------------------------------------ snapshot stall


@dataclass
class Stall:
    snapshot_mb: float
    every: int
    steps: int
    copy_ms: float  # the copy alone, on the compute stream
    #: mode ("off", "on", and on CUDA "on, compute-stream copy": the copy as it was before the side stream) ->
    #: ordinary_ms, after_snapshot_ms, stall_ms (the step after a snapshot less an ordinary one), host_snapshot_ms
    modes: dict[str, dict[str, float]]


@contextlib.contextmanager
def _copy_on_compute_stream() -> Iterator[None]:
    """The snapshot's copy as it was before the side stream: on the compute stream, non-blocking."""
    saved = snapshot_copy.copy_to_host

    def on_compute(dst: list[Tensor], src: list[Tensor], state: Any) -> None:
        compat.copy_all(dst, src, non_blocking=True)

    snapshot_copy.copy_to_host = on_compute  # type: ignore[assignment]
    try:
        yield
    finally:
        snapshot_copy.copy_to_host = saved  # type: ignore[assignment]


def snapshot_stall(device: torch.device, tiny: bool, steps: int = 60, every: int = 5) -> Stall:
    width, depth, batch = (256, 4, 64) if tiny else (4096, 6, 8192)  # 6 x 4096^2 fp32: about 400 MB of weights
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    x = torch.randn(batch, width, device=device)
    state = TrainState(module=model, optimizers=[opt], scaler=scaler, device=device)
    cuda = device.type == "cuda"

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def run(snapshots: bool) -> dict[str, float]:
        ring = SnapshotRing(budget_bytes=2**36, every=every, keep=2) if snapshots else None
        spans: list[tuple[Any, Any, bool]] = []
        host: list[float] = []
        for i in range(steps):
            after = ring is not None and i > 0 and (i - 1) % every == 0
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
            else:
                t0 = time.perf_counter()
                step()
                start, end = t0, time.perf_counter()
            spans.append((start, end, after))
            if ring is not None:
                t = time.perf_counter()
                ring.after_step(i, state)
                if i % every == 0:
                    host.append(1000 * (time.perf_counter() - t))
        _sync(device)
        snapshot_copy.finish()
        # the warm-up left out: the first two snapshots allocate the ring's pinned buffers, the later ones reuse them
        times = [(s.elapsed_time(e) if cuda else 1000 * (e - s), a) for s, e, a in spans[2 * every + 1:]]
        ordinary = statistics.median(t for t, a in times if not a)
        after = [t for t, a in times if a]
        after_ms = statistics.median(after) if after else math.nan
        return {"ordinary_ms": ordinary, "after_snapshot_ms": after_ms,
                "stall_ms": after_ms - ordinary if after else math.nan,
                "host_snapshot_ms": statistics.median(host) if host else math.nan}

    for _ in range(every):
        step()
    # "on": the ring as it is (on CUDA its copy runs on a side stream; on the CPU it is a plain copy)
    modes = {"off": run(False), "on": run(True)}
    if cuda:
        with _copy_on_compute_stream():
            modes["on, compute-stream copy"] = run(True)
    live = [p.detach() for p in model.parameters()]
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in live]
    _sync(device)
    t0 = time.perf_counter()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        compat.copy_all(dst, live, non_blocking=True)
        end.record()
        end.synchronize()
        copy_ms = start.elapsed_time(end)
    else:
        compat.copy_all(dst, live)
        copy_ms = 1000 * (time.perf_counter() - t0)
    nbytes = sum(t.nbytes for t in live)
    return Stall(snapshot_mb=nbytes / 2**20, every=every, steps=steps, copy_ms=copy_ms, modes=modes)


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and few rounds: a check of the code path")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of (bare, watched) fits (default 8; tiny 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per fit (default 60; tiny 8)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument("--skip", nargs="*", default=(), choices=("realistic", "stall", "syncs"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: skipped (run with --device cpu --tiny to check the code path on the CPU)")
        if args.json is not None:
            args.json.write_text(json.dumps({"skipped": "no CUDA"}, indent=2))
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    c = GPTConfig.tiny() if args.tiny else GPTConfig()
    rounds = args.rounds or (2 if args.tiny else 8)
    steps = args.steps or (8 if args.tiny else 60)
    warmup = 2 if args.tiny else 10
    log_every = 4 if args.tiny else 25
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "tiny": args.tiny,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(f"gpu_bench on {out['device']} (torch {out['torch']}){' [tiny]' if args.tiny else ''}", flush=True)
    if args.tiny or device.type != "cuda":
        print("  (a check of the code path: these figures measure nothing that docs/gpu.md reports)", flush=True)
    if "realistic" not in args.skip:
        print(f"watched vs bare: {rounds} rounds of 2 fits x {steps} steps ...", flush=True)
        r = realistic(device, c, rounds, steps, warmup, log_every)
        out["realistic"] = asdict(r)
        ci = f"95% CI {r.ratio_ci95[0]:.3f}..{r.ratio_ci95[1]:.3f}" if r.ratio_ci95 else "no 95% CI (too few rounds)"
        print(f"  {r.parameters / 1e6:.1f}M parameters: bare {r.bare_ms_median:.2f} ms, watched "
              f"{r.watched_ms_median:.2f} ms a step; watched/bare median {r.ratio_median:.3f}, {ci}")
    if "stall" not in args.skip:
        print("snapshot stall ...", flush=True)
        s = snapshot_stall(device, args.tiny)
        out["stall"] = asdict(s)
        print(f"  snapshot {s.snapshot_mb:.0f} MB every {s.every} steps; the copy alone {s.copy_ms:.2f} ms")
        for mode, m in s.modes.items():
            print(f"  {mode:24s} ordinary {m['ordinary_ms']:.2f} ms, after a snapshot {m['after_snapshot_ms']:.2f} ms "
                  f"(stall {m['stall_ms']:+.2f} ms), host time of a snapshot {m['host_snapshot_ms']:.2f} ms")
    if "syncs" not in args.skip:
        if device.type == "cuda":
            print("host syncs per step ...", flush=True)
            y = host_syncs(device, c, 24 if not args.tiny else 8, 8 if not args.tiny else 4)
            out["syncs"] = asdict(y)
            print(f"  bare {y.bare_per_step:.2f}, watched {y.watched_per_step:.2f} syncs a step; added: "
                  f"{y.added_per_ordinary_step:.2f} on an ordinary step (max {y.added_max_ordinary}), "
                  f"{y.added_per_log_step:.2f} on a log step (max {y.added_max_log})")
        else:
            out["syncs"] = {"skipped": "host syncs are counted on CUDA only"}
            print("  host syncs: counted on CUDA only")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
