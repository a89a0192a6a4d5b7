"""Split backward the Zero Bubble way: B computes input gradients, W the weight gradients, one graph walk.

A stage's `nn.Linear` layers run through `_SplitLinear`, a custom autograd function. Its backward
always computes the input gradient (`grad_out @ weight`). What it does with the weight gradient
depends on the stage's `WeightGradStore`:

- fused backward (BW): it accumulates the weight and bias gradients into `.grad` at once;
- split backward (B): it stashes `(layer, input, grad_out)` under the micro-batch's key; the
  autograd graph (and every other saved tensor) is freed when B ends;
- W (`WeightGradStore.flush(key)`): pops the stash and accumulates each layer's weight and bias
  gradients, with no autograd engine call and no graph walk.

So B + W do exactly the matmuls of one fused backward. Parameters of other layers (LayerNorm,
embeddings, ...) get their gradients in B: they are cheap. The store belongs to one stage object;
nothing here is global.

A worker whose stream has no B (1F1B, interleaved 1F1B) never splits: the trainer sets the store's
`needed` to False and its layers run plain `F.linear` under autograd, without the custom function,
whose Python forward and backward per layer were the runtime's own cost at small widths
(`bench/bench_runtime.py --paired`).

Accumulation is in place, `grad.addmm_(grad_out^T, input)` (one GEMM with beta = 1, as Megatron's
gradient-accumulation fusion does), instead of autograd's new tensor per micro-batch plus an add:
less memory traffic, no allocation. Hence the weight gradient never goes back through autograd
(post-accumulate-grad hooks on these weights do not fire).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Key = Hashable


class WeightGradStore:
    """What W needs, per micro-batch: each split linear layer's input and output gradient.

    The stage sets the micro-batch key around each forward (`with store.forward(key)`), and the
    mode around each backward (`with store.backward(split=...)`); the layers read both.
    """

    def __init__(self) -> None:
        self._pending: dict[Key, list[tuple[nn.Linear, Tensor, Tensor]]] = {}
        self.key: Key | None = None
        self.split = False
        self.needed = True

    @contextmanager
    def forward(self, key: Key) -> Iterator[None]:
        self.key = key
        try:
            yield
        finally:
            self.key = None

    @contextmanager
    def backward(self, split: bool) -> Iterator[None]:
        self.split = split
        try:
            yield
        finally:
            self.split = False

    def stash(self, key: Key, layer: nn.Linear, x: Tensor, grad_out: Tensor) -> None:
        self._pending.setdefault(key, []).append((layer, x, grad_out))

    def pending(self) -> tuple[Key, ...]:
        """Micro-batches whose weight gradients are still owed (B done, W not yet)."""
        return tuple(self._pending)

    def clear(self) -> None:
        """Drop every stash (an aborted iteration)."""
        self._pending.clear()

    def drop(self, key: Key) -> None:
        """Drop one micro-batch's stash (it was lost to a failure; lossy recovery)."""
        self._pending.pop(key, None)

    @torch.no_grad()
    def flush(self, key: Key) -> None:
        """W of micro-batch `key`: the weight-gradient matmuls, accumulated into `.grad`."""
        for layer, x, grad_out in self._pending.pop(key, ()):
            accumulate_weight_grads(layer, x, grad_out)


@torch.no_grad()
def accumulate_weight_grads(layer: nn.Linear, x: Tensor, grad_out: Tensor) -> None:
    """Add the gradients of `layer(x)` for its weight (one GEMM) and bias (one sum) to their `.grad`."""
    weight, bias = layer.weight, layer.bias
    # under autocast the saved tensors may be in half precision: weight gradients are the master
    # weights' own dtype (float32), as autograd would give them
    g = grad_out.reshape(-1, grad_out.shape[-1]).to(weight.dtype)
    if weight.requires_grad:
        x = x.reshape(-1, x.shape[-1]).to(weight.dtype)
        if weight.grad is None:
            weight.grad = g.t().mm(x)
        else:
            weight.grad.addmm_(g.t(), x)
    if bias is not None and bias.requires_grad:
        if bias.grad is None:
            bias.grad = g.sum(0)
        else:
            bias.grad.add_(g.sum(0))


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, layer: nn.Linear, store: WeightGradStore, key: Key
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.store, ctx.key = layer, store, key
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight.to(grad_out.dtype)) if ctx.needs_input_grad[0] else None  # autocast: half
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            if ctx.store.split:
                ctx.store.stash(ctx.key, ctx.layer, x, grad_out)
            else:
                accumulate_weight_grads(ctx.layer, x, grad_out)
        return grad_x, None, None, None, None, None


def _split_linear_forward(layer: nn.Linear, store: WeightGradStore, x: Tensor) -> Tensor:
    if store.key is None or not store.needed or not torch.is_grad_enabled():
        return F.linear(x, layer.weight, layer.bias)  # no backward to split (evaluation, shape probe)
    return _SplitLinear.apply(x, layer.weight, layer.bias, layer, store, store.key)


def enable_split_backward(module: nn.Module, store: WeightGradStore) -> int:
    """Route every `nn.Linear` of `module` through the split function; return how many.

    Only the instance's `forward` is replaced, so parameters, state-dict keys and hooks stay as
    they were. Layers whose weights are used without calling `forward` (e.g. the output projection
    inside `nn.MultiheadAttention`) keep plain autograd: their weight gradients arrive in B, which is
    still correct, only not deferred.
    """
    count = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            layer.forward = partial(_split_linear_forward, layer, store)  # type: ignore[method-assign]
            count += 1
    return count
