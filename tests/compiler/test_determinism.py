"""Every rank may compile the same plan on its own: `compile` must not depend on the clock or the load.

Each test compiles one adaptive job twice, the second time with the clock running a million times
too fast (so a wall-clock deadline would fire at once) or with a busy thread competing for the CPU,
and asserts that both plans are the same, byte for byte in JSON.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from schedcomp.compiler import compile
from schedcomp.costs import CostModel

# Local search runs (and improves the list scheduler's result) on this job.
GREEDY_JOB = {"pp": 6, "dp": 3, "microbatches": 8, "failed": [(1, 2), (2, 4)], "solver": "greedy",
              "costs": CostModel.uniform(6, p2p=0.1, allreduce=0.5)}
# `auto` picks CP-SAT here (the model fits the time limit; the greedy result is above the bound). Without
# the limit lifted, the default per-stage limit's memory bound shows the greedy result optimal (19) and
# CP-SAT is not run.
AUTO_JOB = {"pp": 3, "dp": 2, "microbatches": 2, "failed": [(1, 1)], "solver": "auto", "time_limit": 1.8,
            "costs": CostModel.uniform(3, p2p=0.5, allreduce=1.0), "memory_limit": None}


@contextmanager
def busy_cpu() -> Iterator[None]:
    """A thread spinning in Python (it competes for the interpreter and the CPU) while the body runs."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fast_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reading of the clock is 10^6 s later than the one before."""
    for name in ("perf_counter", "monotonic", "time", "process_time"):
        ticks = itertools.count()
        base = getattr(time, name)()
        monkeypatch.setattr(time, name, lambda ticks=ticks, base=base: base + 1e6 * next(ticks))


def test_greedy_plan_does_not_depend_on_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = compile(**GREEDY_JOB)
    assert plan.solver == "greedy"
    fast_clock(monkeypatch)
    assert compile(**GREEDY_JOB).to_json() == plan.to_json()


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
def test_greedy_plan_does_not_depend_on_the_load() -> None:
    plan = compile(**GREEDY_JOB)
    with busy_cpu():
        again = compile(**GREEDY_JOB)
    assert again.to_json() == plan.to_json()


def test_auto_plan_with_cpsat_does_not_depend_on_the_load_or_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = compile(**AUTO_JOB)
    assert plan.solver == "cpsat"
    fast_clock(monkeypatch)
    with busy_cpu():
        again = compile(**AUTO_JOB)
    assert again.to_json() == plan.to_json()
