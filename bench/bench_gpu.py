"""The GPU benchmark, in one run on one GPU: split vs fused backward, trainer step vs a plain PyTorch loop
for a GPT stage in bf16 and fp32, and planned vs measured peak memory.

1. Split backward: `bench_split_backward.table` at its GPU shapes (hidden 1024-4096, bf16): ours/fused
   and PyTorch's split/fused (issue 4's target: ours/fused <= 1.03).
2. Trainer vs plain loop: one GPT (`runtime.gpt`, hidden 2048, 8 blocks, context 1024) as the only
   stage of a world-size-1 NCCL job; a step is 8 micro-batches of 4 x 1024 tokens and AdamW.
   Plain: for each micro-batch forward, backward (gradients accumulate), then the step. Ours:
   `PipelineTrainer.step` with a 1f1b (fused backward) and a zb-h1 (split backward) plan. The
   variants run in rotation, `--warmup` steps first, then the median of `--reps` steps, each timed
   from one `cuda.synchronize` to the next.
3. Planned vs measured peak memory per worker: `bench/bench_memory.py`'s `planned_vs_measured("cuda")`
   (one worker at world size 1, bf16; the first iteration, which allocates cuBLAS's workspace, left out).

Reproduce:  python bench/bench_gpu.py            (needs CUDA; prints one line and exits 0 without it)
            python bench/bench_gpu.py --quick    (fewer steps, smaller GPT)
            tests/gpu/run.sh                     (the GPU test suite, then this, into one results file)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_split_backward import GPU_SHAPES, table  # noqa: E402  (bench/ is not a package)


def split_vs_fused(reps: int, warmup: int, shapes: list[tuple[int, int, int]]) -> None:
    print(f"\n1. split vs fused backward (forward + backward), bf16; median of {reps}")
    table(shapes, torch.device("cuda"), torch.bfloat16, reps, warmup)


def _join_world_of_one() -> None:
    """Join a world-size-1 job as torchrun would start it (the trainer then picks cpu:gloo,cuda:nccl)."""
    from schedcomp.runtime.fault.store import LOOPBACK
    from schedcomp.runtime.launch import free_port

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(key, value)


def _timed_step(step: Callable[[], None], warmup: int, device: torch.device) -> Callable[[], float]:
    """After `warmup` steps: a function timing one step, from a device synchronisation to the next."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()

    def once() -> float:
        sync()
        start = time.perf_counter()
        step()
        sync()
        return time.perf_counter() - start

    return once


def trainer_vs_plain(device: torch.device, dtype: torch.dtype, hidden: int, layers: int, microbatches: int,
                     rows: int, reps: int, warmup: int, context: int = 1024) -> dict[str, float]:
    """Median step seconds of the plain loop and of the trainer on 1f1b and zb-h1 plans (same model, data)."""
    from schedcomp import CostModel, Topology
    from schedcomp.lower import lower
    from schedcomp.runtime import PipelineTrainer
    from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, synthetic_batch
    from schedcomp.schedules import fault_free_order

    config = GPTConfig(vocab=256, context=context, n_layer=layers, n_head=max(1, hidden // 128), n_embd=hidden)
    inputs, targets = synthetic_batch(config, rows=rows * microbatches, seed=1)

    def adamw(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)  # type: ignore[arg-type]

    model = gpt(config, seed=0).to(device, dtype)
    optimizer = adamw(model.parameters())
    x, y = inputs.to(device), targets.to(device)

    def plain() -> None:
        for m in range(microbatches):
            rows_m = slice(m * rows, (m + 1) * rows)
            (lm_loss(model(x[rows_m]), y[rows_m]) / microbatches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps: dict[str, Callable[[], float]] = {"plain": _timed_step(plain, warmup, device)}
    for family in ("1f1b", "zb-h1"):
        plan = lower(fault_free_order(family, Topology.of(1, 1), microbatches), CostModel.uniform(1))
        trainer = PipelineTrainer(plan, gpt(config, seed=0).to(dtype), lm_loss, adamw)
        steps[family] = _timed_step(lambda t=trainer: t.step((inputs, targets)), warmup, device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):  # in rotation: drift hurts every variant alike
        for name, once in steps.items():
            times[name].append(once())
    return {name: statistics.median(t) for name, t in times.items()}


def trainer_vs_plain_table(hidden: int, layers: int, reps: int, warmup: int) -> None:
    print(f"\n2. trainer step vs plain loop: GPT hidden {hidden}, {layers} blocks, 8 micro-batches of 4 x 1024 "
          f"tokens, AdamW; median of {reps}")
    print(f"{'dtype':>9} {'plain ms':>9} {'1f1b/plain':>10} {'zb-h1/plain':>11}")
    for dtype in (torch.bfloat16, torch.float32):
        t = trainer_vs_plain(torch.device("cuda", 0), dtype, hidden, layers, 8, 4, reps, warmup)
        print(f"{str(dtype).removeprefix('torch.'):>9} {t['plain'] * 1e3:9.1f} {t['1f1b'] / t['plain']:10.3f} "
              f"{t['zb-h1'] / t['plain']:11.3f}", flush=True)
        torch.cuda.empty_cache()


def memory(device: str) -> None:
    print("\n3. planned vs measured peak memory per worker")
    # A plain import (bench/ is on sys.path): the job's workers are spawned and unpickle
    # `bench_memory._worker` by that module name.
    import bench_memory

    rows = bench_memory.planned_vs_measured(device)
    if not rows:
        print("   (no rows)")
        return
    keys = list(rows[0])
    print("   " + " ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print("   " + " ".join(f"{row[k]:>14.4g}" if isinstance(row[k], float) else f"{row[k]!s:>14}" for k in keys))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and a smaller GPT")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--parts", type=int, nargs="+", choices=(1, 2, 3), default=(1, 2, 3),
                   help="which of the three measurements to run (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (torch.cuda.is_available() is False): nothing measured")
        return 0
    reps = args.reps or (3 if args.quick else 10)
    warmup = args.warmup or (1 if args.quick else 3)
    hidden, layers = (1024, 2) if args.quick else (2048, 8)
    _join_world_of_one()
    torch.cuda.set_device(0)
    print(f"bench_gpu on {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    if 1 in args.parts:
        split_vs_fused(reps, warmup, GPU_SHAPES[:1] if args.quick else GPU_SHAPES)
    if 2 in args.parts:
        trainer_vs_plain_table(hidden, layers, reps, warmup)
    if 3 in args.parts:
        memory("cuda")
    if torch.distributed.is_initialized():  # part 2's trainers joined a world of one (NCCL warns if left open)
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
