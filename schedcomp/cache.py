"""Plans for failure scenarios, compiled ahead of time and looked up when a failure happens.

Pipelines are interchangeable, so a failure set is reduced to a canonical form (`schedcomp.scenarios`).
`precompile` compiles one plan per canonical scenario; `PlanCache.lookup(failed)` canonicalises the
concrete failure set, takes the canonical plan and renames its pipelines back, in time linear in the
plan's size and with no solving.

On disk a cache is a directory: `index.json` (job shape, cost model, one entry per scenario with the
SHA-256 of its plan file, its cut of micro-batches if it re-cuts, and its per-pipeline partitions if it
re-forms pipelines: what a job must know of its plans before reading them) and one plan JSON per scenario, read
on first use. Nothing read from disk is trusted: the index is size- and depth-bounded and type-checked; a
plan file must be named exactly as its scenario (so no `..`, absolute path or other directory), be a
regular file inside the cache directory (no symlink out, no device), match its digest, and hold a plan
for the index's job and scenario (its cut and partitions) that passes `check`, before `lookup` returns it. All files
are written atomically.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from schedcomp import cachefiles, fileio, limits
from schedcomp.check import check
from schedcomp.choice import AUTO, reform_mode
from schedcomp.costs import CostModel
from schedcomp.cut import NO_CUT, Cut
from schedcomp.errors import (
    CostModelError,
    PlanFormatError,
    RecoveryError,
    SchedcompError,
    SchedcompTypeError,
)
from schedcomp.ir import Plan
from schedcomp.layers import LayerCosts, stage_costs
from schedcomp.memory import FAULT_FREE, MemoryLimit
from schedcomp.partition import Partition, as_partition
from schedcomp.partitions import Partitions
from schedcomp.scenarios import (  # canonical forms of failure sets; also re-exported from here
    Key,
    canonical,
    canonical_costs,
    key_name,
    relabel,
    scenarios,
)
from schedcomp.topology import LOOP, Topology, Worker

log = logging.getLogger(__name__)

INDEX = "index.json"
FORMAT = "schedcomp-plan-cache"
VERSION = 1
VERSION_LAYERS = 2
"""The index of a cache compiled with per-layer costs: `"layers"` (the layer costs) and `"partition"` (the
job's) besides the stage model; each plan carries its own partition (`schedcomp.repartition`)."""

ProgressFn = Callable[[int, int, str], None]


@dataclass
class PlanCache:
    """Plans for one job shape (pp, dp, micro-batches, cost model, chunks per worker and their
    placement), keyed by canonical failure set.

    Build one with `precompile`, or `PlanCache.load(directory)`; `lookup(failed)` returns the plan
    for any failure set equivalent to a stored one."""

    pp: int
    dp: int
    microbatches: int
    costs: CostModel
    max_failures: int = 0
    plans: dict[Key, Plan] = field(default_factory=dict)
    files: dict[Key, Path] = field(default_factory=dict)
    digests: dict[Key, str] = field(default_factory=dict)  # SHA-256 of each plan file
    root: Path | None = None  # the directory the files must lie in (set by `load` / `save`)
    chunks: int = 1
    placement: str = LOOP
    layers: LayerCosts | None = None
    """Per-layer costs, when the plans may re-partition the layers (`costs` is then the job's stage model)."""
    partition: Partition | None = None
    """The job's partition, with `layers`."""
    recut: bool = False
    """Whether failure plans may re-cut micro-batches (`precompile(recut=True)`)."""
    cuts: dict[Key, Cut] = field(default_factory=dict)
    """The cut of each scenario whose plan re-cuts, as the index gives it; a plan read from disk must have its
    scenario's, so a job knows from the index alone what its plans cut (`runtime.fault.policies.recuts_of`)."""
    partitions: dict[Key, Partitions] = field(default_factory=dict)
    """The per-pipeline partitions of each scenario whose plan re-forms pipelines, as the index gives them (its
    cut then has shares); a plan read from disk must have its scenario's, so a job knows from the index alone
    which plans re-form pipelines (`runtime.fault.policies.may_reform`)."""

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
            if (failed.pp, failed.dp, failed.chunks) != (self.pp, self.dp, self.chunks) or (
                    self.chunks > 1 and failed.placement != self.placement):
                raise RecoveryError(f"this cache is for {self._shape()}, not pp={failed.pp} dp={failed.dp}"
                                    f"{_chunk_text(failed.chunks, failed.placement)}: precompile one for this job")
            return failed
        return Topology.of(self.pp, self.dp, failed, self.chunks, self.placement)

    def _shape(self) -> str:
        return f"pp={self.pp} dp={self.dp}{_chunk_text(self.chunks, self.placement)}"

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
        plan = self._read_plan(key, path)
        self.plans[key] = plan
        return plan

    def _read_plan(self, key: Key, path: Path) -> Plan:
        """Read and validate one cached plan (see the module docstring); PlanFormatError naming the file."""
        data = cachefiles.read_verified(path, self.root, self.digests.get(key))
        try:
            plan = Plan.from_json(data.decode("utf-8", errors="replace"))
            topo = plan.topology
            shape = (topo.pp, topo.dp, plan.microbatches, topo.chunks, topo.placement)
            if shape != (self.pp, self.dp, self.microbatches, self.chunks, self.placement):
                raise PlanFormatError(f"it is for pp={topo.pp} dp={topo.dp}{_chunk_text(topo.chunks, topo.placement)} "
                                      f"M={plan.microbatches}, not the cache's {self._shape()} M={self.microbatches}")
            if _job_costs(plan.costs, self.costs) != _job_costs(self._expected_costs(plan), self.costs):
                raise PlanFormatError("its cost model differs from the index's")
            if canonical(topo, plan.costs).key != key:
                failed = ",".join(str(w) for w in sorted(topo.failed)) or "none"
                raise PlanFormatError(f"it is for failed workers {failed}, not scenario {key_name(key)}")
            cachefiles.check_entry(plan, self.cuts.get(key, NO_CUT), self.partitions.get(key))
            check(plan)
        except SchedcompError as exc:
            raise PlanFormatError(f"cached plan {path} is not usable: {exc}: re-run schedcomp precompile") from None
        return plan

    def _expected_costs(self, plan: Plan) -> CostModel:
        """The stage model a cached plan must have: the index's, or with layer costs its partition's (whose
        memory limit moved with the layers: `check` holds the plan to it)."""
        if self.layers is None:
            return self.costs
        if plan.partition is None:
            raise PlanFormatError("it has no partition but the cache was compiled with layer costs")
        costs = stage_costs(self.layers, plan.partition)
        return dataclasses.replace(costs, memory_limit=plan.costs.memory_limit)

    # ---- disk -------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Write every plan held in memory and the index to `directory` (created if missing)."""
        root = cachefiles.make_directory(directory)
        for key, plan in self.plans.items():  # the index gives each re-cut plan's cut (`cuts`), re-formed partitions
            self.cuts.pop(key, None)
            self.cuts.update({key: plan.cut} if plan.cut else {})
            self.partitions.pop(key, None)
            self.partitions.update({key: plan.partitions} if plan.partitions is not None else {})
        if set(self.cuts) - set(self.partitions) and not self.recut:  # (a re-formed plan's cut is its shares)
            raise PlanFormatError("this cache holds plans that re-cut micro-batches: set its recut to True to save it")
        for key in self.keys():
            path = root / (key_name(key) + ".json")
            if key in self.plans and not (self.files.get(key) == path and key in self.digests and path.exists()):
                self.digests[key] = cachefiles.write_plan(path, self.plans[key])
            elif key not in self.digests:
                raise PlanFormatError(f"no digest for {path}: load the cache with PlanCache.load or re-run precompile")
            self.files[key] = path
        self.root = root
        index = {
            "format": FORMAT, "version": VERSION if self.layers is None else VERSION_LAYERS,
            "pp": self.pp, "dp": self.dp, "microbatches": self.microbatches,
            "max_failures": self.max_failures, "costs": self.costs.to_dict(),
            # (written only with virtual stages: a one-chunk index reads as before)
            **({"chunks": self.chunks, "placement": self.placement} if self.chunks > 1 else {}),
            **({"layers": self.layers.to_dict(), "partition": list(self.partition or ())}
               if self.layers is not None else {}),
            **({"recut": True} if self.recut else {}),  # (written only when set: an index without it reads as before)
            "scenarios": [{"failed": [f"{d}:{s}" for d, s in key[0]], "classes": list(key[1]),
                           "file": key_name(key) + ".json", "sha256": self.digests[key],
                           **({"cut": self.cuts[key].to_json()} if key in self.cuts else {}),
                           **({"partitions": [list(p) for p in self.partitions[key]]} if key in self.partitions
                              else {})} for key in self.keys()],
        }
        fileio.write_atomic(root / INDEX, fileio.dumps_json(index, indent=1) + "\n", PlanFormatError)

    @classmethod
    def load(cls, directory: str | Path) -> PlanCache:
        """Open a cache written by `save` / `precompile`; plans are read on first lookup."""
        root = cachefiles.directory_path(directory)
        index = root / INDEX
        if not index.exists():
            raise PlanFormatError(f"cannot read plan cache index {index}: no such file: create the cache with "
                                  "schedcomp precompile")
        data = fileio.load_json(fileio.read_text(index, "plan cache index", PlanFormatError),
                                f"plan cache index {index}", PlanFormatError)
        if (not isinstance(data, dict) or data.get("format") != FORMAT or isinstance(data.get("version"), bool)
                or data.get("version") not in (VERSION, VERSION_LAYERS)):
            raise PlanFormatError(f"{index} is not a version {VERSION} schedcomp plan cache (nor version "
                                  f"{VERSION_LAYERS}, with layer costs): re-run precompile")
        try:
            pp, dp, mbs, k = (cachefiles.count(data, name) for name in ("pp", "dp", "microbatches", "max_failures"))
            limits.check_job(pp, dp, mbs)
            chunks = cachefiles.count(data, "chunks") if "chunks" in data else 1
            placement = data.get("placement", LOOP)
            job = Topology(pp, dp, chunks=chunks, placement=placement)  # TopologyError: a SchedcompError
            costs = CostModel.from_dict(data["costs"])
            if costs.pp != job.stages:
                raise PlanFormatError(f"its cost model has {costs.pp} stages but the job has {job.stages}")
            costs.check_workers(job)
            layers, partition = _index_layers(data, job, costs)
            recut, files, digests, cuts, partitions = cachefiles.scenario_entries(data, root, pp, dp, mbs)
        except KeyError as exc:
            raise PlanFormatError(f"malformed plan cache index {index}: missing {exc}") from None
        except SchedcompError as exc:
            raise PlanFormatError(f"malformed plan cache index {index}: {exc}") from None
        return cls(pp=pp, dp=dp, microbatches=mbs, costs=costs, max_failures=k, files=files, digests=digests,
                   root=root, chunks=chunks, placement=placement, layers=layers, partition=partition, recut=recut,
                   cuts=cuts, partitions=partitions)


def _index_layers(data: dict[str, Any], job: Topology, costs: CostModel) -> tuple[LayerCosts | None, Partition | None]:
    """The layer costs and the job's partition of a version-2 index (none in version 1); the index's stage
    model must be the one they make."""
    if data["version"] == VERSION:
        if "layers" in data or "partition" in data:
            raise PlanFormatError(f"a version-{VERSION} index has no layer costs: version {VERSION_LAYERS} has")
        return None, None
    layers = LayerCosts.from_dict(data["layers"])
    partition = as_partition(data["partition"], job.stages, "the index's partition")
    expected = stage_costs(layers, partition)
    if dataclasses.replace(expected, memory_limit=costs.memory_limit) != costs:
        raise PlanFormatError("its stage cost model is not the one its layer costs and partition make")
    return layers, partition


def _chunk_text(chunks: int, placement: str) -> str:
    return f" chunks={chunks} placement={placement}" if chunks > 1 else ""


def _job_costs(costs: CostModel, index: CostModel) -> CostModel:
    """What a cached plan's cost model must share with the index's: speeds are renamed with the
    pipelines, and when the index names no memory limit each plan carries the one `compile` resolved
    for its failure set (by default the fault-free per-stage peak), which `check` then holds it to."""
    limit = costs.memory_limit if index.memory_limit is not None else None
    return dataclasses.replace(costs, speed={}, memory_limit=limit)


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
    chunks: int = 1,
    placement: str = LOOP,
    layers: LayerCosts | int | None = None,
    partition: Sequence[int] | None = None,
    recut: bool = False,
    reform: Literal["auto", "never"] = AUTO,
) -> PlanCache:
    """Compile a plan for every distinct scenario with at most `max_failures` failures; write them to
    `directory` when given (each plan as soon as it is compiled, then the index). `progress(done,
    total, name)` is called after each plan. `jobs` > 1 compiles in that many processes, which write
    their plans themselves, so the parent does not parse them. `memory_limit` is `compile`'s (default:
    every plan within fault-free ZB-H1's per-stage peak). `chunks` and `placement` give each worker
    several model chunks (virtual stages, see `schedcomp.topology`); `costs` then has one entry per
    virtual stage (default: the unit model, each chunk 1/chunks of a stage). `layers` and `partition` are
    `compile`'s: each scenario's plan may then move layer boundaries, and carries its partition. `recut` is
    `compile`'s too: a failure plan may cut the failed workers' micro-batches into pieces (`schedcomp.recut`),
    and the index says so. `reform` is `compile`'s "auto" (the default, as `compile`'s) or "never", with layer
    costs: with "auto" a failure plan re-forms the pipelines that lost workers where that is faster (the index
    records their partitions; rollback and restart jobs run them; lossy and logging-based recovery refuse such
    a cache in one line: precompile theirs with "never"). Without layer costs it changes nothing."""
    if isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 0:
        raise SchedcompError(f"max_failures must be an integer of at least 0, got {max_failures!r}")
    topology = Topology(pp, dp, chunks=chunks, placement=placement)  # types and limits, before enumerating
    limits.check_job(pp, dp, microbatches)
    if not isinstance(recut, bool):
        raise SchedcompTypeError(f"recut must be True or False, got {recut!r}")
    if recut and chunks > 1:  # refused before any compile (`recut.recut` would refuse the first failure plan)
        raise SchedcompError(f"re-cut micro-batches run one stage per worker, not chunks={chunks}: drop recut or the "
                             "virtual stages")
    if isinstance(reform_mode(reform), tuple):  # (each scenario loses other pipelines)
        raise SchedcompTypeError(f"precompile's reform must be 'auto' or 'never', got {reform!r}")
    if costs is not None and not isinstance(costs, CostModel):
        raise SchedcompTypeError(f"costs must be a CostModel, got {type(costs).__name__}")
    from schedcomp.compiler import unit_costs

    given_costs = costs is not None
    costs = unit_costs(topology) if costs is None else costs
    if costs.pp != topology.stages:
        raise CostModelError(f"the cost model has {costs.pp} stages but the job has pp x chunks = {topology.stages}: "
                             "give one cost per (virtual) stage")
    costs.check_workers(topology)
    layer_costs: LayerCosts | None = None
    job_partition: Partition | None = None
    if layers is not None or partition is not None:
        from schedcomp.compiler import job_layers

        layer_costs, job_partition, costs = job_layers(topology, costs, layers, partition, given_costs=given_costs)
    todo = scenarios(pp, dp, max_failures, costs)
    cache = PlanCache(pp, dp, microbatches, costs, max_failures, chunks=chunks, placement=placement,
                      layers=layer_costs, partition=job_partition, recut=recut)
    root = cachefiles.make_directory(directory) if directory is not None else None
    began = time.perf_counter()
    args = [(pp, dp, microbatches, c.failed, canonical_costs(costs, c.perm), solver, time_limit, memory_limit, c.key,
             str(root / (key_name(c.key) + ".json")) if root is not None else None, chunks, placement,
             _scenario_layers(layer_costs, c.perm), job_partition, recut, reform) for c in todo]
    if jobs > 1 and len(todo) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            for i, (key, plan, digest, cut, partitions) in enumerate(pool.imap(_compile_one, args)):
                _record(cache, key, plan, root, digest, cut, partitions)
                if progress:
                    progress(i + 1, len(todo), key_name(key))
    else:
        for i, a in enumerate(args):
            key, plan, digest, cut, partitions = _compile_one(a, keep=True)
            _record(cache, key, plan, root, digest, cut, partitions)
            if progress:
                progress(i + 1, len(todo), key_name(key))
    log.info("precompiled %d scenarios in %.1f s", len(todo), time.perf_counter() - began)
    if root is not None:
        cache.save(root)
    return cache


def _record(cache: PlanCache, key: Key, plan: Plan | None, root: Path | None, digest: str | None, cut: Cut,
            partitions: Partitions | None) -> None:
    if cut:
        cache.cuts[key] = cut
    if partitions is not None:  # (the index must say so: a plan written by a worker process is not held here)
        cache.partitions[key] = partitions
    if plan is not None:
        cache.plans[key] = plan
    if root is not None:
        cache.files[key] = root / (key_name(key) + ".json")
    if digest is not None:
        cache.digests[key] = digest


def _compile_one(args: tuple[Any, ...], keep: bool = False
                 ) -> tuple[Key, Plan | None, str | None, Cut, Partitions | None]:
    """Compile one scenario; write it to its file when there is one, and return the plan only when it is
    not written (or `keep`), so worker processes send back just the key, digest, cut and per-pipeline
    partitions (for the index)."""
    from schedcomp.compiler import compile

    pp, dp, microbatches, failed, costs, solver, time_limit, memory_limit, key, path, chunks, placement, layers, \
        partition, recut, reform = args
    layered = {"layers": layers, "partition": partition, "costs": None} if layers is not None else {"costs": costs}
    plan = compile(pp, dp, microbatches, failed=failed, schedule="adaptive", solver=solver, time_limit=time_limit,
                   memory_limit=memory_limit, chunks=chunks, placement=placement, recut=recut, reform=reform,
                   **layered)
    if path is None:
        return key, plan, None, plan.cut, plan.partitions
    digest = cachefiles.write_plan(Path(path), plan)
    return key, plan if keep else None, digest, plan.cut, plan.partitions


def _scenario_layers(layers: LayerCosts | None, perm: tuple[int, ...]) -> LayerCosts | None:
    """The layer costs of a canonical scenario: speed factors renamed with the pipelines."""
    if layers is None:
        return None
    return dataclasses.replace(layers, costs=canonical_costs(layers.costs, perm))

