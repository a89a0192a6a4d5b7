"""Checkpoint cost against stage size (Rojas et al. 2021): DCP save, synchronous and asynchronous, and restore.

Reproduce (about 1 minute on a 2-core machine; files go to a temporary directory under $TMPDIR):

    python bench/bench_checkpoint.py            # stages of 1M, 8M and 32M float32 parameters, 3 repeats
    python bench/bench_checkpoint.py --quick    # 1M and 4M, 2 repeats
    python bench/bench_checkpoint.py --device cuda   # the stage on the GPU (the default when one is present)

One stage = a stack of square `nn.Linear` layers with Adam's state (exp_avg, exp_avg_sq), i.e. about
3 x 4 bytes per parameter, saved the way the runtime saves a stage (`runtime/fault/checkpoint.py`:
the state flattened by `transfer.flatten`, written by DCP with `no_dist=True`, one writer per stage).
Columns (medians over the repeats):

- `sync blocked`: `torch.distributed.checkpoint.save`: training is blocked until the files are written;
- `async blocked`: `AsyncCheckpointer.save` (DCP `async_save`): the call copies the state and returns,
  training is blocked only this long; `async durable`: until its manifest is written (files complete);
- `restore`: `checkpoint.restore` into a fresh stage (metadata read through the pickle allow-list);
- `bytes`: the files on disk, and the write and read rates.

The `async blocked` figure is what `schedcomp goodput --checkpoint-seconds` means (the time training is
blocked per checkpoint); `restore` belongs in `--restart-seconds` with the job's relaunch time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, restore
from schedcomp.runtime.fault.transfer import flatten, stage_state

WIDTH = 1024  # one layer: WIDTH x WIDTH weights + WIDTH bias, ~1M parameters


def make_stage(params: int, device: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stage of about `params` parameters on `device`, with Adam's state filled in by one step."""
    torch.manual_seed(seed)
    layers = max(1, round(params / (WIDTH * WIDTH + WIDTH)))
    module = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers))).to(device)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    module(torch.randn(4, WIDTH, device=device)).square().mean().backward()
    optimizer.step()
    _sync(device)
    return module, optimizer


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(params: int, repeats: int, root: Path, device: str) -> dict[str, float]:
    module, optimizer = make_stage(params, device)
    out: dict[str, list[float]] = {k: [] for k in ("sync", "blocked", "durable", "restore", "bytes")}
    for r in range(repeats):
        # synchronous: plain DCP save of the same flattened tensors
        _, tensors = flatten(stage_state(module, optimizer))
        path = root / f"sync-{params}-{r}"
        root.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        dcp.save({f"t{i}": t for i, t in enumerate(tensors)}, storage_writer=FileSystemWriter(path), no_dist=True)
        out["sync"].append(time.perf_counter() - began)
        # asynchronous: the runtime's checkpointer
        directory = root / f"async-{params}-{r}"
        saver = AsyncCheckpointer(directory, stage=0, every=1)
        began = time.perf_counter()
        committed = saver.save(0, module, optimizer)
        out["blocked"].append(time.perf_counter() - began)
        committed.result()
        out["durable"].append(time.perf_counter() - began)
        out["bytes"].append(float(disk_bytes(directory)))
        fresh, fresh_opt = make_stage(params, device, seed=1)
        began = time.perf_counter()
        restore(directory, 0, 0, fresh, fresh_opt)
        _sync(device)
        out["restore"].append(time.perf_counter() - began)
        assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), fresh.state_dict().values(),
                                                     strict=True)), "restore did not bring the stage back"
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the stage lives (default: cuda when a GPU is present)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible to torch here")
    torch.set_num_threads(1)
    sizes = (1 << 20, 4 << 20) if args.quick else (1 << 20, 8 << 20, 32 << 20)
    repeats = 2 if args.quick else 3
    print(f"Checkpoint of one stage (float32 parameters + Adam state) on {args.device}, DCP on the local disk; "
          f"medians over {repeats} repeats")
    print(f"{'params':>8} {'MB':>7} {'sync blocked s':>14} {'async blocked s':>15} {'async durable s':>15} "
          f"{'restore s':>9} {'write GB/s':>10} {'read GB/s':>9} {'blocked async/sync':>18}")
    with tempfile.TemporaryDirectory(prefix="schedcomp-ckpt-bench-") as tmp:
        measure(WIDTH * WIDTH, 1, Path(tmp) / "warm-up", args.device)  # DCP starts its async machinery on first use
        for params in sizes:
            m = measure(params, repeats, Path(tmp), args.device)
            gb = m["bytes"] / 1e9
            print(f"{params / 2**20:>7.0f}M {m['bytes'] / 2**20:>7.0f} {m['sync']:>14.3f} {m['blocked']:>15.3f} "
                  f"{m['durable']:>15.3f} {m['restore']:>9.3f} {gb / m['durable']:>10.2f} "
                  f"{gb / m['restore']:>9.2f} {m['blocked'] / m['sync']:>18.3f}", flush=True)


if __name__ == "__main__":
    main()
