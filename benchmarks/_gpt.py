"""A GPT-2-shaped decoder built in code, its synthetic batches and one training step.

Used by ``gpu_check.py``. ``medium`` is GPT-2 medium's shape (24 layers,
d=1024, 16 heads, ~355M parameters; its AdamW checkpoint is ~4.3 GB in fp32);
``gpt2`` (GPT-2 small's shape, ~124M parameters, a ~1.5 GB AdamW checkpoint,
short sequences) is the CPU goal's size: a 1.5 GB save against steps
of a few seconds on 2 cores; ``tiny`` is the same code at a size a 2-core CPU
runs in milliseconds (what CI runs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    layers: int
    d: int
    heads: int
    vocab: int
    seq: int
    batch: int


SHAPES = {
    "tiny": Shape(layers=2, d=64, heads=4, vocab=512, seq=32, batch=4),
    "small": Shape(layers=4, d=256, heads=4, vocab=4096, seq=128, batch=8),
    "gpt2": Shape(layers=12, d=768, heads=12, vocab=50304, seq=128, batch=2),
    "medium": Shape(layers=24, d=1024, heads=16, vocab=50304, seq=1024, batch=16),
    # medium's tensors (as many, with the same names), tiny's bytes: per-tensor costs
    "thin": Shape(layers=24, d=64, heads=4, vocab=512, seq=32, batch=4),
}


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.d)
        self.qkv = nn.Linear(s.d, 3 * s.d)
        self.proj = nn.Linear(s.d, s.d)
        self.ln2 = nn.LayerNorm(s.d)
        self.up = nn.Linear(s.d, 4 * s.d)
        self.down = nn.Linear(4 * s.d, s.d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.wte = nn.Embedding(s.vocab, s.d)
        self.wpe = nn.Embedding(s.seq, s.d)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln_f = nn.LayerNorm(s.d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x) @ self.wte.weight.T  # tied head


def batch(s: Shape, step: int, device: torch.device) -> torch.Tensor:
    """Token ids for ``step``: a pure function of the step (replays are bit-exact)."""
    g = torch.Generator().manual_seed(10_000 + step)
    return torch.randint(0, s.vocab, (s.batch, s.seq + 1), generator=g).to(device)


def forward_backward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Loss and gradients of one batch, under bf16 autocast (on CUDA and CPU alike)."""
    dev = tokens.device.type
    ctx = torch.autocast(dev, dtype=torch.bfloat16) if dev == "cuda" else contextlib.nullcontext()
    with ctx:
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # foreach: the multi-tensor kernels most training runs use.
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
