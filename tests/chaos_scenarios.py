"""More chaos scenarios (pp = 4, dp = 2, 8 processes): NOT collected by the suite (about 2 minutes).

Run them with `python -m pytest tests/chaos_scenarios.py -q`. Each passed when written (00:40 UTC,
2-core box, alongside other work) but has not yet been run three times in a row under load, the
bar for `tests/test_fault_chaos.py`; the helpers and checks are that file's.
"""

from __future__ import annotations

import random

import pytest
from resilient_procs import chaos_reference
from test_fault_chaos import DP, MICROBATCHES, PP, cache_dir, check, launch, precompile_plan, reference

from schedcomp.topology import Worker

__all__ = ["cache_dir", "reference"]  # fixtures, used by name

pytestmark = pytest.mark.timeout(600)


def test_two_failures_in_different_stages(cache_dir, reference) -> None:
    rng = random.Random(10)
    first, second = rng.sample(range(PP), 2)
    a, b = Worker(rng.randrange(DP), first), Worker(rng.randrange(DP), second)
    plan = precompile_plan(cache_dir)
    ia, ib = rng.randrange(len(plan.streams[a])), rng.randrange(len(plan.streams[b]))
    results = launch(cache_dir, f"{a}@1.{ia},{b}@2.{ib}")
    check(results, reference, {a, b})
    assert all(r["failed"] == sorted([str(a), str(b)]) for r in results.values())


def test_failure_during_recovery(cache_dir, reference) -> None:
    # 0:2 dies mid-stream; 1:0 dies once the survivors agreed and rolled back, while they rebuild
    # their groups and switch plans: recovery itself breaks and starts again.
    a, b = Worker(0, 2), Worker(1, 0)
    results = launch(cache_dir, f"{a}@2.7,{b}@rec")
    check(results, reference, {a, b})
    assert all(r["failed"] == sorted([str(a), str(b)]) for r in results.values())


def test_rejoin_then_a_second_failure(cache_dir) -> None:
    # 0:1 dies in iteration 1 and is replaced; the replacement is admitted at iteration 6 with the
    # state of its stage's replica 1:1, which then dies in iteration 7: the replacement alone
    # carries stage 1 to the end, so its state must be exact.
    iterations, a, b = 9, Worker(0, 1), Worker(1, 1)
    results = launch(cache_dir, f"{a}@1.5,{b}@7.3", iterations=iterations, respawn=1, hold=3, timeout=200.0)
    check(results, chaos_reference(PP, DP * MICROBATCHES, iterations), {a, b}, iterations, rejoined={a})
    joined = results[str(a)]
    assert joined["incarnation"] == 1 and joined["resumed_at"] == 6
    assert all(r["failed"] == [str(b)] for r in results.values())
    assert all(6 in r["admitted"] for w, r in results.items() if w != str(a))
