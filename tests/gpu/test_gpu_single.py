"""One GPU: the runtime on NCCL at world size 1, bf16 training, CUDA-synchronised traces, CUDA state in
DCP checkpoints and replica transfers. Skipped where CUDA is absent.

World-size-1 jobs are started as torchrun would start them (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT; `spawn(..., backend=None)`), so `PipelineTrainer` joins through
`init_distributed` and gets "cpu:gloo,cuda:nccl" as a user's job would. Issue 9: before the
fix every such job died at construction (a CPU plan digest all-gathered over an NCCL-only group).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from gpu_helpers import assert_matches_reference, check_transfer, fault_free_json, need_gpus, read
from gpu_procs import (
    ROWS,
    STEPS,
    autocast_mlp,
    bf16_gpt,
    replica_transfer,
    state_summary,
    stepped_state,
    traced,
    train_plans,
)

from schedcomp.runtime.launch import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_memory  # (the job the benchmark runs: one definition for both)

pytestmark = [need_gpus(1), pytest.mark.timeout(300)]


def test_world_size_1_on_nccl_split_and_fused_equal_a_plain_loop(tmp_path: Path) -> None:
    families = ["zb-h1", "1f1b"]  # split backward (B then W), fused backward (BW)
    spawn(train_plans, 1, ([fault_free_json(f, 1, 1, 4) for f in families], str(tmp_path)), timeout=240,
          backend=None)
    result = read(tmp_path / "train.0.json")
    assert len(result["reference"]["losses"]) == STEPS
    assert {"all_gather", "broadcast", "all_reduce"} <= set(result["calls"])  # digest, shape probe, loss
    assert_matches_reference([result], families)


def test_bf16_training_runs_and_its_loss_falls(tmp_path: Path) -> None:
    spawn(bf16_gpt, 1, (fault_free_json("zb-h1", 1, 1, 4), 40, str(tmp_path)), timeout=240, backend=None)
    result = read(tmp_path / "bf16.json")
    losses = result["losses"]
    assert result["dtypes"] == ["torch.bfloat16"] and result["devices"] == ["cuda"]
    assert all(v == v and abs(v) < 1e4 for v in losses), losses  # finite
    assert losses[-1] < 0.7 * losses[0], losses  # log(64) = 4.16 at start; the permutation is learnable


def test_cuda_autocast_keeps_float32_weights_and_follows_a_plain_autocast_loop(tmp_path: Path) -> None:
    """bfloat16 autocast: the fused backward (1f1b) matches a plain autocast loop over the same micro-batches to
    float32 rounding; the split one (zb-h1) computes weight gradients in float32 from the half-precision
    tensors autocast saved, so its losses agree to 1% and its total AdamW update to 10% (single elements
    with near-zero gradients may differ more: Adam scales each by its own size). float16 (loss scaling):
    the loss falls. Weights stay float32 on the GPU."""
    families = ["1f1b", "zb-h1"]
    spawn(autocast_mlp, 1, ([fault_free_json(f, 1, 1, 4) for f in families], str(tmp_path)), timeout=240,
          backend=None)
    result = read(tmp_path / "autocast.json")
    reference = result["reference"]
    initial = _flat_state(reference["initial"])
    update = _flat_state(reference["state"]) - initial
    assert update.norm() > 0
    for run in result["runs"]:
        assert run["param_dtypes"] == ["torch.float32"] and run["devices"] == ["cuda"], run
        if run["dtype"] == "torch.float16":  # (an overflow may skip a step and halve the scale, not every step)
            assert run["losses"][-1] < run["losses"][0] and not all(run["skipped"]), run
            continue
        assert not any(run["skipped"]), run  # bfloat16: no loss scale, nothing to skip
        exact = run["family"] == "1f1b"
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5 if exact else 1e-2), run["family"]
        off = (_flat_state(run["state"]) - initial - update).norm() / update.norm()
        assert off <= (1e-5 if exact else 0.1), (run["family"], float(off))


def _flat_state(state: dict[str, list]) -> torch.Tensor:
    return torch.cat([torch.tensor(state[k], dtype=torch.float64).reshape(-1) for k in sorted(state)])


def test_trace_times_are_cuda_synchronised(tmp_path: Path) -> None:
    """Each F span covers the GPU work of that forward: at least half its CUDA-event time (unsynchronised,
    a span would end when the kernels are queued, a small fraction of it)."""
    spawn(traced, 1, (fault_free_json("1f1b", 1, 1, 2), 4096, 8, str(tmp_path)), timeout=240, backend=None)
    result = read(tmp_path / "traced.json")
    assert json.loads((tmp_path / "trace.json").read_text())  # the Chrome trace rank 0 wrote
    assert len(result["forward_spans"]) == 2
    assert result["event_seconds"] > 1e-3, "the forward is too short on this GPU to tell the two apart"
    assert min(result["forward_spans"]) >= 0.5 * result["event_seconds"], result


def test_dcp_checkpoint_of_cuda_state_round_trips(tmp_path: Path) -> None:
    from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, restore

    device = torch.device("cuda", 0)
    module, optimizer = stepped_state(1, device)
    AsyncCheckpointer(tmp_path, stage=0, every=1).save(3, module, optimizer).result(timeout=120)
    fresh, fresh_optimizer = stepped_state(2, device)  # different weights and AdamW moments
    assert state_summary(fresh, fresh_optimizer) != state_summary(module, optimizer)
    restore(tmp_path, 3, 0, fresh, fresh_optimizer)
    assert state_summary(fresh, fresh_optimizer) == state_summary(module, optimizer)  # values and device types
    assert all(p.device == device for p in fresh.parameters())
    # and the restored optimizer steps exactly as the original
    x = torch.randn(ROWS, module[0].in_features, device=device)
    for m, o in ((module, optimizer), (fresh, fresh_optimizer)):
        m(x).square().mean().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), fresh.parameters(), strict=True))


def test_per_layer_checkpoint_of_cuda_state_restores_into_another_cut(tmp_path: Path) -> None:
    """An nn.Sequential's stages on the GPU save per layer under the cut (2, 2) and a fresh model restores into
    (3, 1): every layer's weights and Adam moments come back bit for bit, on the GPU, and step as the original."""
    from torch import nn

    from schedcomp.partition import spans
    from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, latest_complete, restore

    device = torch.device("cuda", 0)

    def cut_into(net: nn.Sequential, cut: tuple[int, ...]) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
        held = [nn.Sequential(*(net[i] for i in layers)) for layers in spans(cut)]
        return [(m, torch.optim.Adam(m.parameters(), lr=0.01)) for m in held]

    def model(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))).to(device)

    def step(net: nn.Sequential, stages: list[tuple[nn.Module, torch.optim.Optimizer]], seed: int) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        net(torch.randn(ROWS, 16, device=device, generator=g)).square().mean().backward()
        for _, optimizer in stages:
            optimizer.step()
            optimizer.zero_grad()

    net, fresh = model(1), model(2)
    written, restored = cut_into(net, (2, 2)), cut_into(fresh, (3, 1))
    for i in range(2):
        step(net, written, i)
    for s, (module, optimizer) in enumerate(written):
        AsyncCheckpointer(tmp_path, stage=s, every=1).save(1, module, optimizer, (2, 2)).result(timeout=120)
    assert latest_complete(tmp_path, 2, 4) == 1
    for s, (module, optimizer) in enumerate(restored):
        restore(tmp_path, 1, s, module, optimizer, (3, 1))
    moments = {id(p): st for _, o in written for p, st in o.state.items()}
    for _, optimizer in restored:
        for st in optimizer.state.values():  # Adam's moments live beside their parameters
            assert st["exp_avg"].device == device and st["exp_avg_sq"].device == device
    got = {id(q): st for _, o in restored for q, st in o.state.items()}
    for a, b in zip(net.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b) and b.device == device
        assert all(torch.equal(torch.as_tensor(moments[id(a)][k]).cpu(), torch.as_tensor(got[id(b)][k]).cpu())
                   for k in moments[id(a)])
    step(net, written, 2)
    step(fresh, restored, 2)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh.parameters(), strict=True))


def test_cuda_state_round_trips_through_transfer_bytes() -> None:
    from schedcomp.runtime.fault.transfer import TensorSpec, flatten, from_bytes, stage_state, to_bytes

    module, optimizer = stepped_state(1, torch.device("cuda", 0))
    _, tensors = flatten(stage_state(module, optimizer))
    assert {t.device.type for t in tensors} >= {"cuda"}
    for buffers in (torch.device("cpu"), torch.device("cuda", 0)):
        back = from_bytes(to_bytes(tensors, buffers), [TensorSpec.of(t) for t in tensors])
        assert all(a.device == b.device and a.dtype == b.dtype and torch.equal(a, b)
                   for a, b in zip(tensors, back, strict=True))


def test_replica_transfer_of_cuda_state_through_cpu_buffers(tmp_path: Path) -> None:
    """Two processes on one GPU (gloo carries the bytes): the receiver ends with the sender's CUDA state."""
    spawn(replica_transfer, 2, ("cpu", str(tmp_path)), timeout=240, backend="cpu:gloo")
    check_transfer(tmp_path)


def test_cuda_peak_activation_memory_is_within_20_percent_of_the_plan() -> None:
    """Measured by allocator deltas (`runtime.memory`); the first iteration, which also allocates cuBLAS's
    workspace, is left out."""
    rows = bench_memory.planned_vs_measured("cuda")
    assert rows and all(0.8 <= r["ratio"] <= 1.2 for r in rows), rows
