"""Plans for failure scenarios, compiled ahead of time and looked up when a failure happens.

Pipelines are interchangeable: relabelling them maps a plan for one failure set to a plan for
another. So a failure set is reduced to a canonical form: each pipeline's signature is its sorted
tuple of failed stages, after its speed class (its workers' speed factors, which break the symmetry
when they differ); pipelines are sorted by signature and renumbered in that order. `precompile` compiles one plan per
canonical scenario; `PlanCache.lookup(failed)` canonicalises the concrete failure set, takes the
canonical plan and renames its pipelines back, in time linear in the plan's size and with no solving.

On disk a cache is a directory: `index.json` (job shape, cost model, one entry per scenario) and one
plan JSON per scenario, read on first use.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schedcomp.costs import CostModel
from schedcomp.errors import PlanFormatError, RecoveryError, SchedcompError
from schedcomp.ir import Instruction, Op, Plan
from schedcomp.memory import FAULT_FREE, MemoryLimit
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT = "schedcomp-plan-cache"
VERSION = 1

Failed = tuple[tuple[int, int], ...]
"""Canonical failed workers: sorted (pipeline, stage) pairs after renumbering the pipelines."""
Key = tuple[Failed, tuple[int, ...]]
"""A canonical scenario: the failed workers, and each canonical pipeline's speed class (the index of its
workers' speed factors among the job's distinct ones; empty when all pipelines run at one speed)."""


@dataclass(frozen=True)
class Canonical:
    """A failure set in canonical form; canonical pipeline i is concrete pipeline perm[i]."""

    failed: Failed
    classes: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def key(self) -> Key:
        return (self.failed, self.classes)


def canonical(topology: Topology, costs: CostModel | None = None) -> Canonical:
    """Canonical form of `topology`'s failure set (see the module docstring)."""
    pp, dp = topology.pp, topology.dp
    speed = costs.speed if costs is not None else {}
    if speed:
        speeds = [tuple(speed.get(Worker(d, s), 1.0) for s in range(pp)) for d in range(dp)]
        distinct = sorted(set(speeds))
        cls = [distinct.index(v) for v in speeds]
    else:  # one speed class: skip the pp * dp look-ups (the goodput simulator canonicalises often)
        distinct, cls = [()], [0] * dp
    stages: dict[int, list[int]] = {}
    for w in topology.failed:
        stages.setdefault(w.pipeline, []).append(w.stage)
    failed = [tuple(sorted(stages.get(d, ()))) for d in range(dp)]
    perm = tuple(sorted(range(dp), key=lambda d: (cls[d], failed[d], d)))
    key = tuple(sorted((i, s) for i, d in enumerate(perm) for s in failed[d]))
    classes = tuple(cls[d] for d in perm) if len(distinct) > 1 else ()
    return Canonical(key, classes, perm)


def canonical_costs(costs: CostModel, perm: tuple[int, ...]) -> CostModel:
    """The cost model seen from the canonical numbering (canonical pipeline i is concrete perm[i])."""
    if not costs.speed:
        return costs
    inverse = {d: i for i, d in enumerate(perm)}
    speed = {Worker(inverse[w.pipeline], w.stage): v for w, v in costs.speed.items()}
    return CostModel(**{**costs.__dict__, "speed": speed})


def key_name(key: Key) -> str:
    """A file-name-safe name for a scenario: `healthy` or `f0.3-1.5` (pipeline.stage), then `-c0.0.1`
    (the speed classes) when pipelines differ in speed."""
    failed, classes = key
    name = "healthy" if not failed else "f" + "-".join(f"{d}.{s}" for d, s in failed)
    return name + ("-c" + ".".join(map(str, classes)) if classes else "")


def relabel(plan: Plan, perm: Mapping[int, int] | tuple[int, ...]) -> Plan:
    """Rename pipeline d of `plan` to perm[d] everywhere: workers, ops, peers, failures, speed factors."""
    mapping = dict(enumerate(perm)) if isinstance(perm, tuple) else dict(perm)

    def worker(w: Worker) -> Worker:
        return Worker(mapping[w.pipeline], w.stage)

    ops: dict[Op, Op] = {}

    def op(o: Op | None) -> Op | None:
        if o is None:
            return None
        new = ops.get(o)
        if new is None:
            new = ops[o] = Op(o.kind, mapping[o.pipeline], o.microbatch, o.stage)
        return new

    streams = {
        worker(w): tuple(Instruction(i.kind, op(i.op), worker(i.peer) if i.peer is not None else None) for i in stream)
        for w, stream in plan.streams.items()
    }
    topo = plan.topology
    costs = plan.costs
    if costs.speed:
        costs = CostModel(**{**costs.__dict__, "speed": {worker(w): v for w, v in costs.speed.items()}})
    return Plan(
        topology=Topology(topo.pp, topo.dp, frozenset(worker(w) for w in topo.failed)),
        costs=costs,
        microbatches=plan.microbatches,
        streams=streams,
        family=plan.family,
        solver=plan.solver,
        lower_bound=plan.lower_bound,
        meta=dict(plan.meta),
    )


def scenarios(pp: int, dp: int, max_failures: int, costs: CostModel | None = None) -> list[Canonical]:
    """Every distinct recoverable failure scenario with at most `max_failures` failed workers
    (no failures included), canonical, in a deterministic order (fewest failures first)."""
    patterns = [p for size in range(1, min(max_failures, pp) + 1) for p in itertools.combinations(range(pp), size)]
    # Pipelines with equal speed signatures are interchangeable: choose patterns per class.
    speed = costs.speed if costs is not None else {}
    classes: dict[tuple[float, ...], list[int]] = {}
    for d in range(dp):
        classes.setdefault(tuple(speed.get(Worker(d, s), 1.0) for s in range(pp)), []).append(d)
    members = list(classes.values())
    seen: dict[Key, Canonical] = {}

    def choose(ci: int, budget: int, failed: list[Worker]) -> Iterator[list[Worker]]:
        if ci == len(members):
            yield failed
            return
        pipes = members[ci]
        for count in range(0, min(len(pipes), budget) + 1):
            for combo in itertools.combinations_with_replacement(range(len(patterns)), count):
                size = sum(len(patterns[i]) for i in combo)
                if size > budget:
                    continue
                chosen = [Worker(pipes[j], s) for j, i in enumerate(combo) for s in patterns[i]]
                yield from choose(ci + 1, budget - size, failed + chosen)

    for failed in choose(0, max_failures, []):
        per_stage = [0] * pp
        for w in failed:
            per_stage[w.stage] += 1
        if max(per_stage, default=0) >= dp:
            continue  # a stage with no live worker: needs a checkpoint, not a plan
        c = canonical(Topology.of(pp, dp, failed), costs)
        seen.setdefault(c.key, c)
    return sorted(seen.values(), key=lambda c: (len(c.failed), c.key))


ProgressFn = Callable[[int, int, str], None]


@dataclass
class PlanCache:
    """Plans for one job shape (pp, dp, micro-batches, cost model), keyed by canonical failure set.

    Build one with `precompile`, or `PlanCache.load(directory)`; `lookup(failed)` returns the plan
    for any failure set equivalent to a stored one."""

    pp: int
    dp: int
    microbatches: int
    costs: CostModel
    max_failures: int = 0
    plans: dict[Key, Plan] = field(default_factory=dict)
    files: dict[Key, Path] = field(default_factory=dict)

    def __contains__(self, failed: object) -> bool:
        try:
            key = canonical(self._topology(failed), self.costs).key  # type: ignore[arg-type]
        except SchedcompError:
            return False
        return key in self.plans or key in self.files

    def __len__(self) -> int:
        return len(set(self.plans) | set(self.files))

    def keys(self) -> list[Key]:
        return sorted(set(self.plans) | set(self.files), key=lambda k: (len(k[0]), k))

    def _topology(self, failed: Iterable[Worker | tuple[int, int]] | Topology) -> Topology:
        if isinstance(failed, Topology):
            if (failed.pp, failed.dp) != (self.pp, self.dp):
                raise RecoveryError(f"this cache is for pp={self.pp} dp={self.dp}, not pp={failed.pp} dp={failed.dp}: "
                                    "precompile one for this job")
            return failed
        return Topology.of(self.pp, self.dp, failed)

    def lookup(self, failed: Iterable[Worker | tuple[int, int]] | Topology) -> Plan:
        """The plan for the concrete failure set `failed` (workers or (pipeline, stage) pairs).

        Raises `RecoveryError` when a stage has lost every worker (restart from a checkpoint) or when
        the scenario was not precompiled."""
        topology = self._topology(failed)
        for s in range(self.pp):
            if not topology.stage_group(s):
                raise RecoveryError(f"every worker of stage {s} has failed, so its micro-batches cannot be re-routed: "
                                    "recovery needs a checkpoint")
        c = canonical(topology, self.costs)
        plan = self._canonical_plan(c.key)
        return relabel(plan, c.perm)

    def memory_report(self) -> list[dict[str, Any]]:
        """Per scenario, its failed workers and its peak memory against its limit (`memory.limit_facts`);
        reads plans not yet in memory."""
        from schedcomp.memory import limit_facts

        return [{"failed": [f"{d}:{s}" for d, s in key[0]], **limit_facts(self._canonical_plan(key))}
                for key in self.keys()]

    def preload(self) -> None:
        """Read every plan from disk now, so a lookup at failure time only renames pipelines."""
        for key in self.keys():
            self._canonical_plan(key)

    def _canonical_plan(self, key: Key) -> Plan:
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        path = self.files.get(key)
        if path is None:
            n = len(key[0])
            raise RecoveryError(
                f"no precompiled plan for this failure set ({n} failed worker{'s' if n != 1 else ''}; the cache covers "
                f"up to {self.max_failures}): precompile with --max-failures {n} or compile it with schedcomp.compiler"
            )
        try:
            plan = Plan.from_json(path.read_text())
        except OSError as exc:
            raise PlanFormatError(f"cannot read cached plan {path}: {exc.strerror or exc}") from None
        self.plans[key] = plan
        return plan

    # ---- disk -------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Write every plan held in memory and the index to `directory` (created if missing)."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        for key in self.keys():
            path = root / (key_name(key) + ".json")
            if key in self.plans and not (self.files.get(key) == path and path.exists()):
                path.write_text(self.plans[key].to_json())
            self.files[key] = path
        index = {
            "format": FORMAT, "version": VERSION, "pp": self.pp, "dp": self.dp, "microbatches": self.microbatches,
            "max_failures": self.max_failures, "costs": self.costs.to_dict(),
            "scenarios": [{"failed": [f"{d}:{s}" for d, s in key[0]], "classes": list(key[1]),
                           "file": key_name(key) + ".json"} for key in self.keys()],
        }
        (root / INDEX).write_text(json.dumps(index, indent=1) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> PlanCache:
        """Open a cache written by `save` / `precompile`; plans are read on first lookup."""
        root = Path(directory)
        try:
            data = json.loads((root / INDEX).read_text())
        except OSError as exc:
            raise PlanFormatError(f"cannot read plan cache {root / INDEX}: {exc.strerror or exc}: "
                                  "create one with schedcomp precompile") from None
        except json.JSONDecodeError as exc:
            raise PlanFormatError(f"plan cache index {root / INDEX} is not valid JSON (line {exc.lineno})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
            raise PlanFormatError(f"{root / INDEX} is not a version {VERSION} schedcomp plan cache: re-run precompile")
        try:
            files = {}
            for entry in data["scenarios"]:
                failed = tuple(sorted((w.pipeline, w.stage) for w in map(Worker.parse, entry["failed"])))
                files[(failed, tuple(int(c) for c in entry.get("classes", ())))] = root / entry["file"]
            return cls(pp=int(data["pp"]), dp=int(data["dp"]), microbatches=int(data["microbatches"]),
                       costs=CostModel.from_dict(data["costs"]), max_failures=int(data["max_failures"]), files=files)
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFormatError(f"malformed plan cache index {root / INDEX}: {exc}") from None


def precompile(
    pp: int,
    dp: int,
    microbatches: int,
    max_failures: int,
    *,
    costs: CostModel | None = None,
    solver: str = "greedy",
    time_limit: float = 10.0,
    directory: str | Path | None = None,
    progress: ProgressFn | None = None,
    jobs: int = 1,
    memory_limit: MemoryLimit = FAULT_FREE,
) -> PlanCache:
    """Compile a plan for every distinct scenario with at most `max_failures` failures; write them to
    `directory` when given (each plan as soon as it is compiled, then the index). `progress(done,
    total, name)` is called after each plan. `jobs` > 1 compiles in that many processes, which write
    their plans themselves, so the parent does not parse them. `memory_limit` is `compile`'s (default:
    every plan within fault-free ZB-H1's per-stage peak)."""
    if max_failures < 0:
        raise SchedcompError(f"max_failures must be at least 0, got {max_failures}")
    costs = CostModel.uniform(pp) if costs is None else costs
    todo = scenarios(pp, dp, max_failures, costs)
    cache = PlanCache(pp, dp, microbatches, costs, max_failures)
    root = Path(directory) if directory is not None else None
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    args = [(pp, dp, microbatches, c.failed, canonical_costs(costs, c.perm), solver, time_limit, memory_limit, c.key,
             str(root / (key_name(c.key) + ".json")) if root is not None else None) for c in todo]
    if jobs > 1 and len(todo) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for i, (key, plan) in enumerate(pool.imap(_compile_one, args)):
                _record(cache, key, plan, root)
                if progress:
                    progress(i + 1, len(todo), key_name(key))
    else:
        for i, a in enumerate(args):
            key, plan = _compile_one(a, keep=True)
            _record(cache, key, plan, root)
            if progress:
                progress(i + 1, len(todo), key_name(key))
    log.info("precompiled %d scenarios in %.1f s", len(todo), time.perf_counter() - began)
    if root is not None:
        cache.save(root)
    return cache


def _record(cache: PlanCache, key: Key, plan: Plan | None, root: Path | None) -> None:
    if plan is not None:
        cache.plans[key] = plan
    if root is not None:
        cache.files[key] = root / (key_name(key) + ".json")


def _compile_one(args: tuple[Any, ...], keep: bool = False) -> tuple[Key, Plan | None]:
    """Compile one scenario; write it to its file when there is one, and return the plan only when it is
    not written (or `keep`), so worker processes send back just the key."""
    from schedcomp.compiler import compile

    pp, dp, microbatches, failed, costs, solver, time_limit, memory_limit, key, path = args
    plan = compile(pp, dp, microbatches, failed=failed, schedule="adaptive", costs=costs, solver=solver,
                   time_limit=time_limit, memory_limit=memory_limit)
    if path is None:
        return key, plan
    Path(path).write_text(plan.to_json())
    return key, plan if keep else None
