"""A plan as a networkx graph (`Plan.to_networkx()`), and its critical path.

Nodes are instructions, named (worker, index), with the instruction and its duration (the cost
model's, by the semantics table's `cost`) as attributes. Edges are stream order (`via="stream"`:
from the latest blocking instruction before each one, as sends and receives do not block),
each send to its receive (`via="transfer"`, weighted by the p2p latency) and each receive to the
compute op that consumes it (`via="input"`); the pairs come from the plan's `PlanIndex`. One
iteration, so the graph of a valid plan is a DAG; the stage's ALLREDUCE is a node per worker
(the collective couples them: `critical_path` adds that by edges between a stage's ALLREDUCEs).
"""

from __future__ import annotations

import itertools
from typing import Any

import networkx as nx

from schedcomp.errors import ScheduleError
from schedcomp.ir import Instruction, Plan
from schedcomp.planindex import plan_index
from schedcomp.semantics import ALLREDUCE_COST, COMPUTE, OPTIMIZER, RECV, SEND, semantics_of
from schedcomp.topology import Worker

Node = tuple[Worker, int]


def duration(plan: Plan, worker: Worker, ins: Instruction) -> float:
    """How long `ins` takes on `worker` under the plan's cost model (0 for what takes no time)."""
    cost, costs = semantics_of(ins.kind).cost, plan.costs_of(worker.pipeline)
    if cost == COMPUTE:
        op = ins.op
        base = costs.compute_time(ins.kind.value, worker, None if op is None else op.stage)
        return base * plan.cut.size(op.pipeline, op.microbatch) if plan.cut and op is not None else base
    held = plan.topology.chunks_of(worker.stage)  # one ALLREDUCE and STEP per worker cover all its chunks
    if cost == OPTIMIZER:
        return costs.optimizer_of(held) / costs.speed.get(worker, 1.0)
    if cost == ALLREDUCE_COST:
        return costs.allreduce_of(held) if len(plan.topology.stage_group(worker.stage)) > 1 else 0.0
    return 0.0


def to_networkx(plan: Plan) -> nx.DiGraph:
    """One iteration of `plan` as a directed graph (see the module docstring); validates it first."""
    index = plan_index(plan)
    g = nx.DiGraph()
    for w in plan.workers:
        last = -1  # the latest blocking instruction: the stream only waits for those
        for i, ins in enumerate(plan.streams[w]):
            g.add_node((w, i), instruction=ins, duration=duration(plan, w, ins))
            if last >= 0:
                g.add_edge((w, last), (w, i), via="stream", latency=0.0)
            if semantics_of(ins.kind).blocking:
                last = i
    for w in plan.workers:
        for i, ins in enumerate(plan.streams[w]):
            direction = semantics_of(ins.kind).direction
            if direction == SEND:
                g.add_edge((w, i), index.peer_of(w, i), via="transfer", latency=plan.costs.p2p)
            elif direction == RECV:
                g.add_edge((w, i), (w, index.consumer(w, i)), via="input", latency=0.0)
    return g


def critical_path(plan: Plan) -> tuple[float, tuple[Node, ...]]:
    """The longest chain of one iteration (durations plus latencies) and its nodes, in order.

    A send is posted when its producer ends, and each stage's ALLREDUCE waits for the group's
    latest member: modelled by edges from every member's instruction before ALLREDUCE to each
    member's ALLREDUCE. Plans with re-formed pipelines are refused: their ALLREDUCE is a chain of
    collectives over segments (`schedcomp.partitions`), one node here; `simulate` times them."""
    if plan.partitions is not None:
        raise ScheduleError("critical_path models one collective per stage group; this plan has re-formed pipelines "
                            "(an all-reduce per segment): use simulate(plan) for its timing")
    g = to_networkx(plan)
    reduce = {w: (w, len(plan.streams[w]) - 2) for w in plan.workers}  # `check`: ALLREDUCE, STEP end a stream
    before = {w: [u for u in g.predecessors(node) if g.edges[u, node]["via"] == "stream"] for w, node in reduce.items()}
    for w in plan.workers:
        for v in plan.workers:
            if v != w and v.stage == w.stage:
                for u in before[v]:
                    g.add_edge(u, reduce[w], via="collective", latency=0.0)
    weight: dict[Any, float] = {}
    for a, b, data in g.edges(data=True):
        weight[(a, b)] = g.nodes[a]["duration"] + data["latency"]
    nx.set_edge_attributes(g, weight, "weight")
    path = nx.dag_longest_path(g, weight="weight")
    length = sum(weight[(a, b)] for a, b in itertools.pairwise(path)) + (g.nodes[path[-1]]["duration"]
                                                                                  if path else 0.0)
    return length, tuple(path)
