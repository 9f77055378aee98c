"""Models written the way users write them (not the project's scenarios), for the intervention tests of issue 30.

Each failure comes from the real mechanism, in true float16 on the CPU (``MixedPrecision("16-mixed", "cpu")`` with
a real GradScaler). :func:`measure` trains one of them WITHOUT AmpWatch and returns the loss and the scale at every
step: the truth the tests' expectations rest on. ``python tests/_user_models.py`` prints it.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset


def fp16_plugin(**scaler_kwargs: Any) -> MixedPrecision:
    """True float16 autocast and a real GradScaler on the CPU (``precision="16-mixed"`` would silently be bf16)."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


def trainer(callbacks: list[Any], root: str, *, fp16: bool = True, steps: int = 40, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(accelerator="cpu", devices=1, max_steps=steps, max_epochs=-1, logger=False,
                                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                   num_sanity_val_steps=0, default_root_dir=root, callbacks=callbacks)
    if fp16:
        options["plugins"] = [fp16_plugin()]
    options.update(kwargs)
    return pl.Trainer(**options)


# ---------------------------------------------------------------------------------------------------------------
# 1. A 2-block LM whose attention computes exp() of unscaled q @ k.T (no max subtracted), 10-step linear warmup
# ---------------------------------------------------------------------------------------------------------------

VOCAB, SEQ = 32, 8


class ExpSelfAttention(nn.Module):
    """Causal self-attention written by hand: exp(q @ k.T) normalised by its row sums, with no 1/sqrt(d) and no max
    subtracted. Its scores grow as the model learns; float16's exp() overflows past about 11."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        weights = (q @ k.transpose(-1, -2)).exp()
        weights = weights * torch.tril(torch.ones(x.shape[1], x.shape[1], device=x.device)).to(weights.dtype)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.out(weights @ v)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = ExpSelfAttention(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class TinyLM(pl.LightningModule):
    """Next-token prediction on sequences that follow ``t -> (3 t + 1) mod VOCAB`` from a random start."""

    def __init__(self, dim: int = 32, peak_lr: float = 2e-3, warmup: int = 10) -> None:
        super().__init__()
        self.peak_lr, self.warmup = peak_lr, warmup
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.peak_lr)
        if not self.warmup:
            return opt
        warm = self.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def lm_data(n: int = 2048, batch_size: int = 32, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    rows = [start]
    for _ in range(SEQ):
        rows.append((3 * rows[-1] + 1) % VOCAB)
    return DataLoader(TensorDataset(torch.cat(rows, 1)), batch_size=batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------------------------
# 2. A regression with a summed MSE (in float32) and targets up to 1.8e4
# ---------------------------------------------------------------------------------------------------------------


class SummedMse(pl.LightningModule):
    """An MLP whose loss is ``((pred.float() - y) ** 2).sum()``: the targets never enter a float16 op, but the
    summed loss's gradients are large, and the scaler has to come down from 2**16 a long way."""

    def __init__(self, lr: float = 1.0) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        pred = self.net(x).float().squeeze(-1)
        return ((pred - y) ** 2).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def regression_targets(n: int = 4096, batch_size: int = 64, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 8, generator=g)
    y = 1.8e4 * x[:, :4].mean(1) * x[:, 4]  # up to 1.8e4, in float32
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class BigTargets(pl.LightningModule):
    """Targets up to 1.5e5 that the model's own float16 output must reach: past 65504 it is inf (the loss, in float32
    and scaled by 1e-8, is fine)."""

    def __init__(self, lr: float = 20.0) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float().squeeze(-1), y) / 1e8

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def big_targets(n: int = 2048, batch_size: int = 64, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 8, generator=g)
    return DataLoader(TensorDataset(x, 1.5e5 * x[:, :4].mean(1)), batch_size=batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------------------------
# 3. A frozen backbone that Lightning's BackboneFinetuning unfreezes at step 40 as a new param group at an LR of 1.0
# ---------------------------------------------------------------------------------------------------------------


class Finetune(pl.LightningModule):
    """A frozen backbone and a head, as ``BackboneFinetuning`` expects (``self.backbone``): the callback unfreezes
    the backbone at epoch 1 (step 40: 40 batches an epoch) as a new param group, here at an LR of 1.0."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)).float().squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-3)


def finetune_data(n: int = 1280, batch_size: int = 32, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :4].sum(1) - x[:, 4:].prod(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def backbone_finetuning() -> Any:
    from lightning.pytorch.callbacks import BackboneFinetuning

    return BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=1.0, should_align=False)


# ---------------------------------------------------------------------------------------------------------------
# 5. Tabular regression on raw sensor features (columns in the thousands) where a glitching sensor writes 1e5 into
#    one row of every ``every``-th batch; AdamW, a 5-step linear warmup then cosine
# ---------------------------------------------------------------------------------------------------------------


def warmup_cosine(opt: torch.optim.Optimizer, warmup: int, steps: int) -> Any:
    """``configure_optimizers``' answer: a linear warmup over ``warmup`` steps, then cosine to 0 at ``steps``."""

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor), "interval": "step"}]


class RawFeatures(pl.LightningModule):
    """A GELU MLP on the raw features; under float16 autocast the first Linear's input cast overflows on a glitched
    row (1e5 > 65504), the loss goes inf and the scaler skips the step. FP32 trains through it."""

    def __init__(self, lr: float = 3e-3, steps: int = 40, warmup: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 1))
        self.lr, self.steps, self.warmup = lr, steps, warmup

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1).float(), y)

    def configure_optimizers(self) -> Any:
        return warmup_cosine(torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01), self.warmup,
                             self.steps)


def raw_features(n_batches: int = 40, batch_size: int = 64, every: int = 9, seed: int = 3) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * batch_size, 12, generator=g) * torch.tensor([1500.0] * 4 + [40.0] * 4 + [1.0] * 4)
    x = x + 2000.0
    y = x[:, :4].sum(1) / 3000.0 + x[:, 4:8].mean(1) / 40.0
    y = (y - y.mean()) / y.std()
    for b in range(every - 1, n_batches, every):  # batches 8, 17, 26, 35
        x[b * batch_size + 5, 0] = 1.0e5
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------------------------
# 6. An HF-style encoder whose padding mask is added the old way, (1 - mask) * -1e9 in the scores' dtype: -inf in
#    float16, and a sequence with no real token (every position padded) gives a row of -inf whose softmax is NaN
# ---------------------------------------------------------------------------------------------------------------

PAD_T, PAD_D = 12, 32


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(PAD_D, 3 * PAD_D)
        self.o = nn.Linear(PAD_D, PAD_D)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(PAD_D)
        scores = scores + (1.0 - mask[:, None, :].to(scores.dtype)) * -1e9
        return self.o(scores.softmax(-1) @ v)


class PadMaskEncoder(pl.LightningModule):
    def __init__(self, lr: float = 1e-3, steps: int = 60, warmup: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB * 2, PAD_D)
        self.ln = nn.ModuleList([nn.LayerNorm(PAD_D) for _ in range(2)])
        self.attn = nn.ModuleList([MaskedAttention() for _ in range(2)])
        self.head = nn.Linear(PAD_D, 2)
        self.lr, self.steps, self.warmup = lr, steps, warmup

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids, mask, y = batch
        x = self.emb(ids)
        for ln, attn in zip(self.ln, self.attn):
            x = x + attn(ln(x), mask)
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return nn.functional.cross_entropy(self.head(pooled).float(), y)

    def configure_optimizers(self) -> Any:
        return warmup_cosine(torch.optim.AdamW(self.parameters(), lr=self.lr), self.warmup, self.steps)


def pad_mask_data(n_batches: int = 60, batch_size: int = 16, every: int = 11, seed: int = 5) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    n = n_batches * batch_size
    ids = torch.randint(1, VOCAB * 2, (n, PAD_T), generator=g)
    lens = torch.randint(3, PAD_T + 1, (n,), generator=g)
    for b in range(every - 1, n_batches, every):  # batches 10, 21, 32, 43, 54: one empty text each
        lens[b * batch_size + 2] = 0
    mask = (torch.arange(PAD_T)[None, :] < lens[:, None]).float()
    ids = ids * mask.long()
    return DataLoader(TensorDataset(ids, mask, (ids[:, 0] % 2).long()), batch_size=batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------------------------
# 7. Multi-label tagging on a frozen "pretrained" encoder with a new head and BCE written by hand (as users do where
#    autocast bans binary_cross_entropy): once a logit passes ~8.3, float16's sigmoid rounds to exactly 1, log(1 - p)
#    is -inf, and 0 * -inf is NaN. Float32 rounds to 1 only past ~17
# ---------------------------------------------------------------------------------------------------------------


class HandBce(pl.LightningModule):
    def __init__(self, lr: float = 3e-2, steps: int = 80, warmup: int = 5) -> None:
        super().__init__()
        self.base = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.base.requires_grad_(False)
        with torch.no_grad():  # large weights, as a trained net's are
            for m in self.base:
                if isinstance(m, nn.Linear):
                    m.weight.mul_(3.0)
        self.head = nn.Linear(128, 16)
        self.lr, self.steps, self.warmup = lr, steps, warmup

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        p = torch.sigmoid(self.head(self.base(x)))
        return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()

    def configure_optimizers(self) -> Any:
        return warmup_cosine(torch.optim.AdamW(self.head.parameters(), lr=self.lr), self.warmup, self.steps)


def tagging_data(n_batches: int = 80, batch_size: int = 32, seed: int = 9) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * batch_size, 32, generator=g)
    y = ((x @ torch.randn(32, 16, generator=g)) > 0.5).float()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


# ---------------------------------------------------------------------------------------------------------------
# the truth, measured without AmpWatch
# ---------------------------------------------------------------------------------------------------------------


class Tape(pl.Callback):
    """The loss and the scaler's scale after every optimizer step (a measurement: it reads the device each step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.scales: list[float | None] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else None)

    def skips(self) -> list[int]:
        """The steps the scaler skipped (its scale fell after them)."""
        if not self.scales or self.scales[0] is None:
            return []
        scales = [65536.0, *self.scales]
        # (a scale of None: no scaler any more, after a switch to bf16: no step skipped)
        return [i for i in range(len(self.scales))
                if scales[i + 1] is not None and scales[i] is not None and scales[i + 1] < scales[i]]


MODELS: dict[str, tuple[Callable[..., pl.LightningModule], Callable[[], DataLoader]]] = {
    "lm": (TinyLM, lm_data),
    "regression": (SummedMse, regression_targets),
    "finetune": (Finetune, finetune_data),
    "big_targets": (BigTargets, big_targets),
    "raw_features": (RawFeatures, raw_features),
    "pad_mask": (PadMaskEncoder, pad_mask_data),
    "hand_bce": (HandBce, tagging_data),
}


def measure(name: str, root: str, *, fp16: bool, steps: int, seed: int = 0, **model_kwargs: Any) -> Tape:
    make, data = MODELS[name]
    pl.seed_everything(seed, verbose=False)
    model = make(**model_kwargs)
    tape = Tape()
    trainer([tape], root, fp16=fp16, steps=steps).fit(model, data())
    return tape


def _row(tape: Tape) -> str:
    nonfinite = [i for i, v in enumerate(tape.losses) if not math.isfinite(v)]
    finite = [v for v in tape.losses if math.isfinite(v)]
    scales = sorted({s for s in tape.scales if s is not None})
    return (f"loss {tape.losses[0]:.4g} -> {tape.losses[-1]:.4g} (last finite {finite[-1] if finite else None}); "
            f"{len(tape.skips())} skips, first {sorted(tape.skips())[:6]}; non-finite losses at {nonfinite[:6]}; "
            f"final scale {tape.scales[-1]}; lowest {scales[0] if scales else None}")


if __name__ == "__main__":  # python tests/_user_models.py [name ...]
    import tempfile

    for name in sys.argv[1:] or list(MODELS):
        cases: list[tuple[str, dict[str, Any]]] = [("", {})]
        if name == "lm":
            cases = [("warmup 10", {}), ("no warmup", {"warmup": 0}), ("peak/10", {"peak_lr": 2e-4})]
        for label, kwargs in cases:
            for fp16 in (False, True):
                with tempfile.TemporaryDirectory() as root:
                    tape = measure(name, root, fp16=fp16, steps=int(kwargs.pop("steps", 128)), **kwargs)
                print(f"{name} {label} {'fp16' if fp16 else 'fp32'}: {_row(tape)}", flush=True)
