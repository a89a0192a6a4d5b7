"""A small GPT (after nanoGPT) as an `nn.Sequential` a pipeline can cut, with synthetic data.

    model = gpt(GPTConfig(), seed=0)           # [Embed, Block x n_layer, Head]
    inputs, targets = synthetic_batch(GPTConfig(), rows=32, seed=1)
    loss = lm_loss(model(inputs), targets)

Every matmul with a weight is an `nn.Linear`, so split backward defers all of them to W.
The data: each sequence walks a fixed random permutation of the vocabulary (token t is followed
by perm[t]) from a random start, with a little noise; a model that learns the permutation drives
the loss well below log(vocab).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    context: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64


class Embed(nn.Module):
    """Token plus position embeddings."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(c.vocab, c.n_embd)
        self.positions = nn.Embedding(c.context, c.n_embd)

    def forward(self, idx: Tensor) -> Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention then a 4x MLP, each with a residual."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.out = nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(c.n_embd)
        self.logits = nn.Linear(c.n_embd, c.vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.logits(self.ln(x))


def gpt(c: GPTConfig, seed: int = 0) -> nn.Sequential:
    """The whole model, initialised from `seed` (GPT-2 style: normal(0, 0.02), scaled residual outputs)."""
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(Embed(c), *(Block(c) for _ in range(c.n_layer)), Head(c))
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * c.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=generator) * std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    return model


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(c: GPTConfig, rows: int, seed: int, noise: float = 0.05) -> tuple[Tensor, Tensor]:
    """`rows` sequences of `context` tokens and their next tokens (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(c.vocab, generator=torch.Generator().manual_seed(12345))  # the same rule for every batch
    seq = torch.empty(rows, c.context + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, c.vocab, (rows,), generator=generator)
    for t in range(c.context):
        seq[:, t + 1] = perm[seq[:, t]]
    flips = torch.rand(seq.shape, generator=generator) < noise
    seq[flips] = torch.randint(0, c.vocab, (int(flips.sum()),), generator=generator)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
