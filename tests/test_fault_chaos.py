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
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from resilient_procs import HERE, chaos_reference

from schedcomp.cache import precompile
from schedcomp.topology import Worker

PP, DP, MICROBATCHES, ITERATIONS = 4, 2, 4, 5
TOLERANCE = 1e-10

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("plans")
    precompile(PP, DP, MICROBATCHES, 2, directory=directory, time_limit=1.0)
    return str(directory)


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return chaos_reference(PP, DP * MICROBATCHES, ITERATIONS)


def launch(cache_dir: str, victims: str, iterations: int = ITERATIONS, respawn: int = 0, hold: int = -1,
           timeout: float = 150.0) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", str(PP), "--dp", str(DP),
           "--respawn", str(respawn), "--", sys.executable, str(HERE), "resilient", str(iterations), cache_dir,
           victims, str(hold)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # workers dump their stacks after CHILD_DEADLINE: show them
        proc.terminate()  # the launcher stops its workers
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"the job did not finish in {timeout} s:\n{err[-12000:]}") from None
    assert proc.returncode == 0, err[-6000:]
    results: dict[str, dict] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["worker"]] = r  # a replacement's line comes last
    return results


def check(results: dict[str, dict], reference: list[dict], dead: set[Worker], iterations: int = ITERATIONS,
          rejoined: set[Worker] = frozenset()) -> None:
    expected = {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(w) for w in dead - rejoined}
    assert set(results) == expected, sorted(results)
    for r in results.values():
        stage = Worker.parse(r["worker"]).stage
        assert r["iterations"] == iterations
        for name, value in reference[stage].items():
            got = r["state"][name]
            diff = max(abs(a - b) for a, b in zip(_flat(got), _flat(value), strict=True))
            assert diff <= TOLERANCE, (r["worker"], name, diff)
        first = r["resumed_at"] or 0
        assert sorted(map(int, r["ledger"])) == list(range(first, iterations)), r["worker"]
        for i, counts in r["ledger"].items():
            assert counts == [1.0] * (DP * MICROBATCHES), (r["worker"], i, counts)
    assert len({r["generation"] for r in results.values()}) == 1


def _flat(x) -> list[float]:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


@pytest.mark.parametrize("seed", [0, 1, 2])
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


def precompile_plan(cache_dir: str):
    from schedcomp.cache import PlanCache

    return PlanCache.load(cache_dir).lookup([])
