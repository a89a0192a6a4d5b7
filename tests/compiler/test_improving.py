"""`ImprovingPlans`: a repaired plan at once for a failure set the cache lacks, a full compile in the background."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schedcomp.cache import precompile
from schedcomp.compiler import compile
from schedcomp.errors import RecoveryError, SchedcompTypeError, ScheduleError
from schedcomp.improving import ImprovingPlans
from schedcomp.simulator import simulate
from schedcomp.topology import Topology, Worker

pytestmark = pytest.mark.timeout(120)

PP, DP, M = 4, 2, 4


@pytest.fixture(scope="module")
def cache():
    return precompile(PP, DP, M, 0, time_limit=1.0)  # the fault-free plan only: every failure is a miss


def settle(plans: ImprovingPlans, topology: Topology) -> None:
    deadline = time.monotonic() + 100
    while plans.pending(topology) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not plans.pending(topology)


def test_a_miss_is_repaired_at_once_and_compiled_in_the_background(cache) -> None:
    plans = ImprovingPlans(cache, time_limit=1.0)
    try:
        topology = Topology.of(PP, DP, [Worker(0, 2)])
        repaired = plans.lookup(topology)
        assert repaired.solver == "repair" and repaired.topology == topology
        assert plans.pending(topology) and plans.improved(topology) is None
        settle(plans, topology)
        better = plans.improved(topology)
        assert better is not None and better.solver != "repair"
        # the very plan a compile in this process gives, under the repaired plan's memory limit
        assert better.to_text() == compile(PP, DP, M, failed=[Worker(0, 2)], schedule="adaptive", time_limit=1.0,
                                           memory_limit=repaired.costs.memory_limit).to_text()
        assert simulate(better).period < simulate(repaired).period
        # lookup keeps serving the repaired plan: every worker must run the same one until they agree to switch
        assert plans.lookup(topology).to_text() == repaired.to_text()
        assert not plans.pending(topology)  # no second compile
        assert plans.lookup(Topology.of(PP, DP)) is not None and plans.improved(Topology.of(PP, DP)) is None
    finally:
        plans.close()


def test_a_cache_of_re_partitioning_plans_compiles_with_layer_moves_in_the_background() -> None:
    # Layer costs (2 per stage): the repaired plan keeps the job's cut; the compiled one also moves layers
    # off the stage that lost a worker, under the same device totals.
    layered = precompile(PP, DP, M, 0, time_limit=1.0, layers=2)
    plans = ImprovingPlans(layered, time_limit=1.0)
    try:
        topology = Topology.of(PP, DP, [Worker(0, 2)])
        repaired = plans.lookup(topology)
        assert repaired.partition == layered.partition == (2, 2, 2, 2)
        settle(plans, topology)
        better = plans.improved(topology)
        assert better is not None and better.partition is not None and better.partition[2] < 2
        assert better.to_text() == compile(PP, DP, M, failed=[Worker(0, 2)], schedule="adaptive", time_limit=1.0,
                                           layers=2, memory_limit=repaired.costs.memory_limit,
                                           reform="never").to_text()  # (resilient jobs: no re-formed plans yet)
        assert simulate(better).period < simulate(repaired).period
    finally:
        plans.close()


def test_a_compile_no_better_than_the_repair_is_not_offered(cache, caplog: pytest.LogCaptureFixture) -> None:
    plans = ImprovingPlans(cache, time_limit=1.0)
    try:
        topology = Topology.of(PP, DP, [Worker(1, 3)])  # the repair is already as fast as a compile
        plans.lookup(topology)
        settle(plans, topology)
        with caplog.at_level(logging.INFO, logger="schedcomp.improving"):
            assert plans.improved(topology) is None
        assert "is no better: keeping the repaired plan (its period 27 is no better than the repaired plan's 27)" \
            in caplog.text
    finally:
        plans.close()


class Failing(ImprovingPlans):
    """A background process that fails as a compile would (one line on stderr, exit 2)."""

    def _command(self, folder: Path) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.exit('schedcomp.improving: out of memory, say')"]


def test_a_failed_compile_leaves_the_repaired_plan(cache, caplog: pytest.LogCaptureFixture) -> None:
    plans = Failing(cache)
    try:
        topology = Topology.of(PP, DP, [Worker(0, 2)])
        assert plans.lookup(topology).solver == "repair"
        settle(plans, topology)
        with caplog.at_level(logging.WARNING, logger="schedcomp.improving"):
            assert plans.improved(topology) is None
        assert "gave no plan (schedcomp.improving: out of memory, say)" in caplog.text
        assert plans.improved(topology) is None and plans.lookup(topology).solver == "repair"
    finally:
        plans.close()


def test_a_miss_nothing_can_repair_raises_the_miss(cache) -> None:
    plans = ImprovingPlans(cache, memory_limit=0.5)  # under the fault-free plan's own needs
    try:
        with pytest.raises(RecoveryError):
            plans.lookup(Topology.of(PP, DP, [Worker(0, 2)]))
        assert not plans.pending(Topology.of(PP, DP, [Worker(0, 2)]))  # and compiles nothing
    finally:
        plans.close()


def test_close_stops_a_running_compile_and_removes_its_folder(cache) -> None:
    plans = ImprovingPlans(cache, solver="cpsat", time_limit=60.0)
    topology = Topology.of(PP, DP, [Worker(0, 2)])
    plans.lookup(topology)
    job = plans._compiles[topology.failed]
    assert plans.pending(topology) and job.folder.is_dir()
    plans.close()
    assert job.process.returncode is not None and not job.folder.exists()


def test_a_newer_failure_set_stops_the_older_compile(cache) -> None:
    plans = ImprovingPlans(cache, solver="cpsat", time_limit=60.0)
    try:
        first, second = Topology.of(PP, DP, [Worker(0, 2)]), Topology.of(PP, DP, [Worker(0, 2), Worker(1, 3)])
        plans.lookup(first)
        old = plans._compiles[first.failed]
        plans.lookup(second)
        assert old.process.returncode is not None and not old.folder.exists()
        assert plans.pending(second) and not plans.pending(first)
    finally:
        plans.close()


ORPHAN = """
import os, sys, time
from schedcomp.cache import PlanCache
from schedcomp.improving import ImprovingPlans
from schedcomp.topology import Topology, Worker
plans = ImprovingPlans(PlanCache.load(sys.argv[1]), solver="cpsat", time_limit=60.0)
topology = Topology.of(4, 2, [Worker(0, 2)])
plans.lookup(topology)
job = plans._compiles[topology.failed]
print(job.process.pid, job.folder, flush=True)
os._exit(0)  # as a fenced or killed worker leaves: no close(), no finalizers
"""


def test_a_compile_does_not_outlive_its_worker(tmp_path: Path) -> None:
    precompile(PP, DP, M, 0, time_limit=1.0, directory=tmp_path / "plans")
    out = subprocess.run([sys.executable, "-c", ORPHAN, str(tmp_path / "plans")], capture_output=True, text=True,
                         timeout=100, check=True).stdout.split()
    pid, folder = int(out[0]), Path(out[1])
    deadline = time.monotonic() + 60  # it looks every 0.2 s; a hang guard, not a timing
    while (folder.exists() or _alive(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not folder.exists() and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # (an exited child of the dead parent is reaped by init)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_bad_input_is_one_clear_error(cache) -> None:
    with pytest.raises(SchedcompTypeError, match="ImprovingPlans needs a PlanCache"):
        ImprovingPlans("plans/")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="unknown solver 'fast'"):
        ImprovingPlans(cache, solver="fast")
    with pytest.raises(ScheduleError, match="time_limit must be a positive number"):
        ImprovingPlans(cache, time_limit=float("nan"))
    with pytest.raises(ScheduleError, match="this cache's have 2 chunks: pass the PlanCache itself"):
        ImprovingPlans(precompile(2, 2, 4, 0, chunks=2, placement="v"))
