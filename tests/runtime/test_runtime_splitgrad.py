"""Split backward: B + W give the fused gradients, with the fused backward's matmuls and no second graph walk."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from schedcomp.runtime import splitgrad
from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, synthetic_batch
from schedcomp.runtime.stage import Stage

CONFIG = GPTConfig(vocab=32, context=8, n_layer=2, n_head=2, n_embd=16)
_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}


class OpLog(TorchDispatchMode):
    """Counts every aten op run while active, by name (e.g. `mm`, `native_layer_norm_backward`),
    and the FLOPs of the matrix products (in-place `addmm_` included, which FlopCounterMode skips)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in _MATMULS:  # the last two arguments are the factors: [..., m, k] @ [..., k, n]
            self.flops += 2 * args[-2].numel() * args[-1].shape[-1]
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> int:
        return sum(n for name, n in self.ops.items() if name in _MATMULS)


def _stage(index: int, stages: int) -> tuple[Stage, nn.Module]:
    """A stage of the small GPT (all of it when stages == 1) and an untouched copy of its module."""
    model = gpt(CONFIG, seed=3).double()
    module = model if stages == 1 else nn.Sequential(*list(model)[: len(model) // 2])
    plain = copy.deepcopy(module)
    return Stage(index, stages, module, lm_loss, lambda p: torch.optim.SGD(p, lr=0.1)), plain


def _batch() -> tuple[Tensor, Tensor]:
    return synthetic_batch(CONFIG, rows=4, seed=5)


@contextmanager
def _no_autograd_engine() -> Iterator[None]:
    """Fail if anything starts the autograd engine (backward or grad) while active."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the autograd engine ran during W")

    saved = (torch.autograd.backward, torch.autograd.grad, Tensor.backward)
    torch.autograd.backward = torch.autograd.grad = Tensor.backward = refuse  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autograd.backward, torch.autograd.grad, Tensor.backward = saved  # type: ignore[assignment]


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("split", [True, False])
def test_split_and_fused_backward_equal_plain_autograd(split: bool) -> None:
    stage, plain = _stage(0, 1)
    x, y = _batch()
    stage.forward((0, 0), (x,), y, scale=0.5)
    stage.backward((0, 0), (), split=split)
    if split:
        assert stage.store.pending() == ((0, 0),)  # B deferred the weight gradients
        assert all(p.grad is None for n, p in stage.module.named_parameters() if "logits" in n or ".fc." in n)
        stage.backward_weight((0, 0))
    assert stage.in_flight() == 0 and stage.store.pending() == ()
    (lm_loss(plain(x), y) * 0.5).backward()
    got, want = _grads(stage.module), _grads(plain)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-12), name


def test_a_stage_that_never_splits_runs_plain_linear_layers() -> None:
    """`store.needed = False` (a worker whose stream has no B, e.g. 1F1B): no custom autograd function in the
    graph (its Python backward was the runtime's own cost at small widths), and the same gradients."""
    stage, plain = _stage(0, 1)
    x, y = _batch()
    stage.store.needed = False
    stage.forward((0, 0), (x,), y, scale=0.5)
    nodes, seen = [stage._saved[(0, 0)][1][0].grad_fn], set()
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes += [n for n, _ in node.next_functions]
    assert seen and not any("SplitLinear" in type(n).__name__ for n in seen)
    stage.backward((0, 0), (), split=False)
    (lm_loss(plain(x), y) * 0.5).backward()
    got, want = _grads(stage.module), _grads(plain)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=0, atol=1e-12), name


def test_input_gradients_of_a_middle_stage_match_autograd() -> None:
    stage, plain = _stage(1, 3)  # a middle stage: takes an output gradient, returns the input gradient
    x = torch.randn(4, CONFIG.context, CONFIG.n_embd, dtype=torch.float64)
    stage.module[0] = nn.Identity()  # a middle stage takes hidden states, not tokens
    plain[0] = nn.Identity()
    (out,) = stage.forward((0, 1), (x.clone(),))
    grad_out = torch.randn_like(out)
    (grad_in,) = stage.backward((0, 1), (grad_out,), split=True)
    stage.backward_weight((0, 1))
    x_ref = x.clone().requires_grad_(True)
    plain(x_ref).backward(grad_out)
    assert torch.allclose(grad_in, x_ref.grad, rtol=0, atol=1e-12)
    for name, want in _grads(plain).items():
        assert torch.allclose(_grads(stage.module)[name], want, rtol=0, atol=1e-12), name


def test_b_plus_w_do_the_fused_backward_matmuls_and_w_walks_no_graph() -> None:
    """Two micro-batches (the second accumulates): native autograd, our BW, and our B then W."""
    fused, native = _stage(0, 1)
    split, _ = _stage(0, 1)
    batches = [_batch(), synthetic_batch(CONFIG, rows=4, seed=6)]
    linears = sum(isinstance(m, nn.Linear) for m in split.module.modules())
    assert split.split_layers == linears

    with OpLog() as native_log:
        for x, y in batches:
            lm_loss(native(x), y).backward()  # nn.Linear's own autograd
    with OpLog() as fused_log:
        for k, (x, y) in enumerate(batches):
            fused.forward(k, (x,), y)
            fused.backward(k, (), split=False)
    with OpLog() as b_log:
        for k, (x, y) in enumerate(batches):
            split.forward(k, (x,), y)
            split.backward(k, (), split=True)

    calls = Counter[str]()
    original = splitgrad._SplitLinear.backward

    def counted(ctx, grad_out):  # type: ignore[no-untyped-def]
        calls["backward"] += 1
        return original(ctx, grad_out)

    splitgrad._SplitLinear.backward = staticmethod(counted)  # type: ignore[method-assign]
    try:
        with _no_autograd_engine(), OpLog() as w_log:
            for k in range(len(batches)):
                split.backward_weight(k)
    finally:
        splitgrad._SplitLinear.backward = staticmethod(original)  # type: ignore[method-assign]

    # the same matmul work as native autograd, split or not; W does one weight GEMM per layer and batch
    assert native_log.flops > 0
    assert fused_log.flops == b_log.flops + w_log.flops == native_log.flops
    assert fused_log.matmuls() == b_log.matmuls() + w_log.matmuls() == native_log.matmuls()
    assert w_log.matmuls() == w_log.ops["mm"] + w_log.ops["addmm_"] == len(batches) * linears
    # W ran no autograd node: no backward function of any op, no split-linear backward
    assert calls["backward"] == 0
    assert not [name for name in w_log.ops if name.endswith("_backward")]
    assert any(name.endswith("_backward") for name in b_log.ops)  # (the check above can see them)
    for name, want in _grads(fused.module).items():
        assert torch.equal(_grads(split.module)[name], want), name
        assert torch.allclose(_grads(native)[name], want, rtol=0, atol=1e-12), name


def test_layers_used_without_forward_keep_plain_autograd() -> None:
    """nn.MultiheadAttention uses out_proj's weight directly: still correct, just not deferred."""
    torch.manual_seed(0)
    module = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    plain = copy.deepcopy(module)
    stage = Stage(0, 1, module, lambda out, y: (out - y).square().mean(), lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    stage.forward(0, (x,), y)
    stage.backward(0, (), split=True)
    assert module.self_attn.out_proj.weight.grad is not None  # arrived in B
    assert module.linear1.weight.grad is None  # deferred to W
    stage.backward_weight(0)
    (plain(x) - y).square().mean().backward()
    for name, want in _grads(plain).items():
        assert torch.allclose(_grads(module)[name], want, rtol=0, atol=1e-12), name
