"""The small job whose failure plan re-forms the pipeline that lost a worker (pp 3, dp 2, M 3, 6 layers: 2 per
place), put in a plan cache as tests put plans there (`compile(..., reform=)` over a precompiled cache)."""

from __future__ import annotations

from pathlib import Path

from schedcomp.cache import PlanCache, precompile
from schedcomp.compiler import compile
from schedcomp.scenarios import canonical
from schedcomp.topology import Worker

PP, DP, M, LAYERS = 3, 2, 3, 6
VICTIM = Worker(1, 1)
REFORMED = ((2, 2, 2), (3, 0, 3))
"""The partitions of VICTIM's plan: pipeline 1 re-formed over its places 0 and 2."""


def reformed_cache(directory: Path | None = None) -> PlanCache:
    """The job's cache (one failure at most) whose plan for VICTIM failed re-forms its pipeline (shares by
    throughput, 3.6 and 2.4 micro-batches, in pieces) and whose other failure plans re-route; saved in
    `directory` when given. (precompile's default, reform="auto", would re-form every one: the tests read a
    cache holding both kinds, a re-formed scenario the only one with partitions in the index.)"""
    cache = precompile(PP, DP, M, 1, time_limit=1.0, layers=LAYERS // PP, reform="never")
    plan = compile(PP, DP, M, failed=[str(VICTIM)], layers=LAYERS // PP, reform=(VICTIM.pipeline,))
    key = canonical(plan.topology, plan.costs).key
    assert key in cache.plans and plan.partitions == REFORMED
    cache.plans[key] = plan
    if directory is not None:
        cache.save(directory)
    return cache
