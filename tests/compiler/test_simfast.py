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


@pytest.mark.parametrize("kw", [{"pp": 4, "dp": 8, "microbatches": 24, "failed": [(1, 2), (5, 0)], "solver": "greedy"},
                                {"pp": 4, "dp": 8, "microbatches": 24, "failed": [(3, 1)], "costs": UNEVEN,
                                 "solver": "greedy"}], ids=str)
def test_the_solvers_timing_is_the_plans(kw: dict[str, object]) -> None:
    """A compiled adaptive plan keeps its solver's timing (`simfast.remember`; where no local search moved ops
    after it: above `LOCAL_SEARCH_MAX_OPS`), which `simulate` reports as is: the same as timing the plan read
    back from its JSON, which carries none."""
    plan = compile(**kw)  # type: ignore[arg-type]
    assert "_schedcomp_timed" in plan.__dict__
    copy = type(plan).from_json(plan.to_json())
    assert "_schedcomp_timed" not in copy.__dict__
    kept, timed = simulator.simulate(plan), simulator.simulate(copy)
    assert (kept.period, kept.makespan, kept.iteration_ends, kept.bubble_ratio) == \
        (timed.period, timed.makespan, timed.iteration_ends, timed.bubble_ratio)
    assert kept.busy == timed.busy and kept.memory == timed.memory
    assert simulator.simulate(plan, 3).iteration_ends == simulator.simulate(copy, 3).iteration_ends  # not kept
