"""What checking a checkpoint costs: restore with every check against DCP's plain load, per stage size.

Reproduce (about a minute on a busy 2-core machine):

    python bench/bench_checkpoint_checks.py              # stages of 16 and 128 MB of float32 parameters
    python bench/bench_checkpoint_checks.py --sizes 4    # any stage sizes, MB of parameters (--quick: 4 and 16)

Each stage is an `nn.Sequential` of 4 square float32 `nn.Linear` layers holding MB megabytes of
parameters, with `torch.optim.Adam` state after one step (the checkpoint holds 3 x MB). One
process, CPU, files in a temporary folder (so in the page cache: the numbers are the CPU cost of
the checks, not disk speed). Medians of `--repeats` runs, all measured side by side in one run:

- `save s`: `AsyncCheckpointer.save(...).result()` (DCP's write, then the digests of what it wrote
  and the manifest); `digest s`: `stored_digests` alone, the part of the save the checks added.
- `plain s`: DCP's own `FileSystemReader` load into fresh tensors + `load_stage_state`, no checks
  (what `restore` did before issue 17; it trusted the metadata's paths and sizes).
- `restore s`: `restore` with every check; `checks s`: its checks without the digests (manifest,
  layout against the stage, metadata); `digests s`: `check_digests` alone.
- `restore/plain`: the price of the checks, as a ratio.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, checkpoint_dir, restore
from schedcomp.runtime.fault.checkpoint_check import check_against_stage, read_manifest
from schedcomp.runtime.fault.checkpoint_storage import check_digests, check_metadata_matches, stored_digests
from schedcomp.runtime.fault.dcp_io import SafeReader
from schedcomp.runtime.fault.transfer import flatten, load_stage_state, stage_state, unflatten

warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
LAYERS = 4


def build(mb: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    width = int(math.sqrt(mb * 2**20 / 4 / LAYERS))
    module = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    module(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    return module, optimizer


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def plain_load(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """DCP's own reader, no checks: allocate what the manifest says, load, copy into the stage."""
    manifest = read_manifest(path, 0, 0)
    target = {f"t{i}": torch.empty(s.shape, dtype=s.torch_dtype) for i, s in enumerate(manifest.specs)}
    dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)
    load_stage_state(module, optimizer, unflatten(manifest.skeleton, [target[f"t{i}"] for i in range(len(target))]))


def only_checks(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    manifest = read_manifest(path, 0, 0)
    check_against_stage(manifest, module, optimizer)
    check_metadata_matches(SafeReader(path).read_metadata(), manifest.stored, str(path))


def one_run(module: nn.Module, optimizer: torch.optim.Optimizer, fresh: nn.Module,
            fresh_opt: torch.optim.Optimizer) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as folder:
        path = checkpoint_dir(folder, 0, 0)
        save = AsyncCheckpointer(folder, 0, every=1).save
        return {
            "save s": timed(lambda: save(0, module, optimizer).result()),
            "digest s": timed(lambda: stored_digests(SafeReader(path).read_metadata(), path)),
            "plain s": timed(plain_load, path, fresh, fresh_opt),
            "restore s": timed(restore, folder, 0, 0, fresh, fresh_opt),
            "checks s": timed(only_checks, path, fresh, fresh_opt),
            "digests s": timed(lambda: check_digests(SafeReader(path).read_metadata(),
                                                     read_manifest(path, 0, 0).stored, path)),
        }


def measure(mb: float, repeats: int) -> dict[str, float]:
    module, optimizer = build(mb, seed=0)
    fresh, fresh_opt = build(mb, seed=1)
    runs = [one_run(module, optimizer, fresh, fresh_opt) for _ in range(repeats)]
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    out["state MB"] = sum(t.numel() * t.element_size() for t in flatten(stage_state(module, optimizer))[1]) / 2**20
    return out


def stage_sizes(description: str) -> tuple[list[float], int]:
    """The command line of a checkpoint benchmark (also `bench_checkpoint_layers.py`): stage sizes in MB of
    parameters (`--sizes`, `--quick`) and `--repeats`; one CPU thread, as the workers run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", type=float, nargs="+", default=[16, 128], help="stage sizes, MB of parameters")
    parser.add_argument("--quick", action="store_true", help="stages of 4 and 16 MB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    return [4, 16] if args.quick else args.sizes, args.repeats


def main() -> int:
    sizes, repeats = stage_sizes(__doc__.split("\n\n")[0])
    columns = ["state MB", "save s", "digest s", "plain s", "restore s", "checks s", "digests s"]
    print(f"{'MB':>6} " + " ".join(f"{c:>10}" for c in columns) + f" {'restore/plain':>14}")
    for mb in sizes:
        r = measure(mb, repeats)
        print(f"{mb:>6g} " + " ".join(f"{r[c]:>10.3f}" for c in columns) + f" {r['restore s'] / r['plain s']:>14.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
