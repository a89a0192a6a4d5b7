"""The multi-GPU tests' processes, dry-run on CPU over gloo: the GPU machines lent so far have one GPU
(NCCL refuses two ranks on one), so `tests/gpu/test_gpu_multi.py` and `test_gpu_moves.py` skip there.
The processes and assertions of four of their six tests run here (the fault-free split and fused pipeline,
both shipped re-routed plans, the layer move), so those are known to work up to the device. Not here: the
replica transfer over NCCL (its CPU-buffer form runs on one GPU) and the SIGKILL recovery that rebuilds NCCL
groups (the chaos tests run its logic on gloo)."""

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


def test_fault_free_split_and_fused_pipelines_equal_a_plain_loop_on_gloo(tmp_path: Path) -> None:
    families = ["zb-h1", "1f1b"]
    spawn(train_plans, 2, ([fault_free_json(f, 2, 1, 4) for f in families], str(tmp_path)), timeout=240,
          backend="gloo")
    results = [read(tmp_path / f"train.{r}.json") for r in range(2)]
    assert all({"isend", "irecv"} <= set(r["calls"]) for r in results)
    assert_matches_reference(results, families, device="cpu")


@pytest.mark.parametrize("name", ["rerouted-pp2-dp2-m4.json", "rerouted-pp2-dp2-m4-lost1.json"])
def test_shipped_rerouted_plans_equal_a_plain_loop_on_gloo(name: str, tmp_path: Path) -> None:
    """The 3-GPU and 2-GPU tests' plans (pp=2, dp=2: worker 1:1 failed, or all of pipeline 1), as shipped."""
    text = (GPU_TESTS / "plans" / name).read_text()
    plan = Plan.from_json(text)
    n = len(plan.workers)
    spawn(train_plans, n, ([text], str(tmp_path)), timeout=240, backend="gloo")
    results = [read(tmp_path / f"train.{r}.json") for r in range(n)]
    assert {"isend", "irecv"} <= set().union(*(r["calls"] for r in results))
    assert_matches_reference(results, [plan.family], device="cpu")


def test_layer_move_process_equals_one_process_on_gloo(tmp_path: Path) -> None:
    spawn(train_moving, 2, (fault_free_json("zb-h1", 2, 1, 4), str(tmp_path)), timeout=240, backend="gloo")
    assert_moves_match([read(tmp_path / f"moves.{r}.json") for r in range(2)], CUTS[-1], device="cpu")
