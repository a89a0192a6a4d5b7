"""Per-layer checkpoints against per-stage ones (issue 14): what holding each layer apart costs.

Reproduce (about a minute on a 2-core machine; files go to a temporary directory under $TMPDIR):

    python bench/bench_checkpoint_layers.py            # stages of 16 and 128 MB of float32 parameters
    python bench/bench_checkpoint_layers.py --quick    # 4 and 16 MB

An 8-layer `nn.Sequential` of square `nn.Linear` layers, cut (2, 2, 2, 2), each stage with its own Adam
after one step (about 3 x 4 bytes per parameter); stage 1 (layers 2-3) is measured, `MB` its parameters.
Columns (medians over the repeats, seconds):

- `stage save` / `layer save`: `AsyncCheckpointer.save(...).result()` of stage 1 as one stage state, and per
  layer (`checkpoint_layers`): DCP's write, the digests, the manifest;
- `stage restore` / `layer restore`: `checkpoint.restore` of stage 1 into a fresh stage of the same cut
  (per layer: the manifests of every stage directory are read to find the layers' holders);
- `cross restore`: stage 1 of the cut (1, 2, 3, 2), layers 1-2, restored per layer from the directories of
  stages 0 and 1 of (2, 2, 2, 2): what a restart short of a worker does.
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from bench_checkpoint_checks import stage_sizes  # run from bench/: its sibling
from torch import nn

from schedcomp.partition import spans
from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, restore

warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
LAYERS, WRITTEN, CROSS = 8, (2, 2, 2, 2), (1, 2, 3, 2)


def model(mb: float, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    width = int(math.sqrt(mb * 2**20 / 4 / 2))  # two layers per stage of `mb` MB
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(LAYERS)))


def stages(net: nn.Sequential, cut: tuple[int, ...], step: bool) -> list[tuple[nn.Sequential, torch.optim.Optimizer]]:
    out = []
    for held in spans(cut):
        module = nn.Sequential(*(net[i] for i in held))
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
        if step:
            module(torch.randn(2, module[0].in_features)).square().mean().backward()
            optimizer.step()
        out.append((module, optimizer))
    return out


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_run(written: list, fresh: list, crossed: list) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-layers-") as folder:
        per_stage, per_layer = Path(folder) / "stage", Path(folder) / "layer"
        for s, (module, optimizer) in enumerate(written):
            if s != 1:
                AsyncCheckpointer(per_layer, s, every=1).save(0, module, optimizer, WRITTEN).result()
        module, optimizer = written[1]
        return {
            "stage save": timed(lambda: AsyncCheckpointer(per_stage, 1, every=1).save(0, module, optimizer).result()),
            "layer save": timed(lambda: AsyncCheckpointer(per_layer, 1, every=1).save(0, module, optimizer,
                                                                                      WRITTEN).result()),
            "stage restore": timed(lambda: restore(per_stage, 0, 1, *fresh[1])),
            "layer restore": timed(lambda: restore(per_layer, 0, 1, *fresh[1], WRITTEN)),
            "cross restore": timed(lambda: restore(per_layer, 0, 1, *crossed[1], CROSS)),
        }


def main() -> int:
    sizes, repeats = stage_sizes(__doc__.split("\n\n")[0])
    columns = ["stage save", "layer save", "stage restore", "layer restore", "cross restore"]
    print(f"{'MB':>6} " + " ".join(f"{c:>14}" for c in columns))
    for mb in sizes:
        written = stages(model(mb, 0), WRITTEN, step=True)
        fresh, crossed = stages(model(mb, 1), WRITTEN, step=True), stages(model(mb, 2), CROSS, step=True)
        runs = [one_run(written, fresh, crossed) for _ in range(repeats)]
        print(f"{mb:>6g} " + " ".join(f"{statistics.median(r[c] for r in runs):>14.3f}" for c in columns),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
