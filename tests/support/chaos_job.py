"""The pp = 4, dp = 2 resilient job the chaos and lossy tests launch: its shape, its plans, its launcher;
and `precompile_family`, the plans of a job whose fault-free plan is a given family's (virtual stages)."""

from __future__ import annotations

import os
from pathlib import Path

from fault_procs import run_job
from resilient_procs import HERE

from schedcomp import compile
from schedcomp.cache import PlanCache, precompile
from schedcomp.ir import Plan

PP, DP, MICROBATCHES, ITERATIONS = 4, 2, 4, 5


def seeds(default: int) -> list[int]:
    """The random trials' seeds: one in `make test` (CI's time), any list for a soak run
    (`SCHEDCOMP_CHAOS_SEEDS=0,1,2,3,4`): each seed is a different victim and point of death."""
    given = os.environ.get("SCHEDCOMP_CHAOS_SEEDS", "")
    return [int(s) for s in given.split(",") if s.strip()] or [default]


def precompile_chaos_plans(directory: Path) -> str:
    """The job's plan cache (every failure set of up to 2 workers), in `directory`."""
    precompile(PP, DP, MICROBATCHES, 2, directory=directory, time_limit=1.0)
    return str(directory)


def precompile_family(directory: Path, pp: int, dp: int, microbatches: int, max_failures: int, family: str) -> str:
    """A plan cache in `directory` for every failure set of up to `max_failures` workers (re-routed, with
    the family's chunks and placement), whose fault-free plan is `family`'s own."""
    plan = compile(pp, dp, microbatches, schedule=family)
    cache = precompile(pp, dp, microbatches, max_failures, chunks=plan.topology.chunks,
                       placement=plan.topology.placement, time_limit=1.0)
    fault_free = next(key for key in cache.plans if not key[0])
    cache.plans[fault_free] = plan
    cache.save(directory)
    return str(directory)


def precompile_plan(cache_dir: str) -> Plan:
    """The fault-free plan of the cache."""
    return PlanCache.load(cache_dir).lookup([])


def launch(cache_dir: str, victims: str, iterations: int = ITERATIONS, respawn: int = 0, hold: int = -1,
           timeout: float = 150.0) -> dict[str, dict]:
    """Run the job under the launcher with `victims` (see `resilient_procs`); each survivor's result by worker."""
    results, _ = run_job(PP, DP, ["--respawn", str(respawn)],
                         [str(HERE), "resilient", str(iterations), cache_dir, victims, str(hold)], timeout)
    return results
