"""An exact / anytime model of the problem in OR-tools CP-SAT.

- one interval per op; a re-routed slot gets one optional interval per live peer of its stage, sharing
  the op's start and end, with one presence literal per (slot, peer) and exactly one peer chosen, so
  F, B and W of a slot land on the same worker;
- no-overlap per worker; precedences with the p2p latency between workers (F -> F downstream,
  F -> B, B -> B upstream, B -> W);
- activation memory as a cumulative resource per worker: the part of an F's activation that its B
  frees is held from the F's start to the B's end, the rest from the F's start to the W's end (all of
  it to a fused BW's end), at most the memory limit at any time; since a worker runs one op at a
  time this is exactly the memory of its stream order (a reservoir constraint says the same but its
  presolve grows quadratically with the ops per worker);
- objective "period": a periodic (modulo) schedule. One iteration occupies [first_w, last_w] on
  worker w; the stage's all-reduce starts once all its live workers are done, then each steps; the next
  iteration, shifted by the period P, may start on w only after its own stage's step (staggered) or
  after every stage's step (synchronous). min P is the steady-state period, and the best bound CP-SAT
  proves is a lower bound on the period of every schedule. Objective "makespan": one iteration.
- symmetry breaking: micro-batches of one pipeline are interchangeable, so their stage-0 forwards are
  taken in order (not in a re-cut pipeline, whose pieces differ in size).
- re-cut micro-batches (`schedcomp.cut`): a piece's ops take their stage's time times its size and hold
  its activation times its size; slots past a pipeline's piece count are absent (no interval); a piece
  pinned to a peer (`Problem.routing`, sized for it by `schedcomp.recut`) runs there.

Times are scaled to integers. Where they are not exact at a small scale the durations are rounded
down, so the proven bound stays a valid bound (the solution's order is re-timed exactly afterwards);
memory must scale exactly for the bound to be claimed under a memory limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ortools.sat.python import cp_model

from schedcomp.solvers.bounds import lower_bound
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import Timing

_SCALES = (1, 2, 4, 5, 8, 10, 16, 20, 25, 40, 50, 100, 200, 250, 500, 1000)
DETERMINISTIC_PER_SECOND = 0.4
"""CP-SAT's deterministic time units per nominal second of `time_limit`, measured with one worker on the
2-core dev machine (one unit took about 2.3 s of CPU there), so a `time_limit` of T stops after about T
seconds on that machine, and after the same search, with the same answer, on any other."""
WALL_FACTOR = 10.0
WALL_SLACK = 60.0
"""The search stops after `time_limit * DETERMINISTIC_PER_SECOND` units of CP-SAT's deterministic time,
so its answer is the same on every machine (with one worker and a fixed seed). The wall-clock limit,
`WALL_FACTOR * time_limit + WALL_SLACK` seconds, is only a safety net against a pathological stall: it
is far above what the deterministic limit takes even on a loaded machine, so it is not reached in
normal conditions and cannot change the answer there."""
OBJECTIVES = ("period", "makespan")


@dataclass(frozen=True)
class CpResult:
    """`seqs`: per-worker op ids (None when no solution was found); `bound`: a proven lower bound on the
    objective in cost-model units (0.0 when none could be claimed); `value`: the model's objective for
    `seqs`; `optimal`: CP-SAT proved `value` optimal."""

    seqs: dict[int, list[int]] | None
    bound: float
    value: float | None
    optimal: bool
    status: str


def _scale(values: Iterable[float]) -> tuple[int, bool]:
    """The smallest scale making every value an integer, or (1000, False) when there is none.

    Beyond the round scales, the least common multiple of the values' denominators as fractions (up to
    `_MAX_SCALE`): re-cut pieces are sevenths or elevenths of a micro-batch, exact only at such scales."""
    vals = list(values)
    for sc in _SCALES:
        if _exact(vals, sc):
            return sc, True
    lcm = 1
    for v in vals:
        lcm = math.lcm(lcm, Fraction(v).limit_denominator(_MAX_SCALE).denominator)
        if lcm > _MAX_SCALE:
            return _SCALES[-1], False
    return (lcm, True) if _exact(vals, lcm) else (_SCALES[-1], False)


_MAX_SCALE = 10_000


def _exact(values: list[float], scale: int) -> bool:
    return all(abs(v * scale - round(v * scale)) <= 1e-9 * max(1.0, abs(v * scale)) for v in values)


def solve_cpsat(
    problem: Problem,
    *,
    time_limit: float = 10.0,
    hint: Mapping[int, Sequence[int]] | None = None,
    hint_timing: Timing | None = None,
    objective: str = "period",
    synchronous: bool = False,
    num_workers: int = 1,
    seed: int = 0,
) -> CpResult:
    """Solve `problem` with CP-SAT within `time_limit` nominal seconds, counted in deterministic time
    (see `DETERMINISTIC_PER_SECOND`; reproducible when `num_workers` is 1), warm-started from `hint` (op sequences)
    and `hint_timing` (their timing, whose last iteration gives the hinted start times)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    pp, nk, costs = problem.pp, len(problem.kinds), problem.costs
    live = [problem.worker_id(w) for w in problem.topology.live_workers]
    allreduce = problem.allreduce_times
    steps = {wid: problem.step_time(wid) for wid in live}
    durs = {wid: [problem.duration(k, problem.worker_of(wid)) for k in problem.kinds] for wid in live}
    sizes = problem.slot_sizes  # None: every micro-batch whole
    present = [problem.slot_key(slot)[1] < problem.count(problem.slot_key(slot)[0]) for slot in range(problem.n_slots)]
    distinct = sorted(set(sizes)) if sizes is not None else [1.0]
    tscale, t_exact = _scale([costs.p2p, *allreduce, *steps.values(),
                              *(v * x for row in durs.values() for v in row for x in distinct)])

    def ticks(v: float) -> int:
        return math.floor(v * tscale + 1e-9)  # rounding down keeps the proven bound valid

    p2p = ticks(costs.p2p)
    idur_of = {x: {wid: [ticks(v * x) for v in row] for wid, row in durs.items()} for x in distinct}
    iar = [ticks(v) for v in allreduce]
    isteps = {wid: ticks(v) for wid, v in steps.items()}
    slot_max = {(s, x): sum(max(idur_of[x][problem.worker_id(w)][k] for w in problem.survivors[s]) for k in range(nk))
                for s in range(pp) for x in distinct}
    horizon = sum(slot_max[problem.slot_key(slot)[2], _size(sizes, slot)]
                  for slot in range(problem.n_slots) if present[slot])
    horizon += (2 * problem.n_slots + 1) * p2p + sum(iar) + max(isteps.values()) + 1

    limit = costs.memory_limit
    mem_exact = True
    frees: list[list[int]] = []
    ilimits: list[int] = []
    if limit is not None:
        fracs = [[costs.memory_delta(k.value, s) for k in problem.kinds] for s in range(pp)]
        mscale, mem_exact = _scale([*costs.stage_limits, *(abs(v) * x for row in fracs for v in row for x in distinct)])
        # Inexact memory is rounded against us (held amounts up), keeping solutions valid.
        frees_of = {x: [[math.ceil(-v * x * mscale - 1e-9) if v < 0 else 0 for v in row] for row in fracs]
                    for x in distinct}
        ilimits = [math.floor(lim * mscale + 1e-9) for lim in costs.stage_limits]

    m = cp_model.CpModel()
    start: list[cp_model.IntVar] = []
    end: list[cp_model.IntVar] = []
    for op in range(problem.n_slots * nk):
        start.append(m.new_int_var(0, horizon, f"s{op}"))
        end.append(m.new_int_var(0, horizon, f"e{op}"))
    intervals: dict[int, list[cp_model.IntervalVar]] = {wid: [] for wid in live}
    held: dict[int, list[tuple[cp_model.IntervalVar, int]]] = {wid: [] for wid in live}
    first = {wid: m.new_int_var(0, horizon, f"first{wid}") for wid in live}
    last = {wid: m.new_int_var(0, horizon, f"last{wid}") for wid in live}
    chosen: dict[tuple[int, int], cp_model.IntVar] = {}
    orphan = {slot for group in problem.orphan_slots for slot in group}
    pinned = dict(problem.routing)

    busy: dict[int, list[tuple[int, object]]] = {wid: [] for wid in live}  # (duration, presence) per op
    for slot in range(problem.n_slots):
        if not present[slot]:
            continue
        d, _, s = problem.slot_key(slot)
        x = _size(sizes, slot)
        slot_dur = idur_of[x]
        frees = frees_of[x] if limit is not None else []
        if slot in pinned:
            cands = [pinned[slot]]
        else:
            cands = [problem.worker_id(w) for w in problem.survivors[s]] if slot in orphan else [d * pp + s]
        lits: list[object] = []
        for wid in cands:
            lit: object = True
            if len(cands) > 1:
                lit = m.new_bool_var(f"x{slot}_{wid}")
                chosen[(slot, wid)] = lit  # type: ignore[assignment]
            lits.append(lit)
            for k in range(nk):
                op = slot * nk + k
                if lit is True:
                    iv = m.new_interval_var(start[op], slot_dur[wid][k], end[op], "")
                else:
                    iv = m.new_optional_interval_var(start[op], slot_dur[wid][k], end[op], lit, "")
                intervals[wid].append(iv)
                busy[wid].append((slot_dur[wid][k], lit))
                if limit is not None and k > 0 and frees[s][k] > 0:
                    # Memory freed by this B / W / BW is held from the slot's F start to this op's end.
                    f_op = slot * nk
                    size = m.new_int_var(0, horizon, "")
                    if lit is True:
                        hv = m.new_interval_var(start[f_op], size, end[op], "")
                    else:
                        hv = m.new_optional_interval_var(start[f_op], size, end[op], lit, "")
                    held[wid].append((hv, frees[s][k]))
            f_op, last_op = slot * nk, slot * nk + nk - 1
            c1 = m.add(first[wid] <= start[f_op])
            c2 = m.add(last[wid] >= end[last_op])
            if lit is not True:
                c1.only_enforce_if(lit)
                c2.only_enforce_if(lit)
        if len(cands) > 1:
            m.add_exactly_one(lits)
        f, b = slot * nk, slot * nk + 1
        m.add(end[f] <= start[b])
        if nk == 3:
            m.add(end[b] <= start[b + 1])
        if s > 0:
            m.add(end[f - nk] + p2p <= start[f])  # F of the previous stage, same micro-batch
        if s < pp - 1:
            m.add(end[b + nk] + p2p <= start[b])  # B of the next stage
    for wid in live:
        m.add_no_overlap(intervals[wid])
        # Redundant, for the LP relaxation: a worker's iteration is at least as long as its ops.
        fixed = sum(dur for dur, lit in busy[wid] if lit is True)
        chosen_work = [dur * lit for dur, lit in busy[wid] if lit is not True and dur]  # type: ignore[operator]
        m.add(last[wid] - first[wid] >= fixed + sum(chosen_work))
        if limit is not None and held[wid]:
            ivs, demands = zip(*held[wid], strict=True)
            m.add_cumulative(list(ivs), list(demands), ilimits[wid % pp])
    cut_pipelines = problem.cut.pipelines
    for d in range(problem.dp):
        if d in cut_pipelines:
            continue  # pieces of different sizes are not interchangeable
        for mb in range(problem.microbatches - 1):
            m.add(start[problem.slot_id(d, mb, 0) * nk] <= start[problem.slot_id(d, mb + 1, 0) * nk])

    step_end = {}
    for s, group in enumerate(problem.survivors):
        ar = m.new_int_var(0, horizon, f"ar{s}")
        for w in group:
            m.add(ar >= last[problem.worker_id(w)])
        for w in group:
            wid = problem.worker_id(w)
            step_end[wid] = ar + iar[s] + isteps[wid]
    finish = m.new_int_var(0, horizon, "finish")
    m.add_max_equality(finish, list(step_end.values()))
    period = m.new_int_var(0, horizon, "period")
    if objective == "period":
        for wid in live:
            m.add(first[wid] + period >= (finish if synchronous else step_end[wid]))
        if t_exact:
            m.add(period >= math.floor(lower_bound(problem) * tscale + 1e-9))  # prunes; never cuts an order
        m.minimize(period)
    else:
        m.minimize(finish)

    if hint is not None:
        _add_hint(m, problem, hint, hint_timing, tscale,
                  {"start": start, "end": end, "chosen": chosen, "first": first, "last": last, "period": period})

    solver = cp_model.CpSolver()
    # Deterministic stopping (see WALL_FACTOR); with num_workers=1 and a fixed seed the whole search is
    # reproducible. Several workers race each other, which is faster but not reproducible.
    solver.parameters.max_deterministic_time = max(0.01, float(time_limit) * DETERMINISTIC_PER_SECOND)
    solver.parameters.max_time_in_seconds = WALL_FACTOR * max(0.01, float(time_limit)) + WALL_SLACK
    solver.parameters.num_workers = max(1, int(num_workers))
    solver.parameters.random_seed = seed
    status = solver.solve(m)
    name = solver.status_name(status)
    bound_ok = mem_exact or limit is None
    bound = max(0.0, solver.best_objective_bound / tscale) if bound_ok else 0.0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            bound = math.inf if bound_ok else 0.0
        return CpResult(None, bound if status != cp_model.UNKNOWN else 0.0, None, False, name)
    seqs: dict[int, list[int]] = {wid: [] for wid in live}
    keyed: dict[int, list[tuple[int, int, int, int]]] = {wid: [] for wid in live}
    runner = {slot: wid for (slot, wid), lit in chosen.items() if solver.boolean_value(lit)}
    for slot in range(problem.n_slots):
        if not present[slot]:
            continue
        d, _, s = problem.slot_key(slot)
        wid = runner.get(slot, pinned.get(slot, d * pp + s))
        if slot in orphan and slot not in runner and slot not in pinned:
            wid = problem.worker_id(problem.survivors[s][0])  # the stage's only survivor
        for k in range(nk):
            op = slot * nk + k
            keyed[wid].append((solver.value(start[op]), solver.value(end[op]), k, op))
    for wid, items in keyed.items():
        seqs[wid] = [op for *_, op in sorted(items)]
    value = solver.objective_value / tscale
    return CpResult(seqs, bound, value, status == cp_model.OPTIMAL and t_exact and bound_ok, name)


def _size(sizes: Sequence[float] | None, slot: int) -> float:
    return 1.0 if sizes is None else sizes[slot]


def relabel_microbatches(problem: Problem, seqs: Mapping[int, Sequence[int]],
                         starts: Mapping[int, float]) -> tuple[dict[int, list[int]], dict[int, float]]:
    """Rename each pipeline's micro-batches in the order their stage-0 forwards start.

    Micro-batches of one pipeline are interchangeable, so this gives an equivalent schedule, one
    that meets the model's symmetry breaking (used to make a warm start the model accepts)."""
    nk, pp, mb = len(problem.kinds), problem.pp, problem.microbatches
    rename: dict[int, int] = {}
    for d in range(problem.dp):
        if d in problem.cut.pipelines:
            continue  # a re-cut pipeline's pieces differ in size: kept as they are (the model does not order them)
        firsts = sorted(range(mb), key=lambda m: (starts[problem.slot_id(d, m, 0) * nk], m))
        for new_m, old_m in enumerate(firsts):
            for s in range(pp):
                rename[problem.slot_id(d, old_m, s)] = problem.slot_id(d, new_m, s)

    def op_of(op: int) -> int:
        return rename.get(op // nk, op // nk) * nk + op % nk

    return ({w: [op_of(op) for op in ops] for w, ops in seqs.items()},
            {op_of(op): t for op, t in starts.items()})


def _add_hint(
    m: cp_model.CpModel,
    problem: Problem,
    hint: Mapping[int, Sequence[int]],
    timing: Timing | None,
    tscale: int,
    var: Mapping[str, Any],
) -> None:
    """Hint a complete solution: the runners of the re-routed slots and, when timed, the start times of
    the last (steady-state) iteration shifted to begin at zero, with the matching window and period."""
    nk = len(problem.kinds)
    if timing is None or not timing.ok or not len(timing.ops):
        runner = {op // nk: wid for wid, ops in hint.items() for op in ops}
        for (slot, wid), lit in var["chosen"].items():
            m.add_hint(lit, runner.get(slot) == wid)
        return
    seqs, starts = relabel_microbatches(problem, hint, timing.last_starts())
    runner = {op // nk: wid for wid, ops in seqs.items() for op in ops}
    for (slot, wid), lit in var["chosen"].items():
        m.add_hint(lit, runner.get(slot) == wid)
    shift = min(starts.values())
    span = 0
    for wid, ops in seqs.items():
        if not ops:
            continue
        worker = problem.worker_of(wid)
        ends = []
        for op in ops:
            # Floors, as the model's durations: then every precedence, no-overlap and memory order of the
            # timed schedule still holds in ticks (floor(a + b) >= floor(a) + floor(b)), so the hint is feasible.
            t = math.floor((starts[op] - shift) * tscale + 1e-9)
            size = _size(problem.slot_sizes, op // nk)
            e = t + math.floor(problem.duration(problem.kinds[op % nk], worker) * size * tscale + 1e-9)
            m.add_hint(var["start"][op], t)
            m.add_hint(var["end"][op], e)
            ends.append(e)
        first = math.floor((min(starts[op] for op in ops) - shift) * tscale + 1e-9)
        m.add_hint(var["first"][wid], first)
        m.add_hint(var["last"][wid], max(ends))
        span = max(span, max(ends) - first)
    m.add_hint(var["period"], math.ceil(timing.period * tscale - 1e-9))
