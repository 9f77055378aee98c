"""Small real models for the "healthy reference" tests: a char-level GPT of 2 layers, a frozen backbone with a
small head. Each learns its synthetic data in a few dozen CPU steps at a sane learning rate, so a too-high one
shows what it does to a real run."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

VOCAB, CONTEXT = 24, 16


def char_data(n: int = 512, seed: int = 0) -> TensorDataset:
    """Sequences from a fixed random Markov chain over VOCAB symbols (each symbol has 3 likely successors): a
    healthy model gets well below the uniform loss log(VOCAB) = 3.18 in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, VOCAB, (VOCAB, 3), generator=g)
    seqs = torch.empty(n, CONTEXT + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(CONTEXT):
        pick = torch.randint(0, 3, (n,), generator=g)
        seqs[:, t + 1] = succ[seqs[:, t], pick]
    return TensorDataset(seqs[:, :-1], seqs[:, 1:])


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(pl.LightningModule):
    """A char-level GPT: 2 blocks, width 32, trained with AdamW (``lr``), optionally a linear warmup to ``lr``
    over ``warmup`` steps."""

    def __init__(self, lr: float = 3e-3, warmup: int = 0, dim: int = 32) -> None:
        super().__init__()
        self.lr, self.warmup = lr, warmup
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(CONTEXT, dim))
        self.blocks = nn.ModuleList([Block(dim, 2) for _ in range(2)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB).float(), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.warmup:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def features_data(n: int = 1024, dim: int = 32, classes: int = 10, seed: int = 0) -> TensorDataset:
    """Gaussian features whose class is a fixed linear readout of them: a head on a frozen
    backbone learns it to a loss well under log(10) = 2.3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    return TensorDataset(x, (x @ w).argmax(-1))


class FrozenBackbone(pl.LightningModule):
    """A pretrained-style backbone (frozen: its weights never change) with a small trainable head, trained with
    plain SGD at ``lr``. ``hard_batches``: those batch indices are made hard (their features scaled up ``hard``
    their labels shifted by one class: a trained head is confidently wrong there), the loss jumps on them and
    comes back after."""

    def __init__(self, lr: float = 0.1, dim: int = 32, classes: int = 10, hard_batches: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.lr, self.hard_batches = lr, hard_batches
        self.backbone = nn.Sequential(nn.Linear(dim, 128), nn.ReLU(), nn.LayerNorm(128, elementwise_affine=False))
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(128, classes)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if self.trainer.global_step in self.hard_batches:
            y = (y + 1) % self.head.out_features
        return nn.functional.cross_entropy(self.head(self.backbone(x)).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=self.lr)
