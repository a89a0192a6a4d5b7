"""Write the plans the GPU suite loads: the GPU machine has no OR-tools, so plans that need the adaptive
compiler are compiled here and shipped as JSON (fault-free families are built in the tests themselves).

    python tests/gpu/make_plans.py      # rewrites tests/gpu/plans/

- `rerouted-pp2-dp2-m4.json`: pp=2, dp=2, 4 micro-batches with worker 1:1 failed: 3 live workers,
  pipeline 1's stage-1 work re-routed to 0:1 (the 3-GPU NCCL p2p test);
- `rerouted-pp2-dp2-m4-lost1.json`: the same job with pipeline 1 lost (1:0 and 1:1): its micro-batches
  run on pipeline 0, 2 live workers (the 2-GPU NCCL p2p test);
- `cache-pp1-dp2-m4/`: a plan cache for pp=1, dp=2, up to one failure (the SIGKILL recovery test).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from schedcomp.cache import precompile
from schedcomp.compiler import compile

PLANS = Path(__file__).resolve().parent / "plans"
REROUTED = PLANS / "rerouted-pp2-dp2-m4.json"
REROUTED_LOST1 = PLANS / "rerouted-pp2-dp2-m4-lost1.json"
CACHE = PLANS / "cache-pp1-dp2-m4"


def write_plans(folder: Path = PLANS) -> None:
    """Write the plans into `folder` (tests/compiler/test_gpu_plans_current.py compares a fresh copy with the
    shipped one)."""
    folder.mkdir(exist_ok=True)
    (folder / REROUTED.name).write_text(compile(2, 2, 4, failed=[(1, 1)], schedule="zb-h1").to_json())
    (folder / REROUTED_LOST1.name).write_text(compile(2, 2, 4, failed=[(1, 0), (1, 1)], schedule="zb-h1").to_json())
    shutil.rmtree(folder / CACHE.name, ignore_errors=True)
    precompile(1, 2, 4, 1, directory=folder / CACHE.name, time_limit=1.0)


def main() -> None:
    write_plans()
    print(f"wrote {REROUTED}, {REROUTED_LOST1} and {CACHE}/")


if __name__ == "__main__":
    main()
