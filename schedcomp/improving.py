"""Plans served at once and improved in the background: `ImprovingPlans(cache)`, a `ResilientTrainer` plan source.

A failure set the plan cache lacks would otherwise stall training for a whole compile (tens of seconds at
thousands of workers). `ImprovingPlans.lookup(topology)` returns the cache's plan; on a miss, a plan
repaired from the cache's (`repair.lookup_or_repair`: a local re-route, a fraction of a second) and
starts a full compile of that failure set in a background process, under the repaired plan's memory
limit. `improved(topology)` returns the compiled plan once it is done and only if it is faster than the
repaired one (simulated; None before, or when the compile failed or did not do better), so the trainer
can switch to it at an iteration boundary every worker agrees on (`runtime/fault/agreement.offer_better`).
For a cache precompiled with `recut` the compile may re-cut micro-batches too; a repaired plan keeps whole
ones (`repair` moves whole micro-batches, so it starts from a cached plan that keeps them).

`lookup` itself never returns the compiled plan: every worker of a job must run the same plan, and a
worker whose compile finished first would otherwise get a different one. Both answers are deterministic
(the repair, and the compile: greedy, or CP-SAT with its deterministic limit), so every worker computes the
same plans on its own; the switch still compares their digests first.

The background process is a fresh interpreter (`python -m schedcomp.improving`, on this process's
`sys.path`, so it imports the same schedcomp): a fork of a process holding torch and its communicators is
unsafe, and a `multiprocessing` spawn re-imports the user's script. It imports the compiler only (no
torch), simulates both plans (the repaired one re-derived from the cache's files when the cache was loaded
from a directory, so the training thread does not pay for it) and writes its result into a folder of its
own. It watches its parent: if the parent dies (a worker is killed, fenced, or leaves with `os._exit`), it
removes the folder and exits, so nothing outlives a worker. A compile for an older failure set is stopped
when a newer one starts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedcomp import fileio
from schedcomp.cache import PlanCache
from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, RecoveryError, SchedcompError, SchedcompTypeError, ScheduleError
from schedcomp.ir import Plan
from schedcomp.layers import LayerCosts, moved_limit
from schedcomp.memory import FAULT_FREE, MemoryLimit, is_fault_free
from schedcomp.partition import Partition
from schedcomp.repair import lookup_or_repair
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)

__all__ = ["ImprovingPlans"]

_PLAN, _RESULT, _REQUEST, _ERRORS = "plan.json", "result.json", "request.json", "stderr.txt"


@dataclass
class _Compile:
    """One background compile: its process, its folder, and what came of it."""

    process: subprocess.Popen[bytes]
    folder: Path
    repaired: Plan | None  # what `lookup` serves meanwhile (dropped once compared)
    plan: Plan | None = None
    failed: str | None = None  # why it gave no plan

    def done(self) -> bool:
        """Its result is written, or it exited without one (it lingers after writing, watching its parent)."""
        return (self.folder / _PLAN).exists() or self.process.poll() is not None or self.failed is not None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class ImprovingPlans:
    """The cache's plans, repaired plans for the failure sets it lacks, and full compiles of those in the
    background (see the module docstring). `solver`, `time_limit` and `memory_limit` are `compile`'s, as
    `precompile` built the cache with them (`memory_limit` also goes to the repair)."""

    cache: PlanCache
    solver: str = "greedy"
    time_limit: float = 10.0
    memory_limit: MemoryLimit = FAULT_FREE
    _served: dict[frozenset[Worker], Plan] = field(default_factory=dict, init=False, repr=False)
    _compiles: dict[frozenset[Worker], _Compile] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        from schedcomp.adaptive import SOLVERS

        if not isinstance(self.cache, PlanCache):
            raise SchedcompTypeError(f"ImprovingPlans needs a PlanCache, got {type(self.cache).__name__}")
        if self.cache.chunks > 1:  # `repair` re-routes one stage per worker
            raise ScheduleError(f"ImprovingPlans repairs plans of one stage per worker, and this cache's have "
                                f"{self.cache.chunks} chunks: pass the PlanCache itself (precompile every failure set)")
        if self.solver not in SOLVERS:  # found now, not in a background process after a failure
            raise ScheduleError(f"unknown solver {self.solver!r}: choose one of {', '.join(SOLVERS)}")
        if isinstance(self.time_limit, bool) or not isinstance(self.time_limit, (int, float)) or not (
                0 < self.time_limit < math.inf):
            raise ScheduleError(f"time_limit must be a positive number of seconds, got {self.time_limit!r}")

    def lookup(self, topology: Topology) -> Plan:
        """The cached plan for `topology`'s failed set, or a repaired one (the same object on every call;
        a background compile starts)."""
        try:
            return self.cache.lookup(topology)
        except RecoveryError:
            served = self._served.get(topology.failed)
            if served is None:  # the miss itself is raised when nothing can be repaired
                served = lookup_or_repair(self.cache, topology, memory_limit=self.memory_limit)
                self._served[topology.failed] = served
        self._start(topology, served)
        return served

    def improved(self, topology: Topology) -> Plan | None:
        """The fully compiled plan for `topology`'s failed set once its compile is done and if it is faster
        than the repaired plan; None before, for a set the cache held, and otherwise (logged once)."""
        job = self._compiles.get(topology.failed)
        if job is None or not job.done():
            return None
        if job.plan is None and job.failed is None:
            self._collect(job, topology)
        return job.plan

    def pending(self, topology: Topology) -> bool:
        """Whether a background compile for `topology`'s failed set is still running."""
        job = self._compiles.get(topology.failed)
        return job is not None and not job.done()

    def close(self) -> None:
        """Stop compiles still running and remove their folders."""
        for job in self._compiles.values():
            job.stop()
        self._compiles.clear()

    def _start(self, topology: Topology, repaired: Plan) -> None:
        if topology.failed in self._compiles:
            return
        for stale in self._compiles.values():  # for an older failure set: its plan will not be asked for
            stale.stop()
        cache = self.cache
        # the repair's limit (`repair`: the plan's, or a fault-free plan's own peaks), so the two compare
        limit = repaired.costs.memory_limit if is_fault_free(self.memory_limit) else self.memory_limit
        if cache.layers is not None and is_fault_free(self.memory_limit):
            try:
                limit = _job_limit(cache.layers, cache.partition, repaired)  # per stage of the job's partition
            except MemoryLimitError as e:  # an optional speed-up must never break recovery
                log.warning("no background compile for failed %s (%s): keeping the repaired plan",
                            sorted(map(str, topology.failed)), e)
                return
        request = {"pp": cache.pp, "dp": cache.dp, "microbatches": cache.microbatches,
                   "failed": sorted(str(w) for w in topology.failed), "costs": cache.costs.to_dict(),
                   # a cache of re-partitioning plans: the compile may move layers too
                   "layers": cache.layers.to_dict() if cache.layers is not None else None,
                   "partition": list(cache.partition) if cache.partition is not None else None,
                   "solver": self.solver, "time_limit": self.time_limit, "memory_limit": limit,
                   "chunks": cache.chunks, "placement": cache.placement, "recut": cache.recut,
                   "cache": str(cache.root) if cache.root is not None else None,
                   "repair_memory_limit": self.memory_limit}
        try:
            folder = Path(tempfile.mkdtemp(prefix="schedcomp-improve-"))
            (folder / _REQUEST).write_text(json.dumps(request))
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            with open(folder / _ERRORS, "wb") as errors:  # a file: a full pipe would stall it
                process = subprocess.Popen(self._command(folder), cwd=folder, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=errors, env=env)
        except (OSError, TypeError, ValueError) as e:  # an optional speed-up must never break recovery
            log.warning("cannot start the background compile for failed %s (%s): keeping the repaired plan",
                        sorted(map(str, topology.failed)), e)
            return
        self._compiles = {topology.failed: _Compile(process, folder, repaired)}
        log.info("compiling the plan for failed %s in the background", sorted(map(str, topology.failed)))

    def _command(self, folder: Path) -> list[str]:
        """The background process: a fresh interpreter running `_compile_request` on `folder`."""
        return [sys.executable, "-m", "schedcomp.improving", str(folder), str(os.getpid())]

    def _collect(self, job: _Compile, topology: Topology) -> None:
        failed = sorted(map(str, topology.failed))
        try:
            if not (job.folder / _PLAN).exists():
                stderr = (job.folder / _ERRORS).read_text(errors="replace").strip()
                raise SchedcompError(stderr.splitlines()[-1] if stderr else f"exit status {job.process.returncode}")
            plan = Plan.from_json(fileio.read_text(job.folder / _PLAN, "plan"))
            if plan.topology != topology:
                raise SchedcompError(f"it is for {sorted(map(str, plan.topology.failed))}")
            result = fileio.load_json(fileio.read_text(job.folder / _RESULT, "result"), "result")
            better, now = float(result["period"]), result.get("repaired_period")
            if now is None and job.repaired is not None:  # a cache held in memory only: simulated here
                from schedcomp.simulator import simulate

                now = simulate(job.repaired).period
        except (SchedcompError, OSError, KeyError, TypeError, ValueError) as e:
            job.failed = str(e)
            log.warning("the background compile for failed %s gave no plan (%s): keeping the repaired one", failed, e)
            return
        finally:
            job.repaired = None
            job.stop()  # the process exits once its folder is gone
        if now is not None and better < float(now) * (1 - 1e-9):
            job.plan = plan
            log.info("the background compile for failed %s: period %.6g against the repaired plan's %.6g", failed,
                     better, now)
        else:
            job.failed = f"its period {better:.6g} is no better than the repaired plan's {now:.6g}"
            log.info("the background compile for failed %s is no better: keeping the repaired plan (%s)", failed,
                     job.failed)


def _compile_request(folder: Path) -> None:
    """The background process's work: compile the request, simulate it (and the repaired plan, when the cache
    is on disk), write the result and then the plan (each atomically: a plan file means a complete result)."""
    from schedcomp.compiler import compile
    from schedcomp.simulator import simulate

    r: dict[str, Any] = json.loads((folder / _REQUEST).read_text())
    failed = [Worker.parse(w) for w in r["failed"]]
    layers = LayerCosts.from_dict(r["layers"]) if r.get("layers") is not None else None
    plan = compile(r["pp"], r["dp"], r["microbatches"], failed=failed, schedule="adaptive",
                   costs=None if layers is not None else CostModel.from_dict(r["costs"]), solver=r["solver"],
                   time_limit=r["time_limit"], memory_limit=_as_limit(r["memory_limit"]), chunks=r["chunks"],
                   placement=r["placement"], layers=layers, partition=r.get("partition"), recut=r.get("recut", False),
                   reform="never")  # (a re-formed switch is only ever a cache's precompiled plan)
    result: dict[str, Any] = {"period": simulate(plan).period, "repaired_period": None}
    if r["cache"] is not None:
        cache = PlanCache.load(r["cache"])
        repaired = lookup_or_repair(cache, failed, memory_limit=_as_limit(r["repair_memory_limit"]))
        result["repaired_period"] = simulate(repaired).period
    fileio.write_atomic(folder / _RESULT, json.dumps(result))
    fileio.write_atomic(folder / _PLAN, plan.to_json())


def _job_limit(layers: LayerCosts, job_partition: Partition | None, repaired: Plan) -> MemoryLimit:
    """The repaired plan's per-stage limits carried back to the job's partition (a stage's device total
    kept: its static memory under the repaired plan's cut added back, the job cut's taken off), so the
    compile, which may cut elsewhere, is held to what the repaired plan was."""
    limit = repaired.costs.memory_limit
    if limit is None or job_partition is None or repaired.partition is None or repaired.partition == job_partition:
        return limit
    # the layers' rule of a re-partition (`layers.moved_limit`), from the repaired plan's cut to the job's
    return moved_limit(layers, job_partition, repaired.costs, repaired.partition)


def _as_limit(value: Any) -> MemoryLimit:
    """A memory limit read back from JSON (per-stage limits come back as a list)."""
    return tuple(value) if isinstance(value, list) else value


def _watch(folder: Path, parent: int) -> None:
    """Exit once the parent is gone (removing the folder it can no longer remove) or has removed the folder."""
    while True:
        if os.getppid() != parent:
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(3)
        if not folder.exists():
            os._exit(0)
        time.sleep(0.2)


def _main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m schedcomp.improving FOLDER PARENT_PID", file=sys.stderr)
        return 2
    folder, parent = Path(argv[0]), int(argv[1])
    threading.Thread(target=_watch, args=(folder, parent), daemon=True).start()
    try:
        _compile_request(folder)
    except SchedcompError as e:
        print(f"schedcomp.improving: {e}", file=sys.stderr)
        return 2
    _watch(folder, parent)  # linger until the parent has read the result (or is gone)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
