"""The multi-GPU tests' processes, dry-run on CPU over gloo: the GPU machines lent so far have one GPU
(NCCL refuses two ranks on one), so `tests/gpu/test_gpu_multi.py` and `test_gpu_moves.py` skip there.
The same processes and the same assertions run here, so those tests are known to work up to the device
the day a machine with several GPUs runs them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU_TESTS))
from gpu_helpers import assert_matches_reference, assert_moves_match, fault_free_json, read  # noqa: E402
from gpu_procs import train_plans  # noqa: E402
from moves_procs import CUTS, train_moving  # noqa: E402

from schedcomp.ir import Plan  # noqa: E402
from schedcomp.runtime.launch import spawn  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_shipped_rerouted_plan_equals_a_plain_loop_on_gloo(tmp_path: Path) -> None:
    """The 3-GPU test's plan (pp=2, dp=2, worker 1:1 failed, its work re-routed), as shipped."""
    text = (GPU_TESTS / "plans" / "rerouted-pp2-dp2-m4.json").read_text()
    plan = Plan.from_json(text)
    n = len(plan.workers)
    spawn(train_plans, n, ([text], str(tmp_path)), timeout=240, backend="gloo")
    results = [read(tmp_path / f"train.{r}.json") for r in range(n)]
    assert {"isend", "irecv"} <= set().union(*(r["calls"] for r in results))
    assert_matches_reference(results, [plan.family], device="cpu")


def test_layer_move_process_equals_one_process_on_gloo(tmp_path: Path) -> None:
    spawn(train_moving, 2, (fault_free_json("zb-h1", 2, 1, 4), str(tmp_path)), timeout=240, backend="gloo")
    assert_moves_match([read(tmp_path / f"moves.{r}.json") for r in range(2)], CUTS[-1], device="cpu")
