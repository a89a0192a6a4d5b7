"""Safety limits on the size of the work schedcomp accepts, checked before anything is allocated.

A typo (`--dp 1000000`, `-m 1000000000`) or a hostile file (a 1 KB plan declaring a billion
pipelines, a trace at iteration 10^18) must be refused at once, naming the limit, rather than run for
minutes or exhaust memory. Every limit is generous for real jobs and can be raised with its
environment variable (documented in README.md, "Limits"):

| limit                   | default    | environment variable            |
|-------------------------|------------|---------------------------------|
| workers (pp x dp)       | 262,144    | SCHEDCOMP_MAX_WORKERS           |
| micro-batches           | 65,536     | SCHEDCOMP_MAX_MICROBATCHES      |
| slots (pp x dp x M)     | 4,194,304  | SCHEDCOMP_MAX_SLOTS             |
| simulated/traced iters  | 1,000,000  | SCHEDCOMP_MAX_ITERATIONS        |
| simulated instructions  | 67,108,864 | SCHEDCOMP_MAX_SIM_INSTRUCTIONS  |
| precompiled scenarios   | 10,000     | SCHEDCOMP_MAX_SCENARIOS         |
| file size (bytes)       | 1 GiB      | SCHEDCOMP_MAX_FILE_BYTES (fileio)|
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from schedcomp.errors import LimitError


@dataclass(frozen=True)
class Limit:
    name: str  # what is counted, plural: "workers"
    default: int
    env: str

    def value(self) -> int:
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default
        try:
            value = int(raw)
        except ValueError:
            raise LimitError(f"{self.env}={raw!r} is not a whole number") from None
        if value < 1:
            raise LimitError(f"{self.env}={raw!r} must be at least 1")
        return value

    def check(self, count: int, what: str) -> None:
        """Refuse `count` (described by `what`, e.g. "pp=2 x dp=1000000") above the limit."""
        top = self.value()
        if count > top:
            raise LimitError(f"{what} is {count:,} {self.name}, over the limit of {top:,}: "
                             f"check the numbers, or raise the limit with {self.env}={count}")


WORKERS = Limit("workers", 1 << 18, "SCHEDCOMP_MAX_WORKERS")
MICROBATCHES = Limit("micro-batches", 1 << 16, "SCHEDCOMP_MAX_MICROBATCHES")
SLOTS = Limit("slots (pipelines x micro-batches x stages)", 1 << 22, "SCHEDCOMP_MAX_SLOTS")
ITERATIONS = Limit("iterations", 1_000_000, "SCHEDCOMP_MAX_ITERATIONS")
SIM_INSTRUCTIONS = Limit("instructions (iterations x plan size)", 1 << 26, "SCHEDCOMP_MAX_SIM_INSTRUCTIONS")
SCENARIOS = Limit("failure scenarios", 10_000, "SCHEDCOMP_MAX_SCENARIOS")

# Cost-model numbers: every time is at most MAX_COST and every speed factor within
# [MIN_SPEED, 1 / MIN_SPEED], so sums over a whole plan and the solvers' integer scaling stay finite
# (1e308 costs or a 1e-320 speed factor overflowed to inf in the solvers).
MAX_COST = 1e15
MIN_SPEED = 1e-6


def check_job(pp: int, dp: int, microbatches: int | None = None) -> None:
    """Refuse a job shape beyond the limits; called before any per-worker or per-slot allocation."""
    WORKERS.check(pp * dp, f"pp={pp} x dp={dp}")
    if microbatches is not None:
        MICROBATCHES.check(microbatches, f"microbatches={microbatches}")
        SLOTS.check(pp * dp * microbatches, f"pp={pp} x dp={dp} x microbatches={microbatches}")
