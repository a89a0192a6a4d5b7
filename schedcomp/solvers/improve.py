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
schedule however loaded its machine is. The evaluator here is a plain-Python event loop that is faster
than `timing.time_sequences` on small schedules.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from schedcomp.memory import stage_deltas
from schedcomp.solvers.problem import Problem
from schedcomp.timeline import period_from_ends

OP_STEPS_PER_SECOND = 1_500_000
"""Nominal speed of `FastTimer.score` (ops timed per second, measured on the 2-core dev machine): turns a
budget given in seconds into a deterministic amount of work. A slower machine takes longer, never
returns a different schedule."""


def work_of(seconds: float) -> int:
    """The deterministic work budget (timed ops) standing for `seconds` of local search."""
    return max(0, int(seconds * OP_STEPS_PER_SECOND))


class FastTimer:
    """Times op sequences like `timing.time_sequences`, with the per-op data computed once."""

    def __init__(self, problem: Problem, iterations: int = 4, synchronous: bool = False) -> None:
        self.problem = problem
        self.iterations = iterations
        self.synchronous = synchronous
        stages, nk, costs = problem.stages, len(problem.kinds), problem.costs
        self.nk = nk
        self.snk = stages * nk  # op % snk = stage * nk + kind: the key of a worker's op times
        n_ops = problem.n_slots * nk
        self.n_ops = n_ops
        self.pred1 = [-1] * n_ops
        self.lat1 = [0.0] * n_ops
        self.pred2 = [-1] * n_ops
        self.lat2 = [0.0] * n_ops
        for op in range(n_ops):
            slot, k = divmod(op, nk)
            s = slot % stages
            if k == 0:
                if s > 0:
                    self.pred1[op], self.lat1[op] = (slot - 1) * nk, costs.p2p
            elif k == 1:
                self.pred1[op] = slot * nk
                if s < stages - 1:
                    self.pred2[op], self.lat2[op] = (slot + 1) * nk + 1, costs.p2p
            else:
                self.pred1[op] = slot * nk + 1
        self.live = [problem.worker_id(w) for w in problem.topology.live_workers]
        self.dur = {wid: [t for row in problem.durations(wid) for t in row] for wid in self.live}
        self.allreduce = problem.allreduce_times
        self.step = {wid: problem.step_time(wid) for wid in self.live}
        deltas = [[d[k] for k in problem.kinds] for d in (stage_deltas(costs, s) for s in range(stages))]
        self.delta = [deltas[(op // nk) % stages][op % nk] for op in range(n_ops)]
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
        pp, snk = self.problem.pp, self.snk
        pred1, pred2, lat1, lat2 = self.pred1, self.pred2, self.lat1, self.lat2
        done = [-1] * self.n_ops
        endt = [0.0] * self.n_ops
        who = [-1] * self.n_ops  # the worker that ran each op: a hand-off on one worker has no latency
        base = dict.fromkeys(self.live, 0.0)
        ends: list[float] = []
        total = sum(len(seqs.get(w, ())) for w in self.live)
        if total != self.n_ops:
            return math.inf, math.inf
        for it in range(self.iterations):
            ptr = dict.fromkeys(self.live, 0)
            free = dict(base)
            waiting: dict[int, list[int]] = {}
            stack = list(self.live)
            finished = 0
            while stack:
                w = stack.pop()
                seq = seqs.get(w, ())
                i, t, dur = ptr[w], free[w], self.dur[w]
                n = len(seq)
                while i < n:
                    op = seq[i]
                    p = pred1[op]
                    if p >= 0:
                        if done[p] != it:
                            waiting.setdefault(p, []).append(w)
                            break
                        a = endt[p] + lat1[op] if who[p] != w else endt[p]
                        if a > t:
                            t = a
                        p = pred2[op]
                        if p >= 0:
                            if done[p] != it:
                                waiting.setdefault(p, []).append(w)
                                break
                            a = endt[p] + lat2[op] if who[p] != w else endt[p]
                            if a > t:
                                t = a
                    t += dur[op % snk]
                    endt[op] = t
                    who[op] = w
                    done[op] = it
                    finished += 1
                    i += 1
                    woken = waiting.pop(op, None)
                    if woken:
                        stack.extend(woken)
                ptr[w], free[w] = i, t
            if finished != self.n_ops:
                return math.inf, math.inf
            arrive = [0.0] * pp
            for w in self.live:
                s = w % pp
                if free[w] > arrive[s]:
                    arrive[s] = free[w]
            for w in self.live:
                s = w % pp
                base[w] = arrive[s] + self.allreduce[s] + self.step[w]
            barrier = max(max(base.values()), ends[-1] if ends else 0.0)
            ends.append(barrier)
            if self.synchronous:
                base = dict.fromkeys(self.live, barrier)
        return period_from_ends(ends), ends[0]


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
