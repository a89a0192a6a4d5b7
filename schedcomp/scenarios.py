"""Failure scenarios up to symmetry: the canonical form of a failure set, and a plan renamed to another.

Pipelines are interchangeable: relabelling them maps a plan for one failure set to a plan for
another. So a failure set is reduced to a canonical form: each pipeline's signature is its sorted
tuple of failed stages, after its speed class (its workers' speed factors, which break the symmetry
when they differ); pipelines are sorted by signature and renumbered in that order (`canonical`).
`relabel` renames a canonical plan's pipelines back; `scenarios` lists every distinct recoverable
failure set up to a size. The plan cache (`schedcomp.cache`) stores one plan per canonical scenario.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from schedcomp import limits
from schedcomp.costs import CostModel
from schedcomp.cut import Cut
from schedcomp.errors import LimitError
from schedcomp.ir import Instruction, Op, Plan
from schedcomp.partitions import Partitions
from schedcomp.topology import Topology, Worker

Failed = tuple[tuple[int, int], ...]
"""Canonical failed workers: sorted (pipeline, stage) pairs after renumbering the pipelines."""
Key = tuple[Failed, tuple[int, ...]]
"""A canonical scenario: the failed workers, and each canonical pipeline's speed class (the index of its
workers' speed factors among the job's distinct ones; empty when all pipelines run at one speed)."""


@dataclass(frozen=True)
class Canonical:
    """A failure set in canonical form; canonical pipeline i is concrete pipeline perm[i]."""

    failed: Failed
    classes: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def key(self) -> Key:
        return (self.failed, self.classes)


def canonical(topology: Topology, costs: CostModel | None = None) -> Canonical:
    """Canonical form of `topology`'s failure set (see the module docstring)."""
    pp, dp = topology.pp, topology.dp
    speed = costs.speed if costs is not None else {}
    if speed:
        speeds = [tuple(speed.get(Worker(d, s), 1.0) for s in range(pp)) for d in range(dp)]
        distinct = sorted(set(speeds))
        cls = [distinct.index(v) for v in speeds]
    else:  # one speed class: skip the pp * dp look-ups (the goodput simulator canonicalises often)
        distinct, cls = [()], [0] * dp
    stages: dict[int, list[int]] = {}
    for w in topology.failed:
        stages.setdefault(w.pipeline, []).append(w.stage)
    failed = [tuple(sorted(stages.get(d, ()))) for d in range(dp)]
    perm = tuple(sorted(range(dp), key=lambda d: (cls[d], failed[d], d)))
    key = tuple(sorted((i, s) for i, d in enumerate(perm) for s in failed[d]))
    classes = tuple(cls[d] for d in perm) if len(distinct) > 1 else ()
    return Canonical(key, classes, perm)


def canonical_costs(costs: CostModel, perm: tuple[int, ...]) -> CostModel:
    """The cost model seen from the canonical numbering (canonical pipeline i is concrete perm[i])."""
    if not costs.speed:
        return costs
    inverse = {d: i for i, d in enumerate(perm)}
    speed = {Worker(inverse[w.pipeline], w.stage): v for w, v in costs.speed.items()}
    return CostModel(**{**costs.__dict__, "speed": speed})


def key_name(key: Key) -> str:
    """A scenario's file name, spelled as the CLI spells failures: `healthy` or `failed-2:0,3:5`
    (pipeline:stage), then `-classes-0,0,1` (the speed classes) when pipelines differ in speed."""
    failed, classes = key
    name = "healthy" if not failed else "failed-" + ",".join(f"{d}:{s}" for d, s in failed)
    return name + ("-classes-" + ",".join(map(str, classes)) if classes else "")


def legacy_key_name(key: Key) -> str:
    """The name caches written before readable names used (`f2.0-3.5-c0.0.1`): their indexes still load."""
    failed, classes = key
    name = "healthy" if not failed else "f" + "-".join(f"{d}.{s}" for d, s in failed)
    return name + ("-c" + ".".join(map(str, classes)) if classes else "")


def relabel(plan: Plan, perm: Mapping[int, int] | tuple[int, ...]) -> Plan:
    """Rename pipeline d of `plan` to perm[d] everywhere: workers, ops, peers, failures, speed factors."""
    mapping = dict(enumerate(perm)) if isinstance(perm, tuple) else dict(perm)

    def worker(w: Worker) -> Worker:
        return Worker(mapping[w.pipeline], w.stage)

    ops: dict[Op, Op] = {}

    def op(o: Op | None) -> Op | None:
        if o is None:
            return None
        new = ops.get(o)
        if new is None:
            new = ops[o] = Op(o.kind, mapping[o.pipeline], o.microbatch, o.stage)
        return new

    streams = {
        worker(w): tuple(Instruction(i.kind, op(i.op), worker(i.peer) if i.peer is not None else None) for i in stream)
        for w, stream in plan.streams.items()
    }
    topo = plan.topology

    def renamed(costs: CostModel) -> CostModel:
        if not costs.speed:
            return costs
        return CostModel(**{**costs.__dict__, "speed": {worker(w): v for w, v in costs.speed.items()}})

    partitions = None
    if plan.partitions is not None:  # re-formed pipelines: each pipeline's partition goes with it
        partitions = tuple(plan.partitions[d] for d in sorted(mapping, key=mapping.__getitem__))
    return Plan(
        topology=dataclasses.replace(topo, failed=frozenset(worker(w) for w in topo.failed)),
        costs=renamed(plan.costs),
        microbatches=plan.microbatches,
        streams=streams,
        family=plan.family,
        solver=plan.solver,
        lower_bound=plan.lower_bound,
        meta=_renamed_meta(plan.meta, mapping, partitions),
        cut=Cut(tuple(sorted((mapping[d], b) for d, b in plan.cut.bounds)), plan.cut.shares),
        partition=plan.partition,
        partitions=partitions,
        pipeline_costs={mapping[d]: renamed(c) for d, c in plan.pipeline_costs.items()},
        layer_allreduce=plan.layer_allreduce,
    )


def _renamed_meta(meta: Mapping[str, Any], mapping: dict[int, int], partitions: Partitions | None) -> dict[str, Any]:
    """`meta` with `compile(reform=)`'s record (`meta["reform"]`) naming the renamed pipelines and their
    partitions; anything else (or a record not of that shape: meta is free-form) as it was."""
    reform = meta.get("reform")
    if partitions is None or not isinstance(reform, dict):
        return dict(meta)
    renamed = dict(reform)
    pipes = reform.get("pipelines")
    if isinstance(pipes, list) and all(type(d) is int and d in mapping for d in pipes):
        renamed["pipelines"] = sorted(mapping[d] for d in pipes)
    if "partitions" in reform:
        renamed["partitions"] = [list(p) for p in partitions]
    return {**meta, "reform": renamed}


def scenarios(pp: int, dp: int, max_failures: int, costs: CostModel | None = None) -> list[Canonical]:
    """Every distinct recoverable failure scenario with at most `max_failures` failed workers
    (no failures included), canonical, in a deterministic order (fewest failures first)."""
    # More than pp x (dp - 1) failures always empties a stage, so larger k adds nothing: clamp it.
    max_failures = min(max_failures, pp * (dp - 1))
    top = limits.SCENARIOS.value()
    # Each failure pattern of one pipeline is a scenario of its own (dp > 1): count them before listing.
    n_patterns = sum(math.comb(pp, size) for size in range(1, min(max_failures, pp) + 1))
    limits.SCENARIOS.check(n_patterns, f"pp={pp} dp={dp} with up to {max_failures} failures")
    patterns = [p for size in range(1, min(max_failures, pp) + 1) for p in itertools.combinations(range(pp), size)]
    # Pipelines with equal speed signatures are interchangeable: choose patterns per class.
    speed = costs.speed if costs is not None else {}
    classes: dict[tuple[float, ...], list[int]] = {}
    for d in range(dp):
        classes.setdefault(tuple(speed.get(Worker(d, s), 1.0) for s in range(pp)), []).append(d)
    members = list(classes.values())
    seen: dict[Key, Canonical] = {}

    def choose(ci: int, budget: int, failed: list[Worker]) -> Iterator[list[Worker]]:
        if ci == len(members):
            yield failed
            return
        pipes = members[ci]
        for count in range(0, min(len(pipes), budget) + 1):
            for combo in itertools.combinations_with_replacement(range(len(patterns)), count):
                size = sum(len(patterns[i]) for i in combo)
                if size > budget:
                    continue
                chosen = [Worker(pipes[j], s) for j, i in enumerate(combo) for s in patterns[i]]
                yield from choose(ci + 1, budget - size, failed + chosen)

    for visited, failed in enumerate(choose(0, max_failures, []), 1):
        if len(seen) > top or visited > 4 * top:  # most visits are distinct scenarios: bound the walk itself
            raise LimitError(f"pp={pp} dp={dp} with up to {max_failures} failures has more than {top:,} failure "
                             f"scenarios: lower --max-failures, or raise the limit with {limits.SCENARIOS.env}")
        per_stage = [0] * pp
        for w in failed:
            per_stage[w.stage] += 1
        if max(per_stage, default=0) >= dp:
            continue  # a stage with no live worker: needs a checkpoint, not a plan
        c = canonical(Topology.of(pp, dp, failed), costs)
        seen.setdefault(c.key, c)
    return sorted(seen.values(), key=lambda c: (len(c.failed), c.key))
