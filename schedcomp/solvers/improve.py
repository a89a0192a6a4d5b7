"""Local search on per-worker op sequences, scored by the steady-state period.

The list scheduler decides one iteration at a time and cannot see that, with a staggered optimizer,
the time a stage needs between its last backward and its step is taken from the next iteration of the
stages below it. This pass fixes what that costs, by moves that keep every slot's F -> B -> W order:

- move a W to another place after its B (into a bubble, or out of the critical tail);
- swap two neighbouring ops of different slots (change the F/B interleaving, the warm-up depth);
- move a re-routed slot (its F, B and W together) to another live worker of its stage;

keeping a move when the period (then the one-iteration makespan) does not get worse and memory stays
within the limit. Moves are drawn from a seeded generator and the search stops on a *work* budget (op
evaluations of the timer), never on the clock, so every rank compiling the same job gets the same
schedule however loaded its machine is. The evaluator here is the timing core's plain-Python worklist
(`schedcomp.timecore.run_lanes`), faster than the numpy levels of `timing.time_sequences` on small schedules.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from schedcomp.memory import stage_deltas
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import op_dependencies
from schedcomp.timecore import Graph, run_lanes
from schedcomp.timeline import period_from_ends

OP_STEPS_PER_SECOND = 1_500_000
"""Nominal speed of `FastTimer.score` (ops timed per second, measured on the 2-core dev machine): turns a
budget given in seconds into a deterministic amount of work. A slower machine takes longer, never
returns a different schedule."""


def work_of(seconds: float) -> int:
    """The deterministic work budget (timed ops) standing for `seconds` of local search."""
    return max(0, int(seconds * OP_STEPS_PER_SECOND))


class FastTimer:
    """Times op sequences like `timing.time_sequences`, on the timing core's worklist engine
    (`schedcomp.timecore.run_lanes`): the graph is built once, each `score` only lays out the lanes."""

    def __init__(self, problem: Problem, iterations: int = 4, synchronous: bool = False) -> None:
        self.problem = problem
        self.iterations = iterations
        self.synchronous = synchronous
        pp, stages, nk, costs = problem.pp, problem.stages, len(problem.kinds), problem.costs
        self.nk = nk
        snk = stages * nk  # op % snk = stage * nk + kind: the key of a worker's op times
        n_ops = problem.n_slots * nk
        self.n_ops = n_ops
        self.n_present = problem.n_present * nk  # ops that exist (a re-cut leaves some slot ids absent)
        self.live = [problem.worker_id(w) for w in problem.topology.live_workers]
        # Nodes: the ops, then each live worker's all-reduce (over its place) and step.
        tails = {wid: (n_ops + 2 * i, n_ops + 2 * i + 1) for i, wid in enumerate(self.live)}
        meetings = {p: tuple(tails[wid][0] for wid in self.live if wid % pp == p) for p in range(pp)}
        op_pred, op_lat = op_dependencies(problem)
        preds = [tuple((p, lat) for p, lat in zip(ps, ls, strict=True) if p >= 0)
                 for ps, ls in zip(op_pred.tolist(), op_lat.tolist(), strict=True)]
        members: list[tuple[int, ...]] = [()] * n_ops
        for wid in self.live:
            preds += [(), ()]
            members += [meetings[wid % pp], ()]
        self.graph = Graph(preds, members)
        self.tails = [tails[wid] for wid in self.live]
        # Each node's duration on each worker (a list per worker, indexed by node: the core's hot path);
        # op % snk is its (virtual) stage and kind.
        self.durations = []
        for wid in self.live:
            per_stage_kind = problem.op_times[wid]
            tail = [problem.allreduce_times[wid % pp], problem.step_time(wid)] * len(self.live)
            self.durations.append([per_stage_kind[op % snk] for op in range(n_ops)] + tail)
        deltas = [[d[k] for k in problem.kinds] for d in (stage_deltas(costs, s) for s in range(stages))]
        self.delta = [deltas[(op // nk) % stages][op % nk] for op in range(n_ops)]
        sizes = problem.slot_sizes  # re-cut micro-batches: time and activation scale with the size
        if sizes is not None:
            for row in self.durations:
                row[:n_ops] = [d * sizes[op // nk] for op, d in enumerate(row[:n_ops])]
            self.delta = [d * sizes[op // nk] for op, d in enumerate(self.delta)]
        self.limits = {wid: problem.limit_of(wid) * (1 + 1e-9) + 1e-12 for wid in self.live}

    def memory_ok(self, wid: int, seq: Sequence[int]) -> bool:
        """Whether worker `wid` running `seq` stays within its stage's memory limit."""
        held, delta, limit = 0.0, self.delta, self.limits[wid]
        for op in seq:
            held += delta[op]
            if held > limit:
                return False
        return True

    def score(self, seqs: Mapping[int, Sequence[int]]) -> tuple[float, float]:
        """(period, makespan); (inf, inf) when the sequences deadlock."""
        lanes = [(*seqs.get(wid, ()), *tail) for wid, tail in zip(self.live, self.tails, strict=True)]
        if sum(map(len, lanes)) != self.n_present + 2 * len(lanes):
            return math.inf, math.inf
        run = run_lanes(self.graph, lanes, self.durations, self.iterations, self.synchronous)
        if run.stuck is not None:
            return math.inf, math.inf
        return period_from_ends(run.iteration_ends), run.iteration_ends[0]


def improve(
    problem: Problem,
    seqs: Mapping[int, Sequence[int]],
    *,
    time_budget: float = 1.0,
    work: int | None = None,
    max_moves: int = 4000,
    seed: int = 0,
    iterations: int = 4,
    synchronous: bool = False,
    bound: float = 0.0,
    patience: int = 2000,
) -> tuple[dict[int, list[int]], tuple[float, float]]:
    """Hill-climb from `seqs` for at most `work` timed ops (default `work_of(time_budget)`: the work
    `time_budget` seconds stand for on the reference machine, not a clock) or `max_moves` tries,
    stopping early at the lower bound `bound` or after `patience` tries without a strict gain; returns
    the best sequences and their (period, makespan). Deterministic for given inputs and `seed`."""
    timer = FastTimer(problem, iterations, synchronous)
    rng = random.Random(seed)
    cur = {w: list(v) for w, v in seqs.items()}
    best = timer.score(cur)
    nk = timer.nk
    workers = [w for w in timer.live if cur.get(w)]
    peers = {s: [problem.worker_id(w) for w in group] for s, group in enumerate(problem.survivors)}
    place = [problem.place[slot % problem.stages] for slot in range(problem.n_slots)]
    orphans = [slot for group in problem.orphan_slots for slot in group if len(peers[place[slot]]) > 1]
    where = {op // nk: w for w, ops in cur.items() for op in ops}
    budget = work_of(time_budget) if work is None else work
    cost = timer.n_ops * iterations  # ops timed by one `score`
    spent = cost
    moves = ["w", "swap", "swap"] + (["reroute"] if orphans else [])
    last_gain = 0
    for tries in range(max_moves):
        if best[0] <= bound * (1 + 1e-9) or tries - last_gain > patience:
            break
        if spent + cost > budget:
            break  # out of work (a count, not the clock: the result must not depend on machine speed)
        kind = rng.choice(moves)
        if kind == "reroute":
            slot = rng.choice(orphans)
            src = where[slot]
            dst = rng.choice([p for p in peers[place[slot]] if p != src])
            old_src, old_dst = cur[src], cur[dst]
            mine = [op for op in old_src if op // nk == slot]
            pos = [i / max(1, len(old_src)) for i, op in enumerate(old_src) if op // nk == slot]
            new_src = [op for op in old_src if op // nk != slot]
            new_dst = list(old_dst)
            for frac, op in zip(pos, mine, strict=True):
                idx = min(len(new_dst), round(frac * (len(old_dst) + len(mine))))
                new_dst.insert(idx, op)
            _fix_slot_order(new_dst, slot, nk)
            if not timer.memory_ok(dst, new_dst):
                continue
            cur[src], cur[dst] = new_src, new_dst
            spent += cost
            score = timer.score(cur)
            if score <= best:
                last_gain = tries if score < best else last_gain
                best = score
                where[slot] = dst
            else:
                cur[src], cur[dst] = old_src, old_dst
            continue
        w = rng.choice(workers)
        seq = cur[w]
        if kind == "w":
            if nk != 3:
                continue
            ws = [i for i, op in enumerate(seq) if op % nk == 2]
            i = rng.choice(ws)
            op = seq[i]
            b = seq.index(op - 1)
            new = seq[:i] + seq[i + 1:]
            j = rng.randrange(b + 1, len(seq))
            if j == i:
                continue
            new.insert(j, op)
        else:
            i = rng.randrange(len(seq) - 1)
            if seq[i] // nk == seq[i + 1] // nk:
                continue
            new = list(seq)
            new[i], new[i + 1] = new[i + 1], new[i]
        if not timer.memory_ok(w, new):
            continue
        cur[w] = new
        spent += cost
        score = timer.score(cur)
        if score <= best:
            last_gain = tries if score < best else last_gain
            best = score
        else:
            cur[w] = seq
    return cur, best


def _fix_slot_order(seq: list[int], slot: int, nk: int) -> None:
    """Reorder the ops of `slot` inside `seq` (in place) to F, B, W at the positions they occupy."""
    idx = [i for i, op in enumerate(seq) if op // nk == slot]
    for k, i in enumerate(idx):
        seq[i] = slot * nk + k
