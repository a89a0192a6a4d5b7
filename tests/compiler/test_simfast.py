"""The simulator's fast path for lowered plans (`schedcomp.simfast`) reports what the general engine does."""

from __future__ import annotations

import math

import pytest

from schedcomp import simulator
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.simfast import time_lowered

UNEVEN = CostModel.from_dict({"forward": [1, 1.2, 0.8, 1], "backward_input": [1.5, 1, 1, 2],
                              "backward_weight": [0.5, 1, 1, 0.7], "p2p": 0.1, "allreduce": [0.5] * 4,
                              "optimizer": [0.25] * 4, "speed": {"1:1": 1.3}})
CASES = [
    {"pp": 1, "dp": 2, "microbatches": 3},
    {"pp": 4, "dp": 2, "microbatches": 8, "schedule": "gpipe"},
    {"pp": 4, "dp": 1, "microbatches": 8, "schedule": "zb-h2"},
    {"pp": 4, "dp": 2, "microbatches": 8, "schedule": "zb-v"},
    {"pp": 4, "dp": 2, "microbatches": 8, "schedule": "zb-v", "failed": [(1, 0)]},
    {"pp": 4, "dp": 3, "microbatches": 6, "failed": [(0, 1), (2, 3)]},
    {"pp": 4, "dp": 3, "microbatches": 8, "failed": [(1, 2)], "costs": UNEVEN},
    {"pp": 4, "dp": 2, "microbatches": 8, "schedule": "1f1b", "costs": UNEVEN},
]


@pytest.mark.parametrize("kw", CASES, ids=str)
@pytest.mark.parametrize("synchronous", [False, True])
def test_fast_path_equals_the_general_engine(kw: dict[str, object], synchronous: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    plan = compile(**kw)  # type: ignore[arg-type]
    assert time_lowered(plan, 3, synchronous) is not None  # a compiled plan takes the fast path
    fast = simulator.simulate(plan, 3, synchronous)
    monkeypatch.setattr(simulator, "time_lowered", lambda *args: None)
    general = simulator.simulate(plan, 3, synchronous)
    assert fast.workers == general.workers and fast.memory == general.memory
    for name in ("makespan", "period", "bubble_ratio", "peak_memory"):
        assert math.isclose(getattr(fast, name), getattr(general, name), abs_tol=1e-9), name
    assert fast.iteration_ends == pytest.approx(general.iteration_ends, abs=1e-9)
    assert fast.busy == pytest.approx(general.busy, abs=1e-9)
    assert fast.spans == general.spans  # drawn by the general engine on demand


def test_other_plans_take_the_general_path() -> None:
    plan = compile(pp=2, dp=2, microbatches=4)
    assert time_lowered(plan, 2, False) is not None
    streams = dict(plan.streams)
    w = next(iter(streams))
    streams[w] = streams[w][:-2] + streams[w][-1:] + streams[w][-2:-1]  # STEP before ALLREDUCE: not lowered
    assert time_lowered(type(plan)(plan.topology, plan.costs, plan.microbatches, streams), 2, False) is None
