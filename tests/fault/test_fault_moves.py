"""A resilient job whose failure plan cuts the model elsewhere: the survivors move layers, exactly.

The pp = 4, dp = 2 chaos job (`chaos_job`) trains an 8-layer `nn.Sequential` with Adam (CHAOS_MOVES). Its
fault-free plan leaves the cut to the runtime (even: 2, 2, 2, 2); every failure plan of the cache moves a
layer off stage 1 onto stage 0 in every pipeline (3, 1, 2, 2). Worker 0:1 is killed in iteration 1: the
survivors roll back, switch, and layer 2 goes to 0:0 from 1:1 (its own pipeline's holder is dead) and to
1:0 from 1:1. Every survivor's layers equal the fault-free model trained in one process (float64, 1e-10).
Also: the policies that keep layers in place refuse such a cache in one line, before any group is made.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from chaos_job import DP, ITERATIONS, MICROBATCHES, PP, launch
from resilient_procs import adam, chaos_sequential, moves_reference

from schedcomp.cache import PlanCache, precompile
from schedcomp.costs import CostModel
from schedcomp.errors import RuntimeSetupError
from schedcomp.topology import Worker

LAYERS, MOVED = 8, (3, 1, 2, 2)


def moving_cache(directory: Path) -> str:
    """The chaos job's cache (one failure at most) with every failure plan cut as MOVED."""
    cache = precompile(PP, DP, MICROBATCHES, 1, time_limit=1.0)
    for key, plan in list(cache.plans.items()):
        if key[0]:
            cache.plans[key] = dataclasses.replace(plan, partition=MOVED)
    cache.save(directory)
    return str(directory)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_survivors_move_layers_at_the_failure_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = moving_cache(tmp_path / "plans")
    victim = Worker(0, 1)
    stream = PlanCache.load(cache_dir).lookup([]).streams[victim]
    monkeypatch.setenv("CHAOS_MOVES", str(LAYERS))
    results = launch(cache_dir, f"{victim}@1.{len(stream) // 2}")
    assert set(results) == {str(Worker(d, s)) for d in range(DP) for s in range(PP)} - {str(victim)}
    want = moves_reference(LAYERS, DP * MICROBATCHES, ITERATIONS)
    holders: list[int] = []
    for r in results.values():
        assert r["iterations"] == ITERATIONS and r["failed"] == [str(victim)]
        assert [rec["rerun"] for rec in r["recoveries"]] in ([1], [2]), r["recoveries"]
        stage = int(r["worker"].split(":")[1])
        assert sorted(map(int, r["layers"])) == list(range(sum(MOVED[:stage]), sum(MOVED[: stage + 1])))
        for layer, state in r["layers"].items():
            holders.append(int(layer))
            for name, value in want[int(layer)].items():
                diff = max(abs(a - b) for a, b in zip(_flat(state[name]), _flat(value), strict=True))
                assert diff <= 1e-10, (r["worker"], layer, name, diff)
        for i, counts in r["ledger"].items():
            assert counts == [1.0] * DP * MICROBATCHES, (r["worker"], i)
    assert sorted(holders).count(2) == 2  # layer 2 moved to stage 0 of both pipelines


def _flat(x) -> list[float]:
    return [v for item in x for v in _flat(item)] if isinstance(x, list) else [x]


@pytest.mark.parametrize("policy", ["lossy", "logging"])
def test_policies_that_keep_layers_in_place_refuse_plans_that_move_them(tmp_path: Path, policy: str) -> None:
    from schedcomp.compiler import compile
    from schedcomp.runtime.fault.boundary_log import LoggingPolicy
    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.resilient import ResilientTrainer

    plan = compile(PP, DP, MICROBATCHES)
    cache = PlanCache(PP, DP, MICROBATCHES, CostModel.uniform(PP),
                      plans={((), 0): plan, (((0, 1),), 1): dataclasses.replace(plan, partition=MOVED)})
    options = ({"policy": "lossy"} if policy == "lossy" else
               {"logging": LoggingPolicy(), "checkpoint": CheckpointPolicy(tmp_path / "ck", 1)})
    with pytest.raises(RuntimeSetupError, match=r"keeps each stage's layers in place, but the plans cut the model in "
                                                r"2 ways \(\[3, 1, 2, 2\], the runtime's\)"):
        ResilientTrainer(cache, chaos_sequential(LAYERS), lambda y, t: y, adam, lambda i: None, **options)
