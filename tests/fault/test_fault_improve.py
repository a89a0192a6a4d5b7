"""A failure set the plan cache lacks: a repaired plan at once, then the background compile's, switched to together.

The chaos job (pp 4, dp 2, 8 workers) with a cache of the fault-free plan only, served through
`ImprovingPlans`: when 0:2 dies, every survivor re-routes with a plan repaired from the fault-free one,
compiles that failure set in the background and, once every survivor holds the compiled plan (same
digest), switches to it at one agreed iteration boundary. Each worker waits for its own compile at the
start of iteration `WAIT`, so the switch comes at a known point and the test does not race it.
"""

from __future__ import annotations

import pytest
from chaos_job import DP, MICROBATCHES, PP, launch
from resilient_procs import assert_matches_reference, chaos_reference

from schedcomp.cache import precompile
from schedcomp.topology import Worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ITERATIONS, WAIT = 8, 3


def test_a_repaired_plan_then_the_compiled_one_train_exactly_the_fault_free_model(tmp_path, monkeypatch) -> None:
    cache_dir = tmp_path / "plans"
    precompile(PP, DP, MICROBATCHES, 0, directory=cache_dir, time_limit=1.0)
    monkeypatch.setenv("CHAOS_IMPROVE", str(WAIT))
    victim = Worker(0, 2)
    results = launch(str(cache_dir), f"{victim}@1.5", iterations=ITERATIONS)
    expected = {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(victim)}
    assert_matches_reference(results, chaos_reference(PP, DP * MICROBATCHES, ITERATIONS), expected, ITERATIONS,
                             DP * MICROBATCHES)
    switched = {tuple(r["improved"]) for r in results.values()}
    assert len(switched) == 1, switched  # every survivor switched at the same boundary
    (at,) = switched.pop()
    assert WAIT < at < ITERATIONS  # after the last worker's compile, before the end
    assert {r["plan_solver"] for r in results.values()} == {"greedy"}  # the compiled plan ran at the end
    for r in results.values():
        assert [rec["rerun"] for rec in r["recoveries"]] in ([1], [2]), r["recoveries"]
