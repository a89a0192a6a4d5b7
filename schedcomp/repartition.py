"""Re-partition as well as re-route: move layer boundaries off stages that lost workers.

`repartition(topology, microbatches, layer_costs, job_partition, job_costs, ...)` is the door. A failed
worker's micro-batches are re-routed to its stage's live peers (`schedcomp.adaptive`, unchanged); in
addition every pipeline's layer boundaries move alike, so a stage's live workers still hold the same
layers and all-reduce as one group. Only each stage's costs change (`layers.stage_costs`), so the whole
adaptive machinery runs on the derived stage model.

Candidates:
- the min-max contiguous partition where stage s's load is its layers' F + B + W times dp over its live
  capacity (the sum of its live workers' speed factors), found exactly by bisecting on the bottleneck load
  over a feasibility test that keeps every layer each stage can start at (`_starts`, numpy: O(pp L log L)
  a test), under each stage's room for one micro-batch (`layers.moved_limit`); among the partitions at
  that load, the one nearest the continuous balance, so stages that are not the bottleneck stay even (the
  pipeline's fill and drain);
- the job's own partition;
- a partition at the optimum's load nearest the job's (fewer layers to move at a plan switch; it wins
  only on a tie or a better period, as any candidate);
- the `NEIGHBOURS` best of the optimum's neighbours (one boundary moved by one layer), ranked by the same
  load, to absorb the bubble's and the first and last stage's effects the load does not see.

Each is scheduled by the adaptive greedy solver under its memory limit with a small local-search budget,
and the best `FINALISTS` again with the caller's solver and time limit (CP-SAT on every candidate would
cost seconds each), the job's partition always among them, so a plan is never slower than re-routing
alone; the best period wins (ties: the job's partition, then fewer layers moved, then the
order above). Candidates that leave a stage no room for one micro-batch are skipped. Deterministic: the
inputs decide everything (budgets are amounts of work, not time).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from schedcomp.adaptive import greedy, recut_solution, solve
from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, RecoveryError, ScheduleError
from schedcomp.gcpause import paused_gc
from schedcomp.ir import Order
from schedcomp.layers import LayerCosts, stage_costs, static_of
from schedcomp.partition import Partition, stage_of_layer
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Topology, Worker

NEIGHBOURS = 4
"""Neighbours of the optimum scheduled besides it (the best by load)."""
SCREEN_POLISH_SECONDS = 0.1
"""Every candidate is first scheduled by the greedy solver with this local-search budget (nominal seconds,
a fixed amount of work: `adaptive.greedy`) ..."""
FINALISTS = 2
"""... and the best `FINALISTS` of them (and the job's partition) again with the caller's solver and time
limit."""
_TOL = 1e-9


@dataclass(frozen=True)
class Repartitioned:
    """The winning partition, its stage model (with its memory limit), order and provenance."""

    partition: Partition
    costs: CostModel
    order: Order
    period: float
    bound: float | None
    solver: str
    candidates: int
    feasible: int
    won: str
    """"optimum", "fewest-moves", "neighbour" or "job"."""

    def meta(self, job_partition: Partition) -> dict[str, object]:
        """What the plan's meta says of the search."""
        moved = layers_moved(job_partition, self.partition)
        return {"repartition": {"candidates": self.candidates, "feasible": self.feasible, "won": self.won,
                                "job_partition": list(job_partition), "layers_moved": moved}}


def repartition(topology: Topology, microbatches: int, layer_costs: LayerCosts, job_partition: Partition,
                job_costs: CostModel, *, solver: str = "auto", time_limit: float = 10.0, split: bool = True,
                synchronous: bool = False, recut: bool = False) -> Repartitioned:
    """The best of the candidate partitions for `topology`'s failures (see the module docstring).
    `job_costs` is the job's stage model with its resolved memory limit. `recut`: each finalist may also
    re-cut the failed workers' micro-batches (`adaptive.recut_solution`: kept only where faster), so the
    plan may both move layers and run pieces."""
    if topology.chunks > 1:
        raise ScheduleError("re-partitioning runs one stage per worker: drop --chunks or the layer costs")
    candidates = candidate_partitions(topology, layer_costs, job_partition, job_costs)
    screened = []
    with paused_gc():
        for i, (name, partition) in enumerate(candidates):
            try:
                costs = stage_costs(layer_costs, partition, limit_from=(job_costs, job_partition))
                problem = Problem(topology, microbatches, costs, split)
                problem.check_memory()
            except MemoryLimitError:
                continue  # no room for a micro-batch somewhere under this partition
            quick = greedy(problem, synchronous=synchronous, time_budget=SCREEN_POLISH_SECONDS)
            screened.append((_key(quick.period, partition, job_partition, i), name, partition, problem))
        if not screened:  # the job's partition is always a candidate: it fails only where compile would
            raise MemoryLimitError("no partition of the layers leaves every stage room for one micro-batch")
        screened.sort(key=lambda c: c[0])
        # The job's partition always goes on: with layers a plan is never slower than re-routing alone.
        finalists = screened[:FINALISTS] + [c for c in screened[FINALISTS:] if c[2] == job_partition]
        best: tuple[tuple[float, bool, int, int], Repartitioned] | None = None
        for (_, _, _, i), name, partition, problem in finalists:
            sol = (recut_solution(problem, solver, time_limit, synchronous) if recut else
                   solve(problem, solver=solver, time_limit=time_limit, synchronous=synchronous))
            key = _key(sol.period, partition, job_partition, i)
            if best is None or key < best[0]:
                best = key, Repartitioned(partition, problem.costs, sol.order(), sol.period,
                                          sol.bound if sol.bound > 0 else None, sol.solver, 0, 0, name)
    assert best is not None
    return dataclasses.replace(best[1], candidates=len(candidates), feasible=len(screened))


def _key(period: float, partition: Partition, job_partition: Partition, i: int) -> tuple[float, bool, int, int]:
    """Best period first; ties: the job's partition, then fewer layers moved, then the candidates' order."""
    return round(period, 9), partition != job_partition, layers_moved(job_partition, partition), i


def layers_moved(before: Partition, after: Partition) -> int:
    """How many layers change stage between two partitions."""
    return sum(a != b for a, b in zip(stage_of_layer(before), stage_of_layer(after), strict=True))


def candidate_partitions(topology: Topology, layer_costs: LayerCosts, job_partition: Partition,
                         job_costs: CostModel) -> list[tuple[str, Partition]]:
    """(name, partition) to schedule, distinct, in tie-break order: optimum, job, the optimum's load with the
    fewest layers moved, the optimum's best neighbours."""
    stages = topology.stages
    weights = stage_weights(topology, job_costs)
    c = layer_costs.costs
    work = [f + b + w for f, b, w in zip(c.forward, c.backward_input, c.backward_weight, strict=True)]
    memory, rooms = _memory_caps(layer_costs, job_partition, job_costs)
    optimum = min_max_partition(work, weights, memory, rooms)
    out = [("optimum", optimum)] if optimum is not None else []
    if job_partition != optimum:
        out.append(("job", job_partition))
    if optimum is None:
        return out
    fewest = min_max_partition(work, weights, memory, rooms, near=job_partition)
    if fewest is not None and fewest not in (optimum, job_partition):
        out.append(("fewest-moves", fewest))
    seen = {p for _, p in out}
    near = []
    for s in range(stages - 1):
        for step in (-1, 1):
            moved = list(optimum)
            moved[s] += step
            moved[s + 1] -= step
            p = tuple(moved)
            if min(p) >= 1 and p not in seen and fits_memory(p, memory, rooms):
                near.append((max_load(p, work, weights), s, step, p))
    near.sort()
    out += [("neighbour", p) for *_, p in near[:NEIGHBOURS]]
    return out


def stage_weights(topology: Topology, costs: CostModel) -> list[float]:
    """dp over each stage's live capacity (the sum of its live workers' speed factors): what one unit of
    a stage's per-micro-batch work costs its busiest worker, relatively."""
    out = []
    for s in range(topology.stages):
        cap = sum(costs.speed.get(Worker(d, s), 1.0) for d in range(topology.dp) if Worker(d, s) not in topology.failed)
        if cap <= 0:
            raise RecoveryError(f"every worker of stage {s} has failed, so its layers cannot move nor its "
                                "micro-batches be re-routed: recovery needs a checkpoint (restart from the last one)")
        out.append(topology.dp / cap)
    return out


def max_load(partition: Partition, work: Sequence[float], weights: Sequence[float]) -> float:
    """The bottleneck: max over stages of the stage's work times its weight."""
    out, start = 0.0, 0
    for s, n in enumerate(partition):
        out = max(out, math.fsum(work[start:start + n]) * weights[s])
        start += n
    return out


def _memory_caps(layer_costs: LayerCosts, job_partition: Partition,
                 job_costs: CostModel) -> tuple[list[float], list[float]]:
    """Per layer, the memory one micro-batch and its weights hold (activation + static); per stage, the
    device's room for them (its activation limit + its static memory under the job's partition)."""
    c = layer_costs.costs
    memory = [a + s for a, s in zip(c.activation, layer_costs.static, strict=True)]
    held = static_of(layer_costs, job_partition)
    rooms = [job_costs.limit_at(s) + held[s] for s in range(len(job_partition))]
    return memory, rooms


def fits_memory(partition: Partition, memory: Sequence[float], rooms: Sequence[float]) -> bool:
    start = 0
    for s, n in enumerate(partition):
        if math.fsum(memory[start:start + n]) > rooms[s] * (1 + _TOL):
            return False
        start += n
    return True


def live_partition(layers: LayerCosts, speed: Mapping[Worker, float], pipeline: int,
                   live: Sequence[int]) -> Partition:
    """The layers of a pipeline re-formed over its `live` places: the min-max contiguous partition of their
    F + B + W, each place weighted by its worker's speed (no memory rooms given, so one always exists)."""
    c = layers.costs
    work = [f + b + w for f, b, w in zip(c.forward, c.backward_input, c.backward_weight, strict=True)]
    found = min_max_partition(work, [1.0 / speed.get(Worker(pipeline, s), 1.0) for s in live])
    assert found is not None
    return found


def min_max_partition(work: Sequence[float], weights: Sequence[float], memory: Sequence[float] | None = None,
                      rooms: Sequence[float] | None = None, near: Partition | None = None) -> Partition | None:
    """The contiguous partition of the layers (each stage at least one) minimising the largest
    `work`-sum x `weights[s]`, each stage's `memory`-sum within `rooms[s]`; among the partitions at that
    load, the one whose boundaries lie nearest the continuous balance, or with `near` nearest that
    partition's (fewer layers to move). None when no partition fits the memory. Exact: bisection on the
    load over an exact feasibility test (`_starts`)."""
    layers, stages = len(work), len(weights)
    if layers < stages:
        raise ScheduleError(f"{layers} layers cannot fill {stages} stages: give at least one layer per stage")
    cum_work = np.concatenate(([0.0], np.cumsum(np.asarray(work, dtype=np.float64))))
    cum_mem = np.concatenate(([0.0], np.cumsum(np.asarray(memory if memory is not None else [0.0] * layers,
                                                          dtype=np.float64))))
    rooms = list(rooms) if rooms is not None else [math.inf] * stages
    if _starts(math.inf, cum_work, weights, cum_mem, rooms) is None:
        return None
    lo, hi = 0.0, max(weights) * float(cum_work[-1]) * 2 + 1e-300
    for _ in range(200):  # bisection on the bottleneck load; float resolution ends it well before
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        if _starts(mid, cum_work, weights, cum_mem, rooms) is None:
            lo = mid
        else:
            hi = mid
    starts = _starts(hi, cum_work, weights, cum_mem, rooms)
    assert starts is not None
    # Back from the last layer, each stage's start nearest its goal among the feasible ones: the continuous
    # balance (in work), or `near`'s boundary (in layers).
    if near is None:
        shares = [1.0 / w for w in weights]
        level = float(cum_work[-1]) / sum(shares)
        goals, scale = [0.0, *accumulate(share * level for share in shares)], cum_work
    else:
        goals, scale = [0.0, *accumulate(float(n) for n in near)], np.arange(layers + 1, dtype=np.float64)
    end, bounds = layers, [layers]
    for s in range(stages - 1, 0, -1):
        reach = _reach(hi, s, cum_work, weights, cum_mem, rooms)
        ok = np.nonzero(starts[s][:end] & (reach[:end] >= end))[0]
        end = int(ok[np.argmin(np.abs(scale[ok] - goals[s]))])  # (ties: the first, the earlier)
        bounds.append(end)
    bounds.append(0)
    bounds.reverse()
    return tuple(bounds[i + 1] - bounds[i] for i in range(stages))


def _cap(value: float) -> float:
    return value * (1 + _TOL) + 1e-300


def _reach(load: float, stage: int, cum_work: np.ndarray, weights: Sequence[float], cum_mem: np.ndarray,
           rooms: Sequence[float]) -> np.ndarray:
    """For each start layer i, the furthest end (exclusive) of `stage` starting there within `load` and the
    stage's room (below i + 1 when not even layer i fits)."""
    end = np.searchsorted(cum_work, cum_work[:-1] + _cap(load / weights[stage]), side="right") - 1
    if math.isfinite(rooms[stage]):
        end = np.minimum(end, np.searchsorted(cum_mem, cum_mem[:-1] + _cap(rooms[stage]), side="right") - 1)
    return end


def _starts(load: float, cum_work: np.ndarray, weights: Sequence[float], cum_mem: np.ndarray,
            rooms: Sequence[float]) -> list[np.ndarray] | None:
    """Per stage, which layers it can start at with every stage before it within `load` (a boolean
    array over positions 0..L); None when the last stage cannot end at the last layer. Exact: a stage
    starting at i can end anywhere in [i + 1, reach(i)], so each stage's starts are a union of intervals
    (a greedy that takes as much as fits is not: a later stage may then be left one layer too heavy)."""
    layers = len(cum_work) - 1
    first = np.zeros(layers + 1, dtype=bool)
    first[0] = True
    out = [first]
    for s in range(len(weights)):
        reach = _reach(load, s, cum_work, weights, cum_mem, rooms)
        at = np.nonzero(out[-1][:-1] & (reach >= np.arange(1, layers + 1)))[0]
        if at.size == 0:
            return None
        cover = np.bincount(at + 1, minlength=layers + 2)[:layers + 2] - np.bincount(reach[at] + 1,
                                                                                   minlength=layers + 2)
        out.append(np.cumsum(cover)[:layers + 1] > 0)
    return out if out[-1][layers] else None
