"""The validator's rules for plans with per-pipeline partitions (re-formed pipelines, `schedcomp.partitions`).

Plan-level (`reformed_rules`): the partitions are well formed for the topology (0 exactly at a re-formed
pipeline's failed places), `partition` names the pipelines that keep it and `pipeline_costs` has a stage
cost model for exactly the others, sharing the job's p2p latency, speeds and memory unit; no virtual
stages. Op-level (`gap_and_span_failure`): no op runs at a stage its pipeline holds no layers of, and an
op runs on a worker whose own pipeline holds the same layers at that place (its span). Loads feed a
pipeline's first and last held stage (`edge_slots`); transfers go to the next (previous) held stage, over
any gap (`reach`, read by `check_transfers`); a worker passes its ALLREDUCE when each of its segments'
collectives can run, in the one global layer order (`segments_passed`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from schedcomp.costs import CostModel
from schedcomp.errors import PlanFormatError
from schedcomp.limits import MAX_COST
from schedcomp.partition import spans
from schedcomp.partitions import (
    Reach,
    are_layer_times,
    as_partitions,
    held_ends,
    held_stages,
    neighbours,
    reach,
    segments,
    segments_by_holder,
    span_of,
)
from schedcomp.topology import Worker

if TYPE_CHECKING:
    from numpy.typing import NDArray


def reformed_rules(checker: Any) -> Reach:
    """Fail (through `checker.fail`) where the plan's partitions or per-pipeline costs are not sound; return
    each pipeline's neighbour tables."""
    plan, topo = checker.plan, checker.plan.topology
    fail = checker.fail
    if plan.partitions is None:
        fail(None, None, "plan.pipeline_costs without plan.partitions: per-pipeline cost models come with "
                         "per-pipeline partitions (drop them, or give the partitions)")
    if topo.chunks > 1:
        fail(None, None, "per-pipeline partitions with virtual stages are not composed yet: give one chunk per worker")
    try:
        partitions = as_partitions(plan.partitions, topo.dp, topo.pp, topo.failed, "plan.partitions")
    except PlanFormatError as exc:
        fail(None, None, str(exc))
    if plan.partition is None:
        fail(None, None, "a plan with per-pipeline partitions names plan.partition, the partition of the pipelines "
                         "that keep it (the job's)")
    if sum(plan.partition) != sum(partitions[0]):
        fail(None, None, f"plan.partition holds {sum(plan.partition)} layers but plan.partitions hold "
                         f"{sum(partitions[0])}: every pipeline holds the whole model")
    if not isinstance(plan.pipeline_costs, Mapping):
        fail(None, None, f"plan.pipeline_costs must map pipelines to CostModels (a dict), got "
                         f"{type(plan.pipeline_costs).__name__}")
    for d, own in enumerate(partitions):
        has = d in plan.pipeline_costs
        if (own != tuple(plan.partition)) != has:
            why = ("has its own partition but no cost model in plan.pipeline_costs: give the stage costs of its "
                   "partition" if not has else "keeps plan.partition but has a cost model in plan.pipeline_costs: "
                   "drop it (plan.costs serves it)")
            fail(None, None, f"pipeline {d} {why}")
    layers = plan.layer_allreduce
    if not (isinstance(layers, tuple) and len(layers) == sum(partitions[0]) and are_layer_times(layers)):
        got = (type(layers).__name__ if not isinstance(layers, tuple) else f"{len(layers)} values"
               if len(layers) != sum(partitions[0]) else "a value outside that range")
        fail(None, None, f"plan.layer_allreduce must give one time from 0 to {MAX_COST:g} per layer (a tuple of "
                         f"{sum(partitions[0])}), got {got}: a segment's all-reduce sums its layers'")
    base = plan.costs
    for d, costs in sorted(plan.pipeline_costs.items(), key=lambda item: str(item[0])):  # (keys of any type)
        if not (type(d) is int and 0 <= d < topo.dp) or not isinstance(costs, CostModel):
            fail(None, None, f"plan.pipeline_costs maps pipelines 0..{topo.dp - 1} to CostModels, got {d!r}: "
                             f"{type(costs).__name__}")
        if costs.pp != topo.pp:
            fail(None, None, f"the cost model of pipeline {d} has {costs.pp} stages but the topology has pp={topo.pp}")
        for name in ("p2p", "speed", "memory_unit"):
            if getattr(costs, name) != getattr(base, name):
                fail(None, None, f"the cost model of pipeline {d} has another {name} than plan.costs: the job's "
                                 "links, speeds and units are one")
        limit_problem = _limit_problem(costs, base, held_stages(partitions[d]))
        if limit_problem:
            fail(None, None, f"the cost model of pipeline {d} {limit_problem}")
    for d, own in enumerate(partitions):  # each stage's all-reduce is its layers' (what segments split)
        stage_allreduce = plan.costs_of(d).allreduce
        for s, span in enumerate(spans(own)):
            total = math.fsum(layers[i] for i in span)
            if abs(total - stage_allreduce[s]) > 1e-9 * max(1.0, abs(total)):
                fail(None, None, f"pipeline {d}'s stage {s} has allreduce {stage_allreduce[s]:g} but its layers' "
                                 f"plan.layer_allreduce sum to {total:g}: give the stage costs of the same layers")
    return reach(partitions)


def _limit_problem(own: CostModel, job: CostModel, held: tuple[int, ...]) -> str | None:
    """Why a re-formed pipeline's memory limits cannot come from the job's, or None. They come by the
    static-memory rule (`layers.moved_limit`: a place's limit plus the static memory it gave away minus what
    it took on); its live workers hold every layer between them, so at most the static memory their places
    held before comes back: their limits total at most the job's at those places. (The static memory per
    layer is not in the plan, so this bound is what `check` can prove; it stops a file lifting them.)"""
    if (own.memory_limit is None) != (job.memory_limit is None):
        return ("has no memory limit where plan.costs has one" if own.memory_limit is None else
                "has a memory limit where plan.costs has none") + ": a re-formed worker keeps its device's"
    if job.memory_limit is None:
        return None
    mine, theirs = (sum(c.limit_at(s) for s in held) for c in (own, job))  # (fsum raises past 1.8e308)
    if mine > theirs * (1 + 1e-9):
        return (f"has memory limits totalling {mine:g} over its live places, more than the {theirs:g} plan.costs "
                "gives them: re-forming moves static memory between them, it adds none (layers.moved_limit)")
    return None


def absent_slots(checker: Any) -> NDArray[np.bool_]:
    """Per slot, whether its pipeline holds no layers at its stage (no op may run it)."""
    plan = checker.plan
    held = np.array([[n > 0 for n in p] for p in plan.partitions], bool)  # (dp, stages)
    return np.repeat(~held, checker.mbs, axis=0).reshape(-1)


def gap_and_span_failure(checker: Any, f: NDArray[np.int64], b: NDArray[np.int64], w: NDArray[np.int64],
                         bw: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Fail at the first op that runs at a stage its pipeline holds no layers of, or on a worker whose
    pipeline holds other layers at that place (f, b, w, bw: per slot the packed places, -1 for none).
    Returns the absent slots (`absent_slots`): sound with no op."""
    plan, mbs, ns, pp = checker.plan, checker.mbs, checker.ns, checker.pp
    partitions = plan.partitions
    absent = absent_slots(checker)
    ran = (f >= 0) | (b >= 0) | (w >= 0) | (bw >= 0)
    bad = absent & ran
    if bad.any():
        slot = int(np.argmax(bad))
        d, _, s = checker.key_of(slot)
        at = next(int(x[slot]) for x in (f, b, w, bw) if x[slot] >= 0)
        checker.fail(*checker.where(at), f"pipeline {d} holds no layers at stage {s} (its partition "
                                         f"{list(partitions[d])}): a re-formed pipeline's ops run only at its "
                                         "live places")
    first = np.array([[span_of(p, s).start for s in range(ns)] for p in partitions], np.int64)
    count = np.array(partitions, np.int64)
    slots = np.flatnonzero(f >= 0)
    home = slots // (mbs * ns)
    stage = slots % ns
    runner = (f[slots] >> 32) // pp  # the pipeline of the worker running the slot
    same = (first[home, stage] == first[runner, stage]) & (count[home, stage] == count[runner, stage])
    if not same.all():
        k = int(np.argmin(same))
        d, s, x = int(home[k]), int(stage[k]), int(runner[k])
        mine, theirs = span_of(partitions[d], s), span_of(partitions[x], s)
        checker.fail(*checker.where(int(f[slots[k]])),
                     f"runs an op of pipeline {d} at stage {s} (layers {_layers(mine)}) on a worker of pipeline {x}, "
                     f"which holds layers {_layers(theirs)} there: an op runs only on a worker holding its layers")
    return absent


def _layers(span: range) -> str:
    return f"{span.start}..{span.stop - 1}" if span else "none"


def edge_slots(checker: Any) -> set[int]:
    """The slots whose F is loaded: each pipeline's first and last held stage, for every micro-batch."""
    mbs, ns = checker.mbs, checker.ns
    out: set[int] = set()
    for d, p in enumerate(checker.plan.partitions):
        first, last = held_ends(p)
        for m in range(mbs):
            base = (d * mbs + m) * ns
            out.update((base + first, base + last))
    return out


def steps(checker: Any, slot: NDArray[np.int64], stage: NDArray[np.int64],
          step: NDArray[np.int64]) -> NDArray[np.int64]:
    """Each transfer's stage offset to its other end, over gaps: `step` (+1 next, -1 previous) made the
    distance to the next (previous) held stage of the slot's pipeline (past the ends: out of range)."""
    nxt = np.array([r[0] for r in checker.reach], np.int64)  # (dp, stages)
    prv = np.array([r[1] for r in checker.reach], np.int64)
    d = np.clip(slot // (checker.mbs * checker.ns), 0, len(nxt) - 1)
    s = np.clip(stage, 0, checker.ns - 1)
    return np.where(step > 0, nxt[d, s] - s, np.where(step < 0, prv[d, s] - s, step))


def link_counts(checker: Any) -> int:
    """How many tensors cross a stage boundary in all: per (pipeline, micro-batch) two per held boundary."""
    plan = checker.plan
    return sum(2 * plan.cut.count(d, plan.microbatches) * (sum(1 for n in p if n) - 1)
               for d, p in enumerate(plan.partitions))


def has_neighbour(checker: Any, slot: int, forward: bool) -> bool:
    """Whether the slot's stage has a next (`forward`) or previous held stage in its pipeline."""
    d, _, s = checker.key_of(slot)
    nxt, prv = neighbours(checker.reach, d, s)
    return nxt < checker.ns if forward else prv >= 0


def segments_passed(plan: Any, arrived: set[Worker]) -> set[Worker]:
    """The workers that get through their ALLREDUCE when `arrived` are at theirs: each runs its segments'
    collectives in layer order, and a collective runs once every holder has reached it."""
    segs = segments(plan.partitions, plan.topology.failed)
    mine = segments_by_holder(segs)  # per worker, its segments' numbers in layer order
    done = dict.fromkeys(mine, 0)  # collectives done per worker
    for k, seg in enumerate(segs):  # the one global order
        if all(h in arrived and mine[h][done[h]] == k for h in seg.holders):
            for h in seg.holders:
                done[h] += 1
    return {w for w in arrived if w not in mine or done[w] == len(mine[w])}
