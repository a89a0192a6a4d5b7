"""Processes of the GPU tests: each function runs in processes started by `schedcomp.runtime.launch.spawn`
and writes what it saw as JSON into `outdir`; the tests (the parent, which never touches CUDA) assert.

`train_plans` is the equivalence check: the plans' training on the GPUs (one process per live
worker, joined as torchrun would: `PipelineTrainer` calls `init_distributed`, which picks
"cpu:gloo,cuda:nccl") against a plain PyTorch loop on rank 0's GPU, same data, float64, AdamW.
Every torch.distributed call is audited (`dist_audit.Audit`): under NCCL a control tensor on the
CPU handed to an NCCL-only group would fail, and the audit records every call.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from dist_audit import Audit
from torch import Tensor, nn

from schedcomp.ir import Plan

H, ROWS, STEPS = 16, 4, 3  # hidden size, rows per micro-batch, AdamW steps


def _dump(outdir: str, name: str, obj: dict) -> None:
    (Path(outdir) / f"{name}.json").write_text(json.dumps(obj))


def mlp_stage(stage: int) -> nn.Module:
    """Stage `stage` of the equivalence model (the same weights in every process)."""
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H), nn.LayerNorm(H)).double()


def mlp_batch(chunks: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _states(module: nn.Module) -> dict[str, list]:
    return {k: v.double().cpu().tolist() for k, v in module.state_dict().items()}


def plain_loop(pp: int, chunks: int, device: torch.device) -> tuple[list[float], list[dict[str, list]]]:
    """The reference: the whole model in one process on `device`, the global batch at once."""
    stages = [mlp_stage(s).to(device) for s in range(pp)]
    optimizer = adamw([p for m in stages for p in m.parameters()])
    x, y = (t.to(device) for t in mlp_batch(chunks))
    losses = []
    for _ in range(STEPS):
        out = x
        for m in stages:
            out = m(out)
        loss = F.mse_loss(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [_states(m) for m in stages]


def train_plans(rank: int, plan_jsons: list[str], outdir: str) -> None:
    """Train each plan for STEPS AdamW steps (fresh trainer each); rank 0 also runs the plain loop on its device."""
    from schedcomp.runtime import PipelineTrainer

    out: dict = {"runs": []}
    device = torch.device("cpu")
    with Audit() as audit:
        for text in plan_jsons:
            plan = Plan.from_json(text)
            trainer = PipelineTrainer(plan, mlp_stage, F.mse_loss, adamw)
            batch = mlp_batch(plan.topology.dp * plan.microbatches)
            losses = [trainer.step(batch) for _ in range(STEPS)]
            device = trainer.device
            out["runs"].append({"family": plan.family, "worker": str(trainer.worker),
                                "active": trainer.worker in plan.streams, "losses": [float(v) for v in losses],
                                "state": _states(trainer.stage.module), "device": str(trainer.device),
                                "backend": str(torch.distributed.get_backend_config())})
    out["mismatches"] = [c.name for c in audit.mismatches()]
    out["calls"] = sorted(audit.names())
    if rank == 0:
        first = Plan.from_json(plan_jsons[0])
        losses, states = plain_loop(first.topology.pp, first.topology.dp * first.microbatches, device)
        out["reference"] = {"losses": losses, "states": states}
    _dump(outdir, f"train.{rank}", out)


def bf16_gpt(rank: int, plan_json: str, steps: int, outdir: str) -> None:
    """Train a small GPT in bfloat16 on the GPU (world size 1): the losses, and where the parameters live."""
    from schedcomp.runtime import PipelineTrainer
    from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, synthetic_batch

    plan = Plan.from_json(plan_json)
    config = GPTConfig(vocab=64, context=64, n_layer=2, n_head=4, n_embd=128)
    model = gpt(config, seed=0).to(torch.bfloat16)
    trainer = PipelineTrainer(plan, model, lm_loss, lambda p: torch.optim.AdamW(p, lr=3e-3))
    batch = synthetic_batch(config, rows=8 * plan.microbatches, seed=1)
    losses = [trainer.step(batch) for _ in range(steps)]
    params = list(trainer.stage.module.parameters())
    _dump(outdir, "bf16", {"losses": [float(v) for v in losses], "dtypes": sorted({str(p.dtype) for p in params}),
                           "devices": sorted({p.device.type for p in params})})


class Matmuls(nn.Module):
    """A stage whose forward is `reps` large matmuls: long enough on a GPU to tell GPU time from launch time."""

    def __init__(self, n: int, reps: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(n, n) / n**0.5)
        self.reps = reps

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.reps):
            x = x @ self.weight
        return x


def traced(rank: int, plan_json: str, n: int, reps: int, outdir: str) -> None:
    """Profile two iterations; return the measured F spans of the second and a CUDA-event time of one forward."""
    from schedcomp.ir import InstrKind
    from schedcomp.runtime import PipelineTrainer

    plan = Plan.from_json(plan_json)
    trainer = PipelineTrainer(plan, lambda s: Matmuls(n, reps), lambda out, y: out.square().mean(),
                              lambda p: torch.optim.SGD(p, lr=1e-6), profile=True)
    chunks = plan.microbatches
    x = torch.randn(chunks * n, n)
    for _ in range(2):
        trainer.step((x, x)).item()
    spans = trainer.save_trace(Path(outdir) / "trace.json")
    forward = [s.end - s.start for s in spans if s.iteration == 1 and s.instruction.kind is InstrKind.F]
    module, chunk = trainer.stage.module, x[:n].to(trainer.device)
    times = []
    for _ in range(3):  # the same forward, timed with CUDA events (what the GPU itself spent)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.no_grad():
            module(chunk)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    _dump(outdir, "traced", {"forward_spans": forward, "event_seconds": statistics.median(times)})


def stepped_state(seed: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stage on `device` with AdamW state (two steps taken), the same for the same seed."""
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H)).to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for i in range(2):
        g = torch.Generator().manual_seed(seed + i)
        module(torch.randn(ROWS, H, generator=g).to(device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return module, optimizer


def state_summary(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every tensor of the stage state as (device type, values), for comparing two processes' states."""
    from schedcomp.runtime.fault.transfer import flatten, stage_state

    skeleton, tensors = flatten(stage_state(module, optimizer))
    return {"skeleton": json.dumps(skeleton), "tensors": [(t.device.type, t.double().cpu().tolist()) for t in tensors]}


def replica_transfer(rank: int, via: str, outdir: str) -> None:
    """Rank 0 sends its CUDA stage state to rank 1, whose own state differs; rank 1 records what it got.

    `via`: "cpu" (the default: CUDA state through CPU buffers over the groups' gloo backend; the
    ranks may share one GPU) or "cuda" (GPU buffers over NCCL: one GPU per rank).
    """
    import torch.distributed as dist

    from schedcomp.runtime.fault.transfer import recv_stage_state, send_stage_state

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    buffers = device if via == "cuda" else torch.device("cpu")
    with Audit() as audit:
        if rank == 0:
            module, optimizer = stepped_state(1, device)
            sent = send_stage_state(module, optimizer, dist.group.WORLD, [1], device=buffers, info={"iteration": 7})
            result = {"sent": sent, "state": state_summary(module, optimizer)}
        else:
            module, optimizer = stepped_state(2, device)
            before = state_summary(module, optimizer)
            got = recv_stage_state(module, optimizer, dist.group.WORLD, src=0, device=buffers)
            result = {"received": got.nbytes, "info": got.info, "before": before,
                      "state": state_summary(module, optimizer)}
    result["mismatches"] = [c.name for c in audit.mismatches()]
    _dump(outdir, f"transfer.{rank}", result)


def autocast_mlp(rank: int, plan_jsons: list[str], outdir: str) -> None:
    """float32 master weights trained under CUDA autocast (world size 1): bfloat16 with each plan against a
    plain autocast loop over the same micro-batches on the same device, and float16 with loss scaling."""
    from schedcomp.runtime import PipelineTrainer

    def model() -> nn.Module:
        return mlp_stage(0).float()

    out: dict = {"runs": []}
    x, y = (t.float() for t in mlp_batch(Plan.from_json(plan_jsons[0]).microbatches))
    for text in plan_jsons:
        plan = Plan.from_json(text)
        for dtype in (torch.bfloat16, torch.float16):
            trainer = PipelineTrainer(plan, lambda s: model(), F.mse_loss, adamw, autocast=dtype)
            results = [trainer.step((x, y)) for _ in range(STEPS)]
            trainer.settle()
            params = list(trainer.stage.module.parameters())
            out["runs"].append({
                "family": plan.family, "dtype": str(dtype), "losses": [float(r) for r in results],
                "skipped": [bool(r.skipped) for r in results], "state": _states(trainer.stage.module),
                "param_dtypes": sorted({str(p.dtype) for p in params}),
                "devices": sorted({p.device.type for p in params})})
            device = trainer.device
    reference = model().to(device)
    optimizer = adamw(reference.parameters())
    chunks = Plan.from_json(plan_jsons[0]).microbatches
    xs, ys = x.to(device).chunk(chunks), y.to(device).chunk(chunks)
    losses = []
    for _ in range(STEPS):
        total = 0.0
        for xm, ym in zip(xs, ys, strict=True):
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = F.mse_loss(reference(xm), ym) / chunks
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    out["reference"] = {"losses": losses, "state": _states(reference), "initial": _states(model())}
    _dump(outdir, "autocast", out)
