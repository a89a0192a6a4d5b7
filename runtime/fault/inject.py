"""Fault injection for chaos tests and benchmarks: a worker kills itself at a chosen instruction."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from schedcomp.ir import Instruction
from schedcomp.topology import Worker

log = logging.getLogger(__name__)

Hook = Callable[[int, int, Instruction], None]  # (iteration, instruction index, instruction)


def kill_at(victims: dict[Worker, tuple[int, int]], me: Worker, incarnation: int = 0) -> Hook | None:
    """A `before` hook that SIGKILLs this process at the first instruction at or after (iteration, index).

    For chaos tests: the harness picks victims and points (seeded); only the first incarnation dies.
    """
    target = victims.get(me)
    if target is None or incarnation != 0:
        return None

    def hook(iteration: int, index: int, ins: Instruction) -> None:
        if (iteration, index) >= target:
            log.warning("worker %s: killing itself before %s (iteration %d, instruction %d)", me, ins,
                        iteration, index)
            os.kill(os.getpid(), signal.SIGKILL)

    return hook
