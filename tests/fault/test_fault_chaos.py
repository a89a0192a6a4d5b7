"""Chaos: SIGKILL workers of a pp = 4, dp = 2 resilient job at seeded random instructions; training goes on.

Each trial launches the job with `python -m schedcomp.runtime.fault.launch` (8 worker processes,
CPU, gloo). The harness picks the victims and the instruction each dies at with its own seeded
random generator; a victim SIGKILLs itself right before that instruction (so the point is exact
and reproducible; the launcher sees a SIGKILL death like any other). Every trial must:
- complete all iterations on every survivor;
- end with every surviving replica of every stage equal to the fault-free reference trained in
  this process on the same batches (float64, 1e-10), i.e. rollback lost no update;
- show, in the ledger carried by each stage's gradient all-reduce, that every micro-batch (a
  fixed set of samples) entered each stage's update exactly once per iteration.

Also: two failures in different stages, a failure during recovery, a failure just before the
optimizer step (a half-applied step), and a rejoin followed by a second failure.
"""

from __future__ import annotations

import random

import pytest
from chaos_job import DP, ITERATIONS, MICROBATCHES, PP, launch, precompile_chaos_plans, precompile_plan, seeds
from resilient_procs import assert_matches_reference, chaos_reference

from schedcomp.topology import Worker

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return precompile_chaos_plans(tmp_path_factory.mktemp("plans"))


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return chaos_reference(PP, DP * MICROBATCHES, ITERATIONS)


def check(results: dict[str, dict], reference: list[dict], dead: set[Worker], iterations: int = ITERATIONS,
          rejoined: set[Worker] = frozenset()) -> None:
    expected = {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(w) for w in dead - rejoined}
    assert_matches_reference(results, reference, expected, iterations, DP * MICROBATCHES)


@pytest.mark.parametrize("seed", seeds(0))
def test_random_sigkill_at_a_random_instruction(cache_dir, reference, seed) -> None:
    rng = random.Random(seed)
    victim = Worker(rng.randrange(DP), rng.randrange(PP))
    plan = precompile_plan(cache_dir)
    iteration, index = rng.randrange(1, ITERATIONS - 1), rng.randrange(len(plan.streams[victim]))
    results = launch(cache_dir, f"{victim}@{iteration}.{index}")
    check(results, reference, {victim})
    for r in results.values():
        assert r["failed"] == [str(victim)]
        assert [rec["rerun"] for rec in r["recoveries"]] in ([iteration], [iteration + 1]), r["recoveries"]


def test_failure_during_the_optimizer_step(cache_dir, reference) -> None:
    # The victim dies right before its STEP: its all-reduce is done, so its stage's other replica
    # steps and commits the iteration while stages behind it may not have: a half-applied step.
    victim = Worker(1, 1)
    stream = precompile_plan(cache_dir).streams[victim]
    results = launch(cache_dir, f"{victim}@2.{len(stream) - 1}")
    check(results, reference, {victim})
    assert all(r["failed"] == [str(victim)] for r in results.values())


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
    # 0:1 dies in iteration 1 and is replaced; the replacement is admitted with the state of its
    # stage's replica 1:1, which then dies in iteration 7: the replacement alone carries stage 1
    # to the end, so its state must be exact. The survivors hold at iteration 3 until it has
    # announced itself, so it enters at iteration 6 at the latest; on a loaded machine it may
    # announce before they finished re-running iteration 1, and enter at iteration 4.
    iterations, a, b = 9, Worker(0, 1), Worker(1, 1)
    results = launch(cache_dir, f"{a}@1.5,{b}@7.3", iterations=iterations, respawn=1, hold=3, timeout=200.0)
    check(results, chaos_reference(PP, DP * MICROBATCHES, iterations), {a, b}, iterations, rejoined={a})
    joined = results[str(a)]
    assert joined["incarnation"] == 1 and joined["resumed_at"] in (4, 5, 6)
    way_in = joined["rejoined"]
    assert way_in["announced_at"] <= way_in["admitted_at"] <= way_in["received_at"] <= way_in["loaded_at"]
    assert way_in["received_bytes"] > 0
    assert all(r["rejoined"] is None for w, r in results.items() if w != str(a))
    assert all(r["failed"] == [str(b)] for r in results.values())
    assert all(r["admitted"] == [joined["resumed_at"]] for w, r in results.items() if w != str(a))


def test_a_death_after_the_final_meeting_changes_nothing(cache_dir, reference) -> None:
    # Issue 11: once every worker has arrived at the final meeting the job is done everywhere; a
    # worker that dies then must not send the others back into recovery (nor make them wait for
    # the ones that already left).
    victim = Worker(1, 2)
    results = launch(cache_dir, f"{victim}@end")
    check(results, reference, {victim})
    for r in results.values():
        assert r["recoveries"] == [], (r["worker"], r["recoveries"])
