"""A LitGPT-shaped Fabric loop watched by FabricWatch: a hand-written attention overflows float16.

Run it:  python examples/fabric_loop.py      (a few seconds on a CPU after the imports; no GPU needed)

The loop is written the way LitGPT's pretrain script writes its own: a tiny GPT set up with ``fabric.setup``,
micro-batches accumulated under ``fabric.no_backward_sync``, gradients clipped with ``fabric.clip_gradients``, a
warm-up-then-cosine learning rate the loop sets itself at the top of each iteration, metrics through
``fabric.log_dict``. The model's attention takes ``exp()`` of raw scores (no max subtracted, no 1/sqrt(d)
scaling): fine in float32, but in float16 the scores pass ~11 once training sharpens them, and exp overflows.

FabricWatch names it FORWARD_OVERFLOW in ``transformer.h.0.attn`` (the FP32 control, run around Fabric's autocast
through ``step_loss``, stays finite), rolls the run back to before the onset, runs that module in float32 from
then on, and checks that the run recovered. The script exits 1 if FabricWatch does not name the fault there.
"""

import math
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ampwatch import Finding
from lightning_ampwatch.fabric import FabricWatch
from lightning_ampwatch.scenarios import expect


@dataclass
class Config:
    vocab_size: int = 32
    block_size: int = 16
    n_layer: int = 1
    n_embd: int = 32
    n_head: int = 2


@dataclass
class TrainArgs:
    micro_batch_size: int = 8
    gradient_accumulation_iters: int = 2
    max_steps: int = 60
    lr: float = 1e-2
    warmup_steps: int = 5
    max_norm: float = 1.0
    log_interval: int = 10


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        mask = torch.ones(config.block_size, config.block_size, dtype=torch.bool).tril()
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1)  # no 1/sqrt(head_size)
        weights = scores.exp().masked_fill(~self.mask[:T, :T], 0.0)  # no max subtracted: overflows float16
        weights = weights / weights.sum(-1, keepdim=True)
        y = (weights @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.norm_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config) for _ in range(config.n_layer)),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def step_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """One micro-batch's loss: next-token cross-entropy. FabricWatch calls it again to replay a faulty step."""
    input_ids, targets = batch[:, :-1], batch[:, 1:]
    logits = model(input_ids)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def token_data(config: Config, n: int = 512) -> TensorDataset:
    """Sequences that repeat a short random motif: a pattern attention learns to copy, sharpening its scores."""
    g = torch.Generator().manual_seed(0)
    motifs = torch.randint(0, config.vocab_size, (n, 4), generator=g)
    return TensorDataset(motifs.repeat(1, (config.block_size + 1) // 4 + 1)[:, : config.block_size + 1])


class CycleIterator:
    """Loops over a dataloader for ever, as LitGPT's does."""

    def __init__(self, iterable: DataLoader) -> None:
        self.iterable = iterable
        self.epoch = 0

    def __iter__(self):
        while True:
            for item in self.iterable:
                yield item
            self.epoch += 1


def get_lr(base_lr: float, step: int, train: TrainArgs) -> float:
    """Linear warm-up, then cosine decay: set by the loop itself at the top of each iteration, as pretrain.py does."""
    if step < train.warmup_steps:
        return base_lr * (step + 1) / train.warmup_steps
    progress = (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def fit(fabric: Fabric, train: TrainArgs, config: Config, out_dir: str) -> FabricWatch:
    with fabric.init_module():
        model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(token_data(config), batch_size=train.micro_batch_size))

    # remediate=True: a fault FabricWatch can fix is fixed mid-run (from a snapshot taken before it), then verified
    watch = FabricWatch(fabric, loss_fn=step_loss, remediate=True, snapshot_every=5, log_dir=out_dir,
                        log_every_n_steps=train.log_interval)
    watch.attach(model, optimizer, gradient_clip_val=train.max_norm)  # the replays clip as the loop does

    iter_num = step_count = 0
    for batch in CycleIterator(loader):
        if step_count >= train.max_steps or watch.should_stop:
            break
        lr = get_lr(train.lr, step_count, train)  # FabricWatch notes the rate each step runs with
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        iter_num += 1
        is_accumulating = iter_num % train.gradient_accumulation_iters != 0
        (batch,) = batch
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = step_loss(model, batch)
            fabric.backward(loss / train.gradient_accumulation_iters)
        if is_accumulating:
            watch.accumulate(batch)  # a micro-batch whose gradients wait for the optimizer step
            continue
        # under 16-mixed an overflowed step is the scaler's to skip: error_if_nonfinite=True would raise instead
        fabric.clip_gradients(model, optimizer, max_norm=train.max_norm, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
        watch.step(batch, loss)  # once per optimizer step, after it
        step_count += 1
        if step_count % train.log_interval == 0:
            fabric.log_dict({"loss": loss.item(), "lr": lr}, step=step_count)
            fabric.print(f"step {step_count}: loss {loss.item():.3f}")
    watch.close()
    return watch


def main() -> int:
    torch.set_num_threads(1)  # a model this small trains fastest on one thread (several fight over a busy CPU)
    out_dir = tempfile.mkdtemp(prefix="ampwatch-fabric_loop-")
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        # Real float16 autocast and a real GradScaler on the CPU (precision="16-mixed" would mean bf16 there).
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
        loggers=CSVLogger(out_dir, name="fabric_loop"),
    )
    fabric.seed_everything(0)
    watch = fit(fabric, TrainArgs(), Config(), out_dir)
    return expect(watch, Finding.FORWARD_OVERFLOW, location="transformer.h.0.attn")


if __name__ == "__main__":
    sys.exit(main())
