"""A resilient job whose failure plan re-cuts micro-batches: the survivors run pieces, exactly.

pp = 2, dp = 3, M = 3 (6 worker processes, CPU, gloo), plans from `precompile(recut=True)`: a failed worker's
3 micro-batches go to its place's 2 peers as pieces of half a micro-batch (1.5 micro-batches each, where whole
ones leave one peer 2 of them), and the other pipelines run half micro-batches too (`recut.halve_the_rest`:
their warm-up waits half as long under the memory limit). Worker 1:1 is SIGKILLed in the middle of iteration
1; the survivors roll back, switch to that re-cut plan and train on. Every survivor's stage equals the
fault-free model trained in one process on the same batches (float64, 1e-10), and its ledger, counting the rows of
each regular micro-batch its pieces hold (`Iteration.count`), shows every micro-batch entered each iteration's
update exactly once (all ones, compared exactly).
"""

from __future__ import annotations

import pytest
from fault_procs import run_job
from recut_cache import DP, PP, precompile_recut
from recut_cache import M as MICROBATCHES
from resilient_procs import HERE, ROWS, assert_matches_reference, chaos_reference

from schedcomp.cache import PlanCache, precompile
from schedcomp.simulator import simulate
from schedcomp.topology import Worker

ITERATIONS = 4
VICTIM = Worker(1, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_survivors_switch_to_a_re_cut_plan_and_train_the_fault_free_model(tmp_path) -> None:
    cache = PlanCache.load(precompile_recut(tmp_path))
    switched = cache.lookup([VICTIM])
    # the plan the survivors switch to really re-cuts (and is faster than whole micro-batches would be)
    assert switched.cut.pipelines.keys() == set(range(DP))
    assert len(switched.cut.sizes(VICTIM.pipeline, MICROBATCHES)) > MICROBATCHES
    halves = (0.5,) * 2 * MICROBATCHES
    assert all(switched.cut.sizes(d, MICROBATCHES) == halves for d in range(DP) if d != VICTIM.pipeline)
    whole = precompile(PP, DP, MICROBATCHES, 1, time_limit=1.0).lookup([VICTIM])
    assert simulate(switched).period < simulate(whole).period
    # every piece holds whole samples of the job's batches (`resilient_procs.chaos_batch`: ROWS per micro-batch)
    assert all(stop > start for d in range(DP) for start, stop in (switched.cut.rows(d, m, ROWS) for m in
                                                                   range(switched.cut.count(d, MICROBATCHES))))
    stream = cache.lookup([]).streams[VICTIM]
    results, _ = run_job(PP, DP, ["--respawn", "0"],
                         [str(HERE), "resilient", str(ITERATIONS), str(tmp_path), f"{VICTIM}@1.{len(stream) // 2}",
                          "-1"], timeout=150.0)
    expected = {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(VICTIM)}
    assert_matches_reference(results, chaos_reference(PP, DP * MICROBATCHES, ITERATIONS), expected, ITERATIONS,
                             DP * MICROBATCHES)
    for r in results.values():
        assert r["failed"] == [str(VICTIM)]
        assert [rec["rerun"] for rec in r["recoveries"]] in ([1], [2]), r["recoveries"]
