"""Lossy forward end to end: SIGKILL a worker of a pp = 4, dp = 2 job (8 processes) under `policy="lossy"`.

The survivors finish the interrupted iteration without the lost micro-batches instead of
re-running it. Every trial must:
- complete all iterations on every survivor, without re-running or undoing anything;
- report the same skipped chunks everywhere: exactly the micro-batches that had a slot on the
  victim in the plan of that iteration, and their samples;
- show in each stage's ledger (carried by its gradient all-reduce) every kept micro-batch counted
  exactly once at every stage, and nothing counted twice;
- end with every surviving replica equal (float64, 1e-10) to a single-process model whose stage s
  update in each iteration is the mean gradient over exactly the chunks its ledger counts
  (`lossy_reference`) — and, when something was skipped, different from the fault-free model.
"""

from __future__ import annotations

import random

import pytest
from chaos_job import DP, ITERATIONS, MICROBATCHES, PP, launch, precompile_chaos_plans, precompile_plan, seeds
from resilient_procs import ROWS, chaos_reference, flat, lossy_reference

from schedcomp.runtime.fault.residual import lost_microbatches, skipped_chunks
from schedcomp.topology import Worker

CHUNKS = DP * MICROBATCHES
TOLERANCE = 1e-10

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return precompile_chaos_plans(tmp_path_factory.mktemp("plans"))


@pytest.fixture(autouse=True)
def lossy(monkeypatch) -> None:
    monkeypatch.setenv("CHAOS_POLICY", "lossy")  # read by the workers (`resilient_procs`)


def held_chunks(results: dict[str, dict]) -> dict[int, dict[int, set[int]]]:
    """Iteration -> stage -> the chunks its ledger counts; checks replicas agree and nothing counts twice."""
    held: dict[int, dict[int, set[int]]] = {}
    for r in results.values():
        stage = Worker.parse(r["worker"]).stage
        for i, counts in r["ledger"].items():
            assert set(counts) <= {0.0, 1.0}, (r["worker"], i, counts)
            got = {c for c, n in enumerate(counts) if n == 1.0}
            assert held.setdefault(int(i), {}).setdefault(stage, got) == got, (r["worker"], i)
    return held


def check_lossy(results: dict[str, dict], victims: set[Worker], may_roll_back: bool = False) -> dict[int, list[int]]:
    """The checks of the module docstring; returns the skipped chunks per iteration."""
    expected = {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(w) for w in victims}
    assert set(results) == expected
    skipped = {int(i): v for i, v in next(iter(results.values()))["skipped"].items()}
    for r in results.values():
        assert r["iterations"] == ITERATIONS
        assert sorted(map(int, r["ledger"])) == list(range(ITERATIONS)), r["worker"]
        assert {int(i): v for i, v in r["skipped"].items()} == skipped, r["worker"]
        assert {int(i): n for i, n in r["skipped_samples"].items()} == {i: len(v) * ROWS for i, v in skipped.items()}
        # nothing re-run: every recovery finished an iteration lossily, or came after the last one
        assert may_roll_back or all(rec["method"] == "lossy" or rec["rerun"] >= ITERATIONS
                                    for rec in r["recoveries"]), r["recoveries"]
    held = held_chunks(results)
    for i, stages in held.items():
        kept = set(range(CHUNKS)) - set(skipped.get(i, ()))
        for stage, chunks in stages.items():
            assert kept <= chunks, (i, stage, sorted(chunks))  # every kept micro-batch counted at every stage
    reference = lossy_reference(PP, CHUNKS, ITERATIONS, held)
    fault_free = chaos_reference(PP, CHUNKS, ITERATIONS)
    differs = 0.0
    for r in results.values():
        stage = Worker.parse(r["worker"]).stage
        for name, value in reference[stage].items():
            diff = max(abs(a - b) for a, b in zip(flat(r["state"][name]), flat(value), strict=True))
            assert diff <= TOLERANCE, (r["worker"], name, diff)
            differs = max(differs, max(abs(a - b) for a, b in zip(flat(value), flat(fault_free[stage][name]),
                                                                 strict=True)))
    if any(skipped.values()):
        assert differs > 1e-6  # the lossy path really ran: the model is not the fault-free one
    assert len({r["generation"] for r in results.values()}) == 1
    return skipped


@pytest.mark.parametrize("seed", seeds(3))
def test_lossy_finishes_the_iteration_without_the_lost_microbatches(cache_dir, seed) -> None:
    rng = random.Random(seed)
    victim = Worker(rng.randrange(DP), rng.randrange(PP))
    plan = precompile_plan(cache_dir)
    iteration, index = rng.randrange(1, ITERATIONS - 1), rng.randrange(1, len(plan.streams[victim]))
    results = launch(cache_dir, f"{victim}@{iteration}.{index}")
    skipped = check_lossy(results, {victim})
    lost = list(skipped_chunks(lost_microbatches(plan, [victim]), MICROBATCHES))
    for r in results.values():
        (recovery,) = r["recoveries"]
        assert recovery["method"] == "lossy" and recovery["rerun"] in (iteration, iteration + 1)
        assert skipped == {recovery["rerun"]: lost}  # the micro-batches with a slot on the victim


def test_lossy_failure_just_before_the_last_optimizer_step(cache_dir) -> None:
    # The victim's all-reduce is done when it dies: its stage's replica steps with every gradient,
    # stages behind it finish without the victim's micro-batches. In the last iteration, survivors
    # that had all stepped it may only notice in the final meeting: nothing is left to finish, and
    # no extra iteration may be trained (check_lossy counts them).
    victim = Worker(1, 1)
    stream = precompile_plan(cache_dir).streams[victim]
    results = launch(cache_dir, f"{victim}@{ITERATIONS - 1}.{len(stream) - 1}")
    check_lossy(results, {victim})


def test_lossy_with_a_failure_during_recovery(cache_dir) -> None:
    # A second worker dies while the survivors recover from the first. Whether they had already
    # claimed the lossy finish (then they fall back to rollback) or not (then they finish without
    # both workers' micro-batches), the model must be the one the ledgers describe.
    a, b = Worker(0, 2), Worker(1, 0)
    results = launch(cache_dir, f"{a}@2.7,{b}@rec")
    check_lossy(results, {a, b}, may_roll_back=True)
    assert all(r["failed"] == sorted([str(a), str(b)]) for r in results.values())
