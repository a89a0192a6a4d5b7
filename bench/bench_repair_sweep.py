"""Plan repair on small jobs (issue 14): every single repair of a few plans, and what came of it.

Reproduce (from the repository root; a few seconds):

    python bench/bench_repair_sweep.py

8 plans, pp 3-8, dp 2-4 (fault-free families, and adaptive plans with 0-2 failures), each repaired
around every live worker that has a live peer (118 repairs), at each plan's default memory limit (a
plan with failures: its own limit; a fault-free plan: its own per-stage peaks) and with the limit
lifted (compile and repair with `memory_limit=None`). Each repair runs with `validate=False` and is
then checked: `valid` passed `check`, `refused` raised `RecoveryError` (memory), `INVALID` is a plan
`repair` returned that fails `check` (a deadlock, before issue 14's fix); the last must stay 0.
"""

from __future__ import annotations

from collections import Counter

from schedcomp.check import check
from schedcomp.compiler import compile
from schedcomp.errors import RecoveryError, ValidationError
from schedcomp.repair import repair

PLANS: list[dict[str, object]] = [
    {"pp": 3, "dp": 3, "microbatches": 4, "schedule": "1f1b"},
    {"pp": 4, "dp": 2, "microbatches": 8, "schedule": "zb-h2"},
    {"pp": 4, "dp": 3, "microbatches": 8, "schedule": "zb-h1"},
    {"pp": 4, "dp": 3, "microbatches": 6, "failed": [(0, 1)]},
    {"pp": 4, "dp": 4, "microbatches": 8, "failed": [(0, 1), (2, 3)]},
    {"pp": 6, "dp": 3, "microbatches": 8},
    {"pp": 8, "dp": 4, "microbatches": 16, "failed": [(0, 3), (1, 5)]},
    {"pp": 8, "dp": 2, "microbatches": 8, "schedule": "1f1b"},
]


def outcomes(lifted: bool) -> Counter[str]:
    """How the single repairs of `PLANS` came out (see the module docstring)."""
    tally: Counter[str] = Counter()
    for kw in PLANS:
        plan = compile(**({**kw, "memory_limit": None} if lifted else kw))  # type: ignore[arg-type]
        for dead in sorted(plan.streams):
            if len(plan.topology.stage_group(dead.stage)) < 2:
                continue
            try:
                fixed = repair(plan, dead, validate=False, **({"memory_limit": None} if lifted else {}))
            except RecoveryError:
                tally["refused"] += 1
                continue
            try:
                check(fixed)
                tally["valid"] += 1
            except ValidationError:
                tally["INVALID"] += 1
    return tally


def main() -> None:
    print("| memory limit | repairs | valid | refused (memory) | INVALID (returned, fails check) |")
    print("|---|---|---|---|---|")
    for lifted in (False, True):
        t = outcomes(lifted)
        print(f"| {'lifted' if lifted else 'default'} | {sum(t.values())} | {t['valid']} | {t['refused']} | "
              f"{t['INVALID']} |")


if __name__ == "__main__":
    main()
