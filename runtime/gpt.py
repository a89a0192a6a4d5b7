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
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from schedcomp.costs import CostModel


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


def stage_memory(c: GPTConfig, rows: int, module: nn.Module, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """Planned (bytes one micro-batch's forward saves for backward, bytes its B keeps for W) at a
    stage made of `module`'s Embed / Block / Head layers, for `rows` sequences of `c.context` tokens.

    Per token, with d = n_embd, h = n_head, V = vocab, in units of the element size (what autograd
    saves; `runtime.memory` measures the same thing):
    - Block: ln1 input, its output, the qkv output (q, k, v are views of it), the attention output
      (the proj input is a view of it), ln2 input and output, fc output, gelu output = 16d; each
      LayerNorm's mean and rstd = 4; attention's log-sum-exp = h. B keeps, per split linear, its
      input and output gradient: qkv d + 3d, proj d + d, fc d + 4d, out 4d + d = 16d.
    - Head: LayerNorm input, output, 2 statistics; the log-softmax output = 2d + 2 + V; the targets
      (int64). B keeps the logits layer's input and output gradient, d + V.
    - Embed: the token and position indices (int64).
    """
    tokens, e = rows * c.context, torch.empty((), dtype=dtype).element_size()
    d, h, v = c.n_embd, c.n_head, c.vocab
    saved = kept = 0
    for layer in module.modules():
        if isinstance(layer, Block):
            saved += tokens * e * (16 * d + 4 + h)
            kept += tokens * e * 16 * d
        elif isinstance(layer, Head):
            saved += tokens * e * (2 * d + 2 + v) + tokens * 8
            kept += tokens * e * (d + v)
        elif isinstance(layer, Embed):
            saved += tokens * 8 + c.context * 8
    return saved, kept


def memory_costs(c: GPTConfig, rows: int, layers_per_stage: Sequence[int],
                 dtype: torch.dtype = torch.float32) -> CostModel:
    """A unit-time cost model whose activation memory is `stage_memory`'s, in bytes, for the pipeline
    `layers_per_stage` cuts `gpt(c)` into: what a plan needs to hold a GPT's activations within a limit
    in bytes before anything was measured."""
    from schedcomp.runtime.stage import split_sequential

    model = gpt(c)
    pp = len(layers_per_stage)
    saved, kept = zip(*(stage_memory(c, rows, split_sequential(model, s, pp, layers_per_stage), dtype)
                        for s in range(pp)), strict=True)
    return CostModel(forward=(1.0,) * pp, backward_input=(1.0,) * pp, backward_weight=(1.0,) * pp,
                     activation=saved, b_frees=tuple(1 - k / a if a else 1.0 for a, k in zip(saved, kept, strict=True)),
                     memory_unit="bytes")
