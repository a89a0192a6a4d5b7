"""Plans served at once and improved in the background: `ImprovingPlans(cache)`, a `ResilientTrainer` plan source.

A failure set the plan cache lacks would otherwise stall training for a whole compile (tens of seconds at
thousands of workers). `ImprovingPlans.lookup(topology)` returns the cache's plan; on a miss, a plan
repaired from the cache's (`repair.lookup_or_repair`: a local re-route, a fraction of a second) and
starts a full compile of that failure set in a background process, under the repaired plan's memory
limit. `improved(topology)` returns the compiled plan once it is done and only if it is faster than the
repaired one (simulated; None before, or when the compile failed or did not do better), so the trainer
can switch to it at an iteration boundary every worker agrees on (`runtime/fault/agreement.offer_better`).
The comparison simulates the repaired plan once, in the caller (about 2 s at pp = 32, dp = 256; the
compiled plan is simulated in the background process).

`lookup` itself never returns the compiled plan: every worker of a job must run the same plan, and a
worker whose compile finished first would otherwise get a different one. Both answers are deterministic
(the repair, and the compile: greedy, or CP-SAT with its deterministic limit), so every worker computes the
same plans on its own; the switch still compares their digests first.

The compile runs in a fresh interpreter (`python -m schedcomp.improving REQUEST PLAN`), not a fork or a
`multiprocessing` child: a fork of a process holding torch and its communicators is unsafe, and a spawned
child re-imports the user's script. Only the compiler is imported there (no torch).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from schedcomp import fileio
from schedcomp.cache import PlanCache
from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError, SchedcompError, SchedcompTypeError, ScheduleError
from schedcomp.ir import Plan
from schedcomp.memory import FAULT_FREE, MemoryLimit
from schedcomp.repair import lookup_or_repair
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)

__all__ = ["ImprovingPlans"]


@dataclass
class _Compile:
    """One background compile: its process and the files it reads and writes."""

    process: subprocess.Popen[bytes]
    folder: tempfile.TemporaryDirectory[str]
    repaired: Plan  # what `lookup` serves meanwhile
    plan: Plan | None = None
    failed: str | None = None  # why it gave no plan

    @property
    def output(self) -> Path:
        return Path(self.folder.name) / "plan.json"


@dataclass
class ImprovingPlans:
    """The cache's plans, repaired plans for the failure sets it lacks, and full compiles of those in the
    background (see the module docstring). `solver`, `time_limit` and `memory_limit` are `compile`'s, as
    `precompile` built the cache with them."""

    cache: PlanCache
    solver: str = "greedy"
    time_limit: float = 10.0
    memory_limit: MemoryLimit = FAULT_FREE
    _compiles: dict[frozenset[Worker], _Compile] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        from schedcomp.adaptive import SOLVERS

        if not isinstance(self.cache, PlanCache):
            raise SchedcompTypeError(f"ImprovingPlans needs a PlanCache, got {type(self.cache).__name__}")
        if self.solver not in SOLVERS:  # found now, not in a background process after a failure
            raise ScheduleError(f"unknown solver {self.solver!r}: choose one of {', '.join(SOLVERS)}")
        if isinstance(self.time_limit, bool) or not isinstance(self.time_limit, (int, float)) or not (
                0 < self.time_limit < math.inf):
            raise ScheduleError(f"time_limit must be a positive number of seconds, got {self.time_limit!r}")

    def lookup(self, topology: Topology) -> Plan:
        """The cached plan for `topology`'s failed set, or a repaired one (a background compile starts)."""
        try:
            return self.cache.lookup(topology)
        except RecoveryError:
            plan = lookup_or_repair(self.cache, topology, memory_limit=self.memory_limit)  # or raises the miss
        self._start(topology, plan)
        return plan

    def improved(self, topology: Topology) -> Plan | None:
        """The fully compiled plan for `topology`'s failed set once its compile is done; None before, for a
        set the cache held, and when the compile failed (logged once)."""
        job = self._compiles.get(topology.failed)
        if job is None or job.process.poll() is None:
            return None
        if job.plan is None and job.failed is None:
            self._collect(job, topology)
        return job.plan

    def pending(self, topology: Topology) -> bool:
        """Whether a background compile for `topology`'s failed set is still running."""
        job = self._compiles.get(topology.failed)
        return job is not None and job.process.poll() is None

    def close(self) -> None:
        """Stop compiles still running and remove their files."""
        for job in self._compiles.values():
            if job.process.poll() is None:
                job.process.kill()
                job.process.wait()
            job.folder.cleanup()
        self._compiles.clear()

    def _start(self, topology: Topology, repaired: Plan) -> None:
        if topology.failed in self._compiles:
            return
        cache = self.cache
        # the repair's limit (`repair`: the plan's, or a fault-free plan's own peaks), so the two compare
        limit = (repaired.costs.memory_limit if isinstance(self.memory_limit, str) and self.memory_limit == FAULT_FREE
                 else self.memory_limit)
        request = {"pp": cache.pp, "dp": cache.dp, "microbatches": cache.microbatches,
                   "failed": sorted(str(w) for w in topology.failed), "costs": cache.costs.to_dict(),
                   "solver": self.solver, "time_limit": self.time_limit, "memory_limit": limit,
                   "chunks": cache.chunks, "placement": cache.placement}
        folder = tempfile.TemporaryDirectory(prefix="schedcomp-improve-")
        path = Path(folder.name) / "request.json"
        path.write_text(json.dumps(request))
        with open(Path(folder.name) / "stderr.txt", "wb") as errors:  # a file: a full pipe would stall it
            process = subprocess.Popen(self._command(path, Path(folder.name) / "plan.json"),
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
                                       env={**os.environ, "PYTHONHASHSEED": "0"})
        self._compiles[topology.failed] = _Compile(process, folder, repaired)
        log.info("compiling the plan for failed %s in the background", sorted(map(str, topology.failed)))

    def _command(self, request: Path, plan: Path) -> list[str]:
        """The background process: a fresh interpreter running `_compile_request`."""
        return [sys.executable, "-m", "schedcomp.improving", str(request), str(plan)]

    def _collect(self, job: _Compile, topology: Topology) -> None:
        from schedcomp.simulator import simulate

        failed = sorted(map(str, topology.failed))
        try:
            if job.process.returncode != 0:
                stderr = (Path(job.folder.name) / "stderr.txt").read_text(errors="replace").strip()
                raise SchedcompError(stderr.splitlines()[-1] if stderr else f"exit status {job.process.returncode}")
            plan = Plan.from_json(fileio.read_text(job.output, "plan"))
            if plan.topology != topology:
                raise SchedcompError(f"it is for {sorted(map(str, plan.topology.failed))}")
            better = fileio.load_json(fileio.read_text(str(job.output) + ".period", "period"), "period")
            if not isinstance(better, float):
                raise SchedcompError(f"its period file holds {better!r}")
        except (SchedcompError, OSError) as e:
            job.failed = str(e)
            log.warning("the background compile for failed %s gave no plan (%s): keeping the repaired one", failed, e)
            return
        now = simulate(job.repaired).period
        if better < now * (1 - 1e-9):
            job.plan = plan
        else:
            job.failed = f"its period {better:.6g} is no better than the repaired plan's {now:.6g}"
        log.info("the background compile for failed %s: period %.6g, the repaired plan's %.6g", failed, better, now)


def _compile_request(request_path: str, plan_path: str) -> None:
    """The background process: compile the request, write the plan and its simulated period (beside it, as
    `.period`; written first, so a plan file is never there without it)."""
    from schedcomp.compiler import compile
    from schedcomp.simulator import simulate

    r = json.loads(Path(request_path).read_text())
    limit = r["memory_limit"]
    plan = compile(r["pp"], r["dp"], r["microbatches"], failed=[Worker.parse(w) for w in r["failed"]],
                   schedule="adaptive", costs=CostModel.from_dict(r["costs"]), solver=r["solver"],
                   time_limit=r["time_limit"], memory_limit=tuple(limit) if isinstance(limit, list) else limit,
                   chunks=r["chunks"], placement=r["placement"])
    fileio.write_atomic(plan_path + ".period", json.dumps(simulate(plan).period))
    fileio.write_atomic(plan_path, plan.to_json())


def _main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m schedcomp.improving REQUEST.json PLAN.json", file=sys.stderr)
        return 2
    try:
        _compile_request(*argv)
    except SchedcompError as e:
        print(f"schedcomp.improving: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

