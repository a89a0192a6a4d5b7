"""Adaptive schedules under failures (the ReCycle idea): re-route, split the backward, stagger the step.

`adaptive_order(topology, microbatches, costs, solver=..., time_limit=...)` returns a compute `Order`
for the live workers, a proven lower bound on its period, and the solver that made it:

1. every micro-batch of a failed worker (d, s) runs at stage s on a live peer of another pipeline
   (`schedcomp.route`); a stage with no live worker left raises `RecoveryError`, a memory limit below
   one micro-batch's activations raises `MemoryLimitError`;
2. "greedy": a portfolio of list-scheduler variants (in-flight window, W policy, routing; see
   `solvers.greedy`) and, up to `PLAIN_MAX_OPS`, the plain re-routed 1F1B (`solvers.plain`), each
   timed with the simulator's semantics, the best polished by local search (`solvers.improve`);
3. "cpsat": the CP-SAT model (`solvers.cpsat`) warm-started from the greedy result, within
   `time_limit` nominal seconds, counted in CP-SAT's *deterministic* time; the better of the two is kept
   and CP-SAT's proven bound is reported;
4. "auto": CP-SAT where the model is small enough to finish within `time_limit`, greedy otherwise.

With virtual stages (`Topology.chunks` > 1) a failed worker's slots of every chunk it held are
re-routed to the live workers at its place (which hold the same chunks), a micro-batch's chunks there
to one peer; the greedy solver and the local search schedule them, CP-SAT and the plain candidate do
not apply (one stage per worker), and the bound is the work bound (`solvers.bounds`).

Determinism: every rank of a job may compile the same plan on its own, so the result depends on the
inputs only, never on the clock or the machine's load. The local search stops on a work budget
(`improve.work_of`), and CP-SAT runs one worker with a fixed seed and a deterministic time limit; its
wall-clock limit is only a safety net (`solvers.cpsat.WALL_FACTOR`), far above what the deterministic limit
takes on a loaded machine, so it cannot change the answer in normal conditions.

The bound is the largest of the work-conservation bound, the memory warm-up bound under a memory limit
(`solvers.bounds`) and CP-SAT's, so every plan carries its gap.
The figure of merit is the steady-state period with a staggered optimizer (`synchronous=True`
optimises for a global optimizer barrier instead).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

import numpy as np

from schedcomp.costs import CostModel
from schedcomp.cut import Cut
from schedcomp.errors import ScheduleError
from schedcomp.gcpause import paused_gc
from schedcomp.ir import Order
from schedcomp.opcolumns import OP_CODES, ColumnOps, OpColumns
from schedcomp.route import assign_orphans, balanced_quota
from schedcomp.solvers.bounds import lower_bound
from schedcomp.solvers.greedy import GreedyParams, list_schedule_steps
from schedcomp.solvers.greedy_tables import default_windows
from schedcomp.solvers.improve import improve
from schedcomp.solvers.merged import merged_sequences
from schedcomp.solvers.plain import plain_sequences
from schedcomp.solvers.problem import Problem
from schedcomp.solvers.timing import Timing, flat_sequences, peak_memory, time_sequences, within_limits
from schedcomp.topology import Topology

log = logging.getLogger(__name__)

SOLVERS = ("auto", "greedy", "cpsat")
ITERATIONS = 4
"""Iterations the candidates are timed over: the simulator's default, so periods agree with it."""
CPSAT_INTERVALS_PER_SECOND = 20
"""`auto` runs CP-SAT when the model has at most this many intervals per second of `time_limit`."""
GREEDY_POLISH_SECONDS = 1.0
"""Local search budget of the greedy solver, in nominal seconds: converted to a fixed amount of work
(`improve.work_of`), so a slow or loaded machine takes longer but returns the same schedule."""
_TOL = 1e-9


@dataclass(frozen=True)
class Solution:
    """Per-worker op-id sequences with their period (simulator semantics), bound and provenance."""

    problem: Problem
    seqs: dict[int, list[int]]
    period: float
    makespan: float
    bound: float
    solver: str
    variant: str
    timing: Timing | None = None
    """The timing of `seqs` over `ITERATIONS` iterations (optimizer as `synchronous`), when the solver kept it:
    the lowered plan's simulation is this very timing (`schedcomp.simfast.remember`)."""
    synchronous: bool = False

    def order(self) -> Order:
        """The compute order, as columns decoded from the op ids (`schedcomp.opcolumns`: 1.6 million ops at
        pp = 32, dp = 256, whose `Op` objects are made only if someone reads them)."""
        problem = self.problem
        family = "adaptive" if problem.split else "adaptive-no-split"
        nk, mbs, stages = len(problem.kinds), problem.width, problem.stages
        workers = problem.topology.live_workers  # every live worker has an entry, possibly empty
        ids, lens = flat_sequences(self.seqs, [problem.worker_id(w) for w in workers])
        slot, kind = np.divmod(ids, nk)
        rest, stage = np.divmod(slot, stages)
        pipeline, microbatch = np.divmod(rest, mbs)
        code = np.array([OP_CODES.index(k) for k in problem.kinds], np.int64)[kind]
        ends = np.cumsum(lens, dtype=np.int64)
        ops = ColumnOps(OpColumns(tuple(workers), ends, code, pipeline, microbatch, stage))
        return Order(problem.topology, problem.microbatches, ops, family, problem.cut)


def adaptive_order(topology: Topology, microbatches: int, costs: CostModel,
                   **options: Any) -> tuple[Order, float | None, str]:
    """The adaptive compute order for `topology` (with its failures): (order, period bound, solver used);
    `options` (solver, time_limit, split, synchronous, recut) as `adaptive_solution`'s."""
    with paused_gc():  # the schedulers allocate many small acyclic objects: see `schedcomp.gcpause`
        sol = adaptive_solution(topology, microbatches, costs, **options)
        return sol.order(), (sol.bound if sol.bound > 0 else None), sol.solver


def adaptive_solution(
    topology: Topology,
    microbatches: int,
    costs: CostModel,
    *,
    solver: str = "auto",
    time_limit: float = 10.0,
    split: bool = True,
    synchronous: bool = False,
    recut: bool = False,
) -> Solution:
    """`adaptive_order`'s solution itself: its sequences, and their timing that the lowered plan's simulation
    reuses (`schedcomp.compiler`). `recut` sizes the failed workers' micro-batches for the peers that take
    them (`schedcomp.recut`); the order then carries the cut."""
    with paused_gc():  # the schedulers allocate many small acyclic objects: see `schedcomp.gcpause`
        problem = Problem(topology, microbatches, costs, split)
        if recut and topology.failed:
            return recut_solution(problem, solver, time_limit, synchronous)
        return solve(problem, solver=solver, time_limit=time_limit, synchronous=synchronous)


def recut_solution(problem: Problem, solver: str, time_limit: float, synchronous: bool) -> Solution:
    """The best schedule over whole micro-batches, the cuts of `recut.PIECES`, then the same cuts with the
    other pipelines halved (`recut.halve_the_rest`), tried in that order (fewer pieces first): a cut is kept
    only where it schedules faster, a halved one only where it gains `recut.HALVES_MIN_GAIN` and the problem
    is small enough for the whole portfolio (`recut.HALVES_MAX_OPS`)."""
    from schedcomp.recut import HALVES_MAX_OPS, HALVES_MIN_GAIN, PIECES, halve_the_rest, recut

    def pinned(cut: Cut, routing: dict[tuple[int, int, int], int]) -> Problem:
        cut_problem = replace(problem, cut=cut)
        return replace(cut_problem, routing=tuple(sorted(
            (cut_problem.slot_id(*key), wid) for key, wid in routing.items())))

    plain = [recut(problem, piece) for piece in PIECES]
    halved = [(halve_the_rest(cut, problem.topology.dp, problem.microbatches), routing) for cut, routing in plain]
    problems: list[tuple[Problem, float]] = []  # (problem, the relative gain it must bring)
    for (cut, routing), gain in [(c, 0.0) for c in plain] + [(c, HALVES_MIN_GAIN) for c in halved]:
        if all(cut != p.cut for p, _ in problems):
            cut_problem = pinned(cut, routing)
            if gain and cut_problem.n_slots * len(cut_problem.kinds) > HALVES_MAX_OPS:
                continue
            problems.append((cut_problem, gain))
    # The fractional work bound and the warm-up bound of the workers that run whole micro-batches of their
    # own only, below whole micro-batches' bound: what some cut may reach (halved pipelines warm up sooner).
    target = min(lower_bound(p) for p, _ in problems)
    best = solve(problem, solver=solver, time_limit=time_limit, synchronous=synchronous)
    for cut_problem, gain in problems:
        if best.period <= target * (1 + _TOL):
            break  # at the bound: no cut does better
        sol = solve(cut_problem, solver=solver, time_limit=time_limit, synchronous=synchronous)
        if sol.period < best.period * (1 - gain) - _TOL:
            best = sol
    return best


def check_solver_options(solver: object, time_limit: object) -> None:
    """`solver` and `time_limit` as `solve` takes them; ScheduleError in one line otherwise (checked before any
    candidate compiles: `choice.fastest` drops a candidate that cannot build the job, not a mistyped option)."""
    if solver not in SOLVERS:
        raise ScheduleError(f"unknown solver {solver!r}: choose one of {', '.join(SOLVERS)}")
    if not (isinstance(time_limit, (int, float)) and time_limit > 0 and math.isfinite(time_limit)):
        raise ScheduleError(f"time_limit must be a positive number of seconds, got {time_limit!r}")


def solve(problem: Problem, *, solver: str = "auto", time_limit: float = 10.0, synchronous: bool = False) -> Solution:
    """Schedule `problem` (see the module docstring); raises on unrecoverable topologies or memory."""
    check_solver_options(solver, time_limit)
    if solver == "cpsat" and problem.topology.chunks > 1:
        raise ScheduleError(f"the CP-SAT model runs one stage per worker, not chunks={problem.topology.chunks}: "
                            "use solver 'greedy' or 'auto' with virtual stages")
    _ = problem.survivors  # RecoveryError when a stage has no live worker
    problem.check_memory()
    bound = lower_bound(problem)
    best = greedy(problem, bound=bound, synchronous=synchronous, time_budget=min(GREEDY_POLISH_SECONDS, time_limit / 4))
    use_cpsat = solver == "cpsat" or (solver == "auto" and cpsat_fits(problem, time_limit))
    if not use_cpsat or best.period <= bound * (1 + _TOL):
        return best  # (at the bound the greedy schedule is optimal: CP-SAT could not improve it)
    from schedcomp.solvers.cpsat import solve_cpsat  # imports OR-tools: only when CP-SAT runs

    # Not `time_limit` minus the time spent so far: that would make the answer depend on the clock.
    # The greedy work above is bounded and small next to CP-SAT's deterministic limit.
    hint_timing = time_sequences(problem, best.seqs, ITERATIONS, synchronous)
    result = solve_cpsat(problem, time_limit=time_limit, hint=best.seqs, hint_timing=hint_timing,
                         synchronous=synchronous, num_workers=1, seed=0)
    bound = max(bound, result.bound if math.isfinite(result.bound) else 0.0)
    log.info("cpsat: %s, objective %s, bound %.4g", result.status, result.value, result.bound)
    if result.seqs is not None:
        timing = time_sequences(problem, result.seqs, ITERATIONS, synchronous)
        if timing.ok and timing.period < best.period - _TOL:
            return Solution(problem, result.seqs, timing.period, timing.makespan, bound, "cpsat", result.status,
                            timing, synchronous)
    return Solution(problem, best.seqs, best.period, best.makespan, bound, "cpsat", best.variant, best.timing,
                    synchronous)


def cpsat_fits(problem: Problem, time_limit: float) -> bool:
    """Whether CP-SAT can be expected to finish on `problem` within `time_limit` seconds."""
    # Its precedences carry a fixed p2p latency, which a hand-off between two chunks of one worker has not.
    return problem.topology.chunks == 1 and problem.model_size <= CPSAT_INTERVALS_PER_SECOND * time_limit


def greedy(
    problem: Problem, *, bound: float | None = None, synchronous: bool = False, time_budget: float = 1.0
) -> Solution:
    """The best of the list-scheduler portfolio, polished by local search.

    `time_budget` is in nominal seconds, turned into a fixed work budget (`improve.work_of`): the
    result depends on the inputs only, not on how fast this machine runs."""
    bound = lower_bound(problem) if bound is None else bound
    quota = balanced_quota(problem)
    assignment = assign_orphans(problem, quota)
    best: _Candidate | None = None
    n_ops = problem.n_slots * len(problem.kinds)
    # (The plain construction is 1F1B's, one stage per worker, of whole micro-batches.)
    plain = problem.topology.chunks == 1 and not problem.cut
    if problem.topology.chunks > 1 and n_ops <= PLAIN_MAX_OPS:
        # With virtual stages, first the family of the placement merged over the re-routed micro-batches
        # (`solvers.merged`): cheap, and often at the bound, which then spares the portfolio.
        seqs = merged_sequences(problem, assignment)
        timing = time_sequences(problem, seqs, ITERATIONS, synchronous)
        if timing.ok and within_limits(problem, seqs):
            best = _Candidate(problem, round(timing.period, 9), timing.makespan, -1, "merged", seqs, timing)
    variants = portfolio(problem)
    for i, params in enumerate(variants):
        if best is not None and best.period <= bound * (1 + _TOL):
            break  # provably optimal: nothing to gain from the rest
        seqs, steps = list_schedule_steps(problem, params, assignment, quota)
        timing = time_sequences(problem, seqs, ITERATIONS, synchronous, steps)
        candidate = _Candidate(problem, round(timing.period, 9), timing.makespan, i, str(params), seqs, timing)
        if timing.ok and candidate.beats(best):
            best = candidate
    if best is not None and best.period > bound * (1 + _TOL) and n_ops <= PLAIN_MAX_OPS and plain:
        # The plain construction as one more candidate (ties go to the list scheduler): the list scheduler
        # is work-conserving and can lose to 1F1B's strict alternation (see `solvers.plain`).
        seqs = plain_sequences(problem)
        timing = time_sequences(problem, seqs, ITERATIONS, synchronous)
        candidate = _Candidate(problem, round(timing.period, 9), timing.makespan, len(variants), "plain", seqs, timing)
        if timing.ok and candidate.beats(best) and within_limits(problem, seqs):
            best = candidate
    if best is None:
        raise ScheduleError("no list-scheduler variant produced a runnable schedule (a bug): report the inputs")
    period, makespan, variant, seqs, timing = best.period, best.makespan, best.variant, best.seqs, best.timing
    kept: Timing | None = timing
    if period > bound * (1 + _TOL) and n_ops <= LOCAL_SEARCH_MAX_OPS:
        seqs, (p2, m2) = improve(problem, seqs, time_budget=time_budget, max_moves=_moves(n_ops),
                                 iterations=ITERATIONS, synchronous=synchronous, bound=bound)
        kept = None  # (the search may have moved ops: its sequences are not the ones timed)
        if (p2, m2) < (period, makespan):
            period, makespan, variant = p2, m2, variant + "+ls"
    log.info("greedy: %s, period %.4g, bound %.4g", variant, period, bound)
    return Solution(problem, seqs, period, makespan, bound, "greedy", variant, kept, synchronous)


@dataclass(frozen=True)
class _Candidate:
    """A schedule in the running: its period (rounded), first iteration, place in the portfolio, and peak
    memory, worked out only where a tie on the period needs it (at scale one variant runs: 0.3 s saved)."""

    problem: Problem
    period: float
    makespan: float
    index: int
    variant: str
    seqs: dict[int, list[int]]
    timing: Timing

    @cached_property
    def peak(self) -> float:
        return peak_memory(self.problem, self.seqs)

    def beats(self, other: _Candidate | None) -> bool:
        """Ties on the period go to the schedule holding less memory, then to the shorter first iteration,
        then to the one tried first."""
        if other is None:
            return True
        if self.period != other.period:
            return self.period < other.period
        return (self.peak, self.makespan, self.index) < (other.peak, other.makespan, other.index)


PLAIN_MAX_OPS = 20_000
"""Larger schedules skip the plain candidate (building and timing it costs 0.3 s at pp=16, dp=64, M=32,
where the portfolio is cut down for compile time too): above this, "never slower than the plain
construction" is no longer guaranteed by construction."""
LOCAL_SEARCH_MAX_OPS = 1500
"""Larger schedules skip the local search: each move re-times the whole schedule."""


def _moves(n_ops: int) -> int:
    return max(1000, min(20_000, 1_000_000 // max(1, n_ops)))


def portfolio(problem: Problem) -> list[GreedyParams]:
    """List-scheduler variants to try, most useful first; fewer on large problems (compile time).

    The order is a greedy set cover measured on 60 random instances (pp 4-8, dp 2-8, 1-4 failures,
    uniform and random costs): the first six variants were among the best on every one of them.
    """
    windows = default_windows(problem)
    if not problem.topology.failed:
        return [GreedyParams(windows[w], policy, "static") for policy in ("idle", "fit", "eager")
                for w in ("h2", "rtt", "1f1b")]
    ranked = [
        GreedyParams(windows["h2"], "idle", "quota", True),
        GreedyParams(windows["h2"], "fit", "pool", True),
        GreedyParams(windows["rtt"], "idle", "static", True),
        GreedyParams(windows["1f1b"], "idle", "static", True),
        GreedyParams(windows["h2"], "idle", "pool", True),
        GreedyParams(windows["h2"], "fit", "static", True),
        GreedyParams(windows["h2"], "idle", "pool"),
        GreedyParams(windows["rtt"], "idle", "quota"),
        GreedyParams(windows["h2"], "idle", "static", True),
        GreedyParams(windows["rtt"], "idle", "pool", True),
        GreedyParams(windows["1f1b"], "eager", "static", True),
    ]
    if problem.cut:  # pieces sized for their peers: kept there, filling the peers' bubbles first
        filling = [GreedyParams(windows[w], policy, "static", scaled, fill=True) for w in ("h2", "rtt", "1f1b")
                   for policy in ("idle", "fit") for scaled in (True, False)]
        # ... and, after those (so large jobs, which try the first few only, keep them), planning for the
        # iteration's boundary: the pieces and the cross-iteration chain are where a cut job loses to its bound.
        # Three, not every window and policy: on table 6's pp 4 jobs these gain all that the six do.
        ahead = [GreedyParams(windows[w], policy, "static", fill=True, lookahead=True)
                 for w, policy in (("h2", "fit"), ("h2", "idle"), ("1f1b", "fit"))]
        ranked = filling + ahead + ranked
    n_ops = problem.n_slots * len(problem.kinds)
    if n_ops > 60_000:
        return ranked[:1]
    if n_ops > 20_000:
        return ranked[:3]
    if n_ops > 1_000:
        return ranked
    rest = [GreedyParams(windows[w], policy, r, scaled) for policy in ("idle", "fit", "eager")
            for w in ("h2", "rtt", "1f1b") for scaled in (True, False) for r in ("pool", "static", "quota")]
    return ranked + [v for v in rest if v not in ranked]
