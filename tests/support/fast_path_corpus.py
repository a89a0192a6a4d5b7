"""A fixed corpus of small plans and orders, sound and broken, and what `lower` and `check` say of each.

`verdicts()` maps a case name to what the compiler answered: a sound plan's JSON digest and a digest of
its `PlanIndex` transfer tables, or the exact error message. `tests/compiler/data/fast_paths.json` holds
these answers as the code gave them before `lower`, the scan and the deadlock pass were rewritten over
columns; `test_fast_paths.py` compares. Regenerate only for an intended change of answers:
`python tests/support/fast_path_corpus.py > tests/compiler/data/fast_paths.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
from collections.abc import Callable, Iterator

from schedcomp.check import check, index_of
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import SchedcompError
from schedcomp.ir import Instruction, Order, Plan
from schedcomp.lower import lower
from schedcomp.topology import Worker

PLANS: list[tuple[str, dict[str, object]]] = [
    ("1f1b-4x1", {"pp": 4, "dp": 1, "microbatches": 8, "schedule": "1f1b"}),
    ("gpipe-3x2", {"pp": 3, "dp": 2, "microbatches": 4, "schedule": "gpipe"}),
    ("zb-h1-4x2", {"pp": 4, "dp": 2, "microbatches": 6, "schedule": "zb-h1"}),
    ("zb-h2-3x3", {"pp": 3, "dp": 3, "microbatches": 5, "schedule": "zb-h2"}),
    ("1f1b-1x2", {"pp": 1, "dp": 2, "microbatches": 3, "schedule": "1f1b"}),
    ("interleaved-2x2", {"pp": 2, "dp": 2, "microbatches": 4, "schedule": "interleaved-1f1b", "chunks": 2}),
    ("zb-v-3x1", {"pp": 3, "dp": 1, "microbatches": 6, "schedule": "zb-v"}),
    ("adaptive-4x2-1fail", {"pp": 4, "dp": 2, "microbatches": 8, "failed": [(1, 2)], "solver": "greedy"}),
    ("adaptive-4x3-2fail", {"pp": 4, "dp": 3, "microbatches": 6, "failed": [(0, 1), (2, 3)], "solver": "greedy"}),
    ("adaptive-3x4-recut", {"pp": 3, "dp": 4, "microbatches": 4, "failed": [(1, 1)], "recut": "failed pipeline",
                            "solver": "greedy"}),
    ("zb-v-3x2-fail", {"pp": 3, "dp": 2, "microbatches": 4, "schedule": "zb-v", "failed": [(0, 2)],
                       "solver": "greedy"}),
    ("adaptive-4x2-layers", {"pp": 4, "dp": 2, "microbatches": 4, "failed": [(0, 3)], "layers": 3,
                             "solver": "greedy", "reform": "never"}),  # (re-routed: auto would re-form here)
]
MUTANTS = 24  # broken copies of each plan
ORDER_MUTANTS = 10  # broken copies of each plan's compute order, lowered


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def index_digest(plan: Plan) -> str:
    index = index_of(plan)
    assert index is not None
    return digest(repr([sorted(index.sent.items()), sorted(index.received.items()), sorted(index.consumed.items())]))


def _verdict(make: Callable[[], Plan]) -> str:
    try:
        plan = make()
        check(plan)
    except SchedcompError as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok {digest(plan.to_json())} {index_digest(plan)}"


def _mutate(plan: Plan, rnd: random.Random) -> Plan:
    """One random corruption of one stream (or two), which `check` may or may not accept."""
    streams = dict(plan.streams)
    workers = sorted(streams)
    w = rnd.choice(workers)
    s = list(streams[w])
    how = rnd.randrange(9)
    i = rnd.randrange(len(s))
    if how == 0:
        del s[i]
    elif how == 1:
        s.insert(i, s[i])
    elif how == 2 and i + 1 < len(s):
        s[i], s[i + 1] = s[i + 1], s[i]
    elif how == 3:
        s.insert(rnd.randrange(len(s)), s.pop(i))
    elif how == 4 and s[i].peer is not None:
        s[i] = Instruction(s[i].kind, s[i].op, rnd.choice(workers))
    elif how == 5:
        j = rnd.randrange(len(s))
        a, b = min(i, j), max(i, j)
        s[a:b] = reversed(s[a:b])
    elif how == 6:  # swap a whole stream's order of compute ops with another worker's stream piece
        other = rnd.choice(workers)
        t = list(streams[other])
        j = rnd.randrange(len(t))
        s[i], t[j] = t[j], s[i]
        streams[other] = tuple(t)
    elif how == 7:  # move a receive to the end, past its consumer
        s.append(s.pop(i))
    else:  # a tight memory limit
        return dataclasses.replace(plan, costs=plan.costs.with_memory_limit(rnd.choice([0.5, 1.0, 1.5, 2.0])))
    streams[w] = tuple(s)
    return dataclasses.replace(plan, streams=streams)


def order_of(plan: Plan) -> Order:
    return Order(plan.topology, plan.microbatches, {w: plan.compute_ops(w) for w in plan.streams},
                 plan.family, plan.cut, plan.partition)


def _mutate_order(order: Order, rnd: random.Random) -> Order:
    ops = {w: list(o) for w, o in order.ops.items()}
    workers = list(ops)
    w = rnd.choice(workers)
    i = rnd.randrange(len(ops[w])) if ops[w] else 0
    how = rnd.randrange(5)
    if not ops[w]:
        pass
    elif how == 4:  # two forwards swapped: a deadlock where a neighbour runs them in the other order
        forwards = [j for j, op in enumerate(ops[w]) if op.kind.value == "F"]
        a, b = sorted(rnd.sample(forwards, 2)) if len(forwards) > 1 else (i, i)
        ops[w][a], ops[w][b] = ops[w][b], ops[w][a]
    elif how == 0:
        del ops[w][i]
    elif how == 1:
        ops[rnd.choice(workers)].append(ops[w].pop(i))
    elif how == 2:
        ops[w].insert(rnd.randrange(len(ops[w])), ops[w].pop(i))
    else:
        ops[w].reverse()
    return dataclasses.replace(order, ops={v: tuple(o) for v, o in ops.items()})


@functools.cache
def compiled(name: str) -> Plan:
    """The sound plan of `PLANS` named `name` (compiled once per process: the tests share it)."""
    options = dict(PLANS)[name]
    if options.get("recut") == "failed pipeline":
        return _failed_pipeline_recut(**{k: v for k, v in options.items() if k not in ("recut", "solver")})
    return compile(**options)  # type: ignore[arg-type]


def _failed_pipeline_recut(pp: int, dp: int, microbatches: int, failed: list[tuple[int, int]]) -> Plan:
    """The re-cut plan as `compile(recut=True)` made it when the golden answers were taken: the best greedy
    schedule of whole micro-batches and the failed pipeline's cuts of `recut.PIECES` (unequal pieces), before
    the compiler also tried halving the other pipelines (`recut.halve_the_rest`), which wins here."""
    from schedcomp.adaptive import solve
    from schedcomp.compiler import unit_costs
    from schedcomp.memory import resolve_limit
    from schedcomp.recut import PIECES, recut
    from schedcomp.solvers.problem import Problem
    from schedcomp.topology import Topology

    topology = Topology.of(pp, dp, [Worker(*w) for w in failed])
    costs = resolve_limit("fault-free", topology, microbatches, unit_costs(topology))
    problem = Problem(topology, microbatches, costs)
    best = solve(problem, solver="greedy")
    for piece in PIECES:
        cut, routing = recut(problem, piece)
        cut_problem = dataclasses.replace(problem, cut=cut)
        cut_problem = dataclasses.replace(cut_problem, routing=tuple(sorted(
            (cut_problem.slot_id(*key), wid) for key, wid in routing.items())))
        sol = solve(cut_problem, solver="greedy")
        if sol.period < best.period - 1e-9:
            best = sol
    return lower(best.order(), costs, solver=best.solver, lower_bound=best.bound if best.bound > 0 else None)


def cases() -> Iterator[tuple[str, Callable[[], Plan]]]:
    """(name, a function making the plan) for every case, sound and broken."""
    for name, _ in PLANS:
        plan = compiled(name)
        yield name, lambda plan=plan: plan
        rnd = random.Random(name)
        for k in range(MUTANTS):
            bad = _mutate(plan, rnd)
            yield f"{name} mutant {k}", lambda bad=bad: bad
        order = order_of(plan)
        costs: CostModel = plan.costs
        for k in range(ORDER_MUTANTS):
            bad_order = _mutate_order(order, rnd)
            yield f"{name} order {k}", lambda o=bad_order, c=costs: lower(o, c)


def verdicts() -> dict[str, str]:
    return {name: _verdict(make) for name, make in cases()}


if __name__ == "__main__":
    print(json.dumps(verdicts(), indent=1, sort_keys=True))


__all__ = ["PLANS", "Worker", "cases", "compiled", "order_of", "verdicts"]
