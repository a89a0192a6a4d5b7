"""Throughput of each strategy under a set of failed workers, relative to the fault-free job.

One figure per strategy and *canonical* failure set (`schedcomp.scenarios.canonical`: failure sets
equal up to relabelling the pipelines share a plan, hence a throughput), memoised, so a month of
failures costs one evaluation per distinct scenario.

Two fidelities:

- "exact": `schedcomp.baselines.compare` on the canonical failure set, i.e. the full compiler and
  simulator for every strategy (what `schedcomp compare` prints). Affordable on small jobs only
  (compiling pp=32 dp=256 takes ~40 s per failure set).
- "fast": the same models, evaluated where they decompose.
  * adaptive: the fault-free period over the failed set's work-conservation bound
    (`solvers.bounds.work_bound`: the busiest survivor's share of the re-routed micro-batches, its
    all-reduce and step), i.e. the compiled plan is taken to reach its bound. No plan beats it, so
    "fast" can only overstate adaptive, by the plan's optimality gap (`bench/bench_goodput.py`
    measures it against the compiler).
  * drop-pipeline: the slowest surviving pipeline with its share of the global batch, compiled as
    two copies of it (dp = 2, so its stages all-reduce), not the whole job.
  * oobleck, bamboo: `baselines.oobleck` / `baselines.bamboo` themselves, with their per-pipeline
    memo shared across failure sets (exact: their pipelines are independent by construction).
  * the fault-free reference: two copies of one pipeline (dp = 2), the slowest speed class if
    pipelines differ in speed. Without speed factors it equals the dp-pipeline plan's period
    (tests/compiler/test_goodput.py checks it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from schedcomp.baselines import bamboo, compare, fault_free, oobleck
from schedcomp.costs import CostModel
from schedcomp.errors import ScheduleError
from schedcomp.scenarios import Key, canonical, canonical_costs
from schedcomp.solvers.bounds import work_bound
from schedcomp.solvers.problem import Problem
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)

SOURCES = ("adaptive", "drop-pipeline", "oobleck", "bamboo")
"""The `compare` strategies whose throughput under failures the goodput strategies use."""
FIDELITIES = ("auto", "exact", "fast")
EXACT_MAX_SLOTS = 4096
"""`auto` compiles exactly when pp * dp * microbatches is at most this (pp=4 dp=8 m=8 is 256)."""


class Rates:
    """Relative throughput per (source strategy, failure set), memoised per canonical failure set."""

    def __init__(self, pp: int, dp: int, microbatches: int, costs: CostModel, fidelity: str = "auto",
                 sources: Iterable[str] = SOURCES) -> None:
        if fidelity not in FIDELITIES:
            raise ScheduleError(f"unknown fidelity {fidelity!r}: choose one of {', '.join(FIDELITIES)}")
        if fidelity == "auto":
            fidelity = "exact" if pp * dp * microbatches <= EXACT_MAX_SLOTS else "fast"
        self.pp, self.dp, self.microbatches, self.costs, self.fidelity = pp, dp, microbatches, costs, fidelity
        self.sources = tuple(s for s in SOURCES if s in set(sources))
        self._table: dict[Key, dict[str, float]] = {}
        self._memo: dict[object, object] = {}  # per-pipeline runs (baselines' memo, and ours)
        self._reference: float | None = None

    @property
    def scenarios(self) -> int:
        """Distinct canonical failure sets evaluated so far."""
        return len(self._table)

    def relative(self, source: str, failed: frozenset[Worker]) -> float:
        """Throughput of `source` with `failed` down, relative to the fault-free adaptive plan (0: it cannot
        go on). Below 1 even without failures for a strategy whose own schedule is slower (oobleck's
        and bamboo's 1F1B, bamboo's redundant forwards)."""
        c = canonical(Topology(self.pp, self.dp, failed), self.costs)
        row = self._table.get(c.key)
        if row is None:
            costs = canonical_costs(self.costs, c.perm)
            row = self._table[c.key] = (self._exact if self.fidelity == "exact" else self._fast)(c.failed, costs)
        return row[source]

    # ---- exact: the full compiler, every strategy --------------------------------------------------

    def _exact(self, failed: tuple[tuple[int, int], ...], costs: CostModel) -> dict[str, float]:
        # Unconstrained plans, as the "fast" models assume: the memory-safe default (fault-free per-stage
        # peak) can only lower adaptive's and drop-pipeline's figures while a worker is down.
        outcomes = compare(self.pp, self.dp, self.microbatches, failed, costs, strategies=self.sources,
                           memory_limit=None)
        return {o.strategy: o.relative_throughput for o in outcomes}

    # ---- fast: the same models where they decompose -------------------------------------------------

    def fault_free_period(self) -> float:
        """The fault-free plan's period (cost-model units): the job's own in "exact", `reference` in "fast"."""
        if self.fidelity == "exact":
            key = ("fault-free", self.dp)
            if key not in self._memo:
                self._memo[key] = fault_free(Topology(self.pp, self.dp), self.microbatches, self.costs).period
            return float(self._memo[key])  # type: ignore[arg-type]
        return self.reference()

    def reference(self) -> float:
        """Fault-free period: two copies of a pipeline, the slowest speed class (see the module docstring)."""
        if self._reference is None:
            classes = {self._speed(d, range(self.pp)): d for d in range(self.dp)}
            self._reference = max(self._pipeline_period(self.microbatches, d) for d in classes.values())
        return self._reference

    def _fast(self, failed: tuple[tuple[int, int], ...], costs: CostModel) -> dict[str, float]:
        topology = Topology.of(self.pp, self.dp, failed)
        fast: dict[str, Callable[[Topology, CostModel], float]] = {
            "adaptive": self._adaptive, "drop-pipeline": self._drop_pipeline,
            "oobleck": lambda t, c: self._ratio(oobleck(t, self.microbatches, c, memo=self._memo).period),
            "bamboo": lambda t, c: self._ratio(bamboo(t, self.microbatches, c, memo=self._memo).period),
        }
        return {name: fast[name](topology, costs) for name in self.sources}

    def _ratio(self, period: float) -> float:
        return self.reference() / period if period > 0 and period != float("inf") else 0.0

    def _adaptive(self, topology: Topology, costs: CostModel) -> float:
        """The fault-free period over the failed set's work bound (the busiest survivor's work): an
        upper bound on the compiled plan's relative throughput, as no plan beats its bound."""
        healthy = max(self._stage_bound(s, (), self.costs) for s in range(self.pp))
        hit: dict[int, list[int]] = {}
        for w in topology.failed:
            hit.setdefault(w.stage, []).append(w.pipeline)
        if any(len(p) == self.dp for p in hit.values()):
            return 0.0  # a stage lost every replica
        bound = max([healthy, *(self._stage_bound(s, tuple(sorted(p)), costs) for s, p in hit.items())])
        return min(1.0, self.reference() / bound) if topology.failed else 1.0

    def _stage_bound(self, stage: int, failed: tuple[int, ...], costs: CostModel) -> float:
        """`work_bound` restricted to one stage (the bound is a maximum of per-stage terms, so this
        is exact): the stage alone as a pp = 1 job with `failed` pipelines down."""
        speed = tuple(costs.speed.get(Worker(d, stage), 1.0) for d in range(self.dp)) if costs.speed else ()
        key = ("stage-bound", stage, failed if speed else len(failed), speed)
        if key not in self._memo:
            one = CostModel(
                forward=(costs.forward[stage],), backward_input=(costs.backward_input[stage],),
                backward_weight=(costs.backward_weight[stage],), allreduce=(costs.allreduce[stage],),
                optimizer=(costs.optimizer[stage],), activation=(costs.activation[stage],), b_frees=costs.b_frees,
                speed={Worker(d, 0): v for w, v in costs.speed.items() if w.stage == stage for d in (w.pipeline,)})
            down = range(len(failed)) if not speed else failed  # uniform speed: which pipelines does not matter
            topology = Topology.of(1, self.dp, [(d, 0) for d in down])
            self._memo[key] = work_bound(Problem(topology, self.microbatches, one, True))
        return float(self._memo[key])  # type: ignore[arg-type]

    def _drop_pipeline(self, topology: Topology, costs: CostModel) -> float:
        broken = sorted({w.pipeline for w in topology.failed})
        alive = [d for d in range(self.dp) if d not in broken]
        if not alive:
            return 0.0
        # The dropped pipelines' micro-batches are dealt round-robin to the survivors (as baselines does).
        extra, first = divmod(len(broken) * self.microbatches, len(alive))
        lengths = {d: self.microbatches + extra + (1 if i < first else 0) for i, d in enumerate(alive)}
        if not costs.speed:  # equal pipelines: the longest share is the slowest
            return self._ratio(self._pipeline_period(max(lengths.values()), alive[0], costs, len(alive)))
        return self._ratio(max(self._pipeline_period(n, d, costs, len(alive)) for d, n in lengths.items()))

    def _pipeline_period(self, microbatches: int, pipeline: int, costs: CostModel | None = None,
                         peers: int | None = None) -> float:
        """Period of pipeline `pipeline` on `microbatches`, fault-free, with its speed factors and its
        stages' all-reduce when it has `peers` > 1 (default dp): compiled as two copies of it (dp = 2),
        or alone."""
        costs = self.costs if costs is None else costs
        copies = min(2, self.dp if peers is None else peers)
        key = ("pipeline", microbatches, copies, self._speed(pipeline, range(self.pp), costs))
        if key not in self._memo:
            mine = [(w.stage, v) for w, v in costs.speed.items() if w.pipeline == pipeline]
            local = CostModel(**{**costs.__dict__, "speed": {Worker(j, s): v for s, v in mine for j in range(copies)}})
            self._memo[key] = fault_free(Topology(self.pp, copies), microbatches, local).period
        return float(self._memo[key])  # type: ignore[arg-type]

    def _speed(self, pipeline: int, stages: Iterable[int], costs: CostModel | None = None) -> tuple[float, ...]:
        speed = (self.costs if costs is None else costs).speed
        return tuple(speed.get(Worker(pipeline, s), 1.0) for s in stages)
