"""Several GPUs, one process each: NCCL point-to-point pipelines (fault-free and re-routed around a failed
worker) equal a plain loop; CUDA state moves between replicas over NCCL; a SIGKILLed worker's peers
abort their NCCL groups, rebuild them and train on to the fault-free model. Each test skips below
the GPUs it needs.

The re-routed plan and the plan cache were compiled on the CPU side (`tests/gpu/make_plans.py`):
the GPU machine has no OR-tools.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_helpers import TOLERANCE, assert_matches_reference, check_transfer, fault_free_json, need_gpus, read
from gpu_procs import replica_transfer, train_plans

from schedcomp.ir import InstrKind, Plan
from schedcomp.runtime.launch import spawn
from schedcomp.topology import Worker

PLANS = Path(__file__).resolve().parent / "plans"

pytestmark = pytest.mark.timeout(420)


@need_gpus(2)
def test_nccl_pipeline_split_and_fused_equal_a_plain_loop(tmp_path: Path) -> None:
    families = ["zb-h1", "1f1b"]
    spawn(train_plans, 2, ([fault_free_json(f, 2, 1, 4) for f in families], str(tmp_path)), timeout=300,
          backend=None)
    results = [read(tmp_path / f"train.{r}.json") for r in range(2)]
    assert all({"isend", "irecv"} <= set(r["calls"]) for r in results)  # activations and gradients over NCCL
    assert_matches_reference(results, families)


@pytest.mark.parametrize(("name", "failed"), [
    pytest.param("rerouted-pp2-dp2-m4-lost1.json", [Worker(1, 0), Worker(1, 1)], marks=need_gpus(2), id="2-gpus"),
    pytest.param("rerouted-pp2-dp2-m4.json", [Worker(1, 1)], marks=need_gpus(3), id="3-gpus"),
])
def test_nccl_rerouted_plan_equals_a_plain_loop(name: str, failed: list[Worker], tmp_path: Path) -> None:
    """pp=2, dp=2 with workers failed: pipeline 1's micro-batches (all of them, or those of its lost stage)
    run on pipeline 0's workers, over NCCL, and the model trained is the fault-free one."""
    text = (PLANS / name).read_text()
    plan = Plan.from_json(text)
    assert set(plan.topology.failed) == set(failed) and not set(failed) & set(plan.workers)
    n = len(plan.workers)
    spawn(train_plans, n, ([text], str(tmp_path)), timeout=300, backend=None)
    results = [read(tmp_path / f"train.{r}.json") for r in range(n)]
    assert {"isend", "irecv"} <= set().union(*(r["calls"] for r in results))
    assert_matches_reference(results, [plan.family])


@need_gpus(2)
def test_replica_transfer_of_cuda_state_over_nccl(tmp_path: Path) -> None:
    spawn(replica_transfer, 2, ("cuda", str(tmp_path)), timeout=240, backend="nccl")
    check_transfer(tmp_path)


@need_gpus(2)
def test_sigkill_recovery_aborts_and_rebuilds_nccl_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """pp=1, dp=2 on two GPUs (NCCL gradient all-reduce); worker 1:0 SIGKILLs itself in iteration 1,
    before its ALLREDUCE, while 0:0 waits in it. 0:0 must give the wait up, abort the generation's NCCL
    communicators, regroup, re-run iteration 1 alone and end on the fault-free model."""
    from fault_procs import run_job
    from resilient_procs import HERE, chaos_reference, flat

    from schedcomp.cache import PlanCache

    cache = PLANS / "cache-pp1-dp2-m4"
    microbatches, iterations = PlanCache.load(cache).microbatches, 4
    victim = Worker(1, 0)
    stream = PlanCache.load(cache).lookup(()).streams[victim]
    allreduce = next(i for i, ins in enumerate(stream) if ins.kind is InstrKind.ALLREDUCE)
    monkeypatch.setenv("CHAOS_BACKEND", "nccl")
    results, err = run_job(1, 2, ["--respawn", "0"],
                           [str(HERE), "resilient", str(iterations), str(cache), f"{victim}@1.{allreduce}"],
                           timeout=300)
    assert set(results) == {"0:0"}, err[-4000:]
    survivor = results["0:0"]
    assert survivor["device"].startswith("cuda")
    assert survivor["iterations"] == iterations and survivor["failed"] == [str(victim)]
    assert [r["rerun"] for r in survivor["recoveries"]] == [1]
    reference = chaos_reference(1, 2 * microbatches, iterations)[0]
    for name, want in reference.items():
        got = survivor["state"][name]
        diff = max(abs(a - b) for a, b in zip(flat(got), flat(want), strict=True))
        assert diff <= TOLERANCE, (name, diff)
