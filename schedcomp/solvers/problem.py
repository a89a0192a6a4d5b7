"""The scheduling problem the solvers share: which ops exist, who may run them, how long they take.

A *slot* is one (pipeline, microbatch, stage); it holds an F and a B and a W (or an F and a fused BW).
All ops of a slot run on one worker (its activations are local): the home worker `(pipeline, place)`
when it is live, otherwise one of the live peers at the same place (they hold the same chunks). Slots
and workers are numbered densely so the solvers can work on flat lists:

    slot id   = (pipeline * microbatches + microbatch) * stages + stage
    worker id = pipeline * pp + place              (the global rank of the fault-free job)
    op id     = slot id * kinds_per_slot + position of the kind in `kinds`

With virtual stages (`Topology.chunks` > 1) a slot's stage is its virtual stage, `stages` is pp x chunks,
and the place of the workers that may run it is `place[stage]` (`Topology.place_of`); a failed worker
leaves the slots of every chunk it held. With one chunk, stage and place coincide and `stages` is pp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from schedcomp.costs import CostModel
from schedcomp.cut import NO_CUT, Cut
from schedcomp.errors import MemoryLimitError, RecoveryError, ScheduleError
from schedcomp.ir import Op, OpKind
from schedcomp.topology import Topology, Worker

SPLIT_KINDS = (OpKind.F, OpKind.B, OpKind.W)
FUSED_KINDS = (OpKind.F, OpKind.BW)


@dataclass(frozen=True)
class Problem:
    """One scheduling instance: topology (with failures), micro-batches per pipeline, costs, split backward,
    and how each pipeline's share is cut into micro-batches (`schedcomp.cut`: whole by default)."""

    topology: Topology
    microbatches: int
    costs: CostModel
    split: bool = True
    cut: Cut = NO_CUT
    routing: tuple[tuple[int, int], ...] = ()
    """Re-routed slots pinned to a worker up front, (slot id, worker id): a re-cut piece is sized for its peer
    (`schedcomp.recut`); empty lets `route` and the schedulers choose."""

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ScheduleError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if self.costs.pp != self.topology.stages:
            raise ScheduleError(
                f"the cost model has {self.costs.pp} stages but the topology has {self.topology.stages}: "
                "give one cost entry per (virtual) stage"
            )

    # ---- sizes and numbering -------------------------------------------------------------------

    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def dp(self) -> int:
        return self.topology.dp

    @property
    def stages(self) -> int:
        """Stages of the model: pp x chunks (virtual stages), pp without them."""
        return self.topology.stages

    @cached_property
    def place(self) -> tuple[int, ...]:
        """The place in the pipeline (worker id mod pp) holding each (virtual) stage."""
        return tuple(self.topology.place_of(s) for s in range(self.stages))

    @property
    def kinds(self) -> tuple[OpKind, ...]:
        return SPLIT_KINDS if self.split else FUSED_KINDS

    @cached_property
    def width(self) -> int:
        """Micro-batches per pipeline in slot ids: M, or the most pieces a re-cut pipeline has (`schedcomp.cut`)."""
        return self.cut.width(self.microbatches)

    def count(self, pipeline: int) -> int:
        """The micro-batches (pieces, when re-cut) `pipeline` runs."""
        return self.cut.count(pipeline, self.microbatches)

    @property
    def n_slots(self) -> int:
        """Slot ids, absent ones included (past a pipeline's count, with a re-cut)."""
        return self.dp * self.width * self.stages

    @cached_property
    def n_present(self) -> int:
        """Slots that hold ops: every slot id unless a re-cut leaves some absent."""
        return sum(self.count(d) for d in range(self.dp)) * self.stages

    def slot_id(self, pipeline: int, microbatch: int, stage: int) -> int:
        return (pipeline * self.width + microbatch) * self.stages + stage

    def slot_key(self, slot: int) -> tuple[int, int, int]:
        """(pipeline, microbatch, stage) of a slot id."""
        rest, stage = divmod(slot, self.stages)
        pipeline, microbatch = divmod(rest, self.width)
        return pipeline, microbatch, stage

    def worker_id(self, worker: Worker) -> int:
        return worker.pipeline * self.pp + worker.stage

    def worker_of(self, wid: int) -> Worker:
        return Worker(*divmod(wid, self.pp))

    def home_of(self, slot: int) -> int:
        """The worker id of a slot's home worker (live or not)."""
        d, _, s = self.slot_key(slot)
        return d * self.pp + self.place[s]

    def op_of(self, slot: int, kind: OpKind) -> Op:
        d, m, s = self.slot_key(slot)
        return Op(kind, d, m, s)

    # ---- who may run what ----------------------------------------------------------------------

    @cached_property
    def survivors(self) -> tuple[tuple[Worker, ...], ...]:
        """Live workers of each stage (raises `RecoveryError` when a stage has none)."""
        groups = tuple(self.topology.stage_group(s) for s in range(self.pp))
        for s, group in enumerate(groups):
            if not group:
                raise RecoveryError(
                    f"every worker of stage {s} has failed, so its micro-batches cannot be re-routed: "
                    "recovery needs a checkpoint (restart from the last one, or keep at least one replica per stage)"
                )
        return groups

    def home_live(self, pipeline: int, stage: int) -> bool:
        return Worker(pipeline, self.place[stage]) not in self.topology.failed

    @cached_property
    def orphan_slots(self) -> tuple[tuple[int, ...], ...]:
        """Per place, the slots whose home worker has failed (ordered by microbatch, then stage, then pipeline)."""
        per_place: list[list[tuple[int, int, int, int]]] = [[] for _ in range(self.pp)]
        for w in self.topology.failed:
            for s in self.topology.chunks_of(w.stage):
                for m in range(self.count(w.pipeline)):
                    per_place[w.stage].append((m, s, w.pipeline, self.slot_id(w.pipeline, m, s)))
        return tuple(tuple(key[-1] for key in sorted(lst)) for lst in per_place)

    @property
    def model_size(self) -> int:
        """Intervals of the CP-SAT model: re-routed slots count once per live worker of their stage."""
        nk = len(self.kinds)
        orphans = sum(len(o) * len(self.survivors[s]) for s, o in enumerate(self.orphan_slots))
        return nk * (orphans + self.n_slots - sum(map(len, self.orphan_slots)))

    # ---- costs ---------------------------------------------------------------------------------

    @cached_property
    def slot_sizes(self) -> list[float] | None:
        """Per slot id, its micro-batch's size (`schedcomp.cut`: an op's time and activation scale with it),
        or None when every micro-batch is whole (the solvers then skip the scaling)."""
        if not self.cut:
            return None
        width = self.width
        padded = [(*self.cut.sizes(d, self.microbatches), *(1.0,) * width)[:width] for d in range(self.dp)]
        return [padded[d][mb] for d in range(self.dp) for mb in range(width) for _ in range(self.stages)]

    def duration(self, kind: OpKind, worker: Worker, stage: int | None = None) -> float:
        """Time of one op of `kind` on `worker` at `stage` (default: the worker's place, one chunk)."""
        return self.costs.compute_time(kind.value, worker, stage)

    def durations(self, wid: int) -> list[list[float]]:
        """Op times of worker `wid` per (virtual) stage and kind position (`kinds`); 0 at the stages it
        does not hold (no op of theirs runs there; timing them cost 1k workers x 16 stages a lookup each)."""
        worker = self.worker_of(wid)
        held, idle = set(self.topology.chunks_of(worker.stage)), [0.0] * len(self.kinds)
        return [[self.duration(k, worker, s) for k in self.kinds] if s in held else idle for s in range(self.stages)]

    def with_failed(self, topology: Topology, costs: CostModel) -> Problem:
        """This problem with more workers failed, under `costs` (these costs but for the memory limit):
        the live workers' op times are kept, as they do not depend on who else failed (seconds of Python
        at pp = 32, dp = 256; `optimes.retimed`)."""
        if replace(costs, memory_limit=None) != replace(self.costs, memory_limit=None):
            raise ScheduleError("with_failed keeps the op times: the costs may differ in their memory limit only")
        new = replace(self, topology=topology, costs=costs)
        live = (new.worker_id(w) for w in topology.live_workers)
        new.__dict__["op_times"] = {wid: self.op_times[wid] for wid in live}  # `op_times`' own cache slot
        return new

    @cached_property
    def op_times(self) -> dict[int, list[float]]:
        """`durations` of every live worker id, flattened (index stage * len(kinds) + kind position):
        computed once per problem for the solvers' clocks, which time many candidates."""
        # A row depends on the worker's place and speed factor only: workers alike share one (read-only) list,
        # worked out once (8,000 workers at pp = 32, dp = 256 took 0.15 s one by one).
        rows: dict[tuple[int, float], list[float]] = {}
        times: dict[int, list[float]] = {}
        for w in self.topology.live_workers:
            wid, key = self.worker_id(w), (w.stage, self.costs.speed.get(w, 1.0))
            row = rows.get(key)
            if row is None:
                row = rows[key] = [t for per_kind in self.durations(wid) for t in per_kind]
            times[wid] = row
        return times

    @cached_property
    def allreduce_times(self) -> tuple[float, ...]:
        """All-reduce time per place, over every chunk held there: nothing for a group of one (there is
        nobody to reduce with)."""
        chunks = self.topology.chunks_of
        return tuple(self.costs.allreduce_of(chunks(p)) if len(g) > 1 else 0.0 for p, g in enumerate(self.survivors))

    def step_time(self, wid: int) -> float:
        """The optimizer step of a worker, over its chunks (divided by its speed factor, like compute)."""
        worker = self.worker_of(wid)
        return self.costs.optimizer_of(self.topology.chunks_of(worker.stage)) / self.costs.speed.get(worker, 1.0)

    def limit_of(self, wid: int) -> float:
        """The memory limit of worker `wid` (inf when unlimited)."""
        return self.costs.limit_at(wid % self.pp)

    def check_memory(self) -> None:
        """Raise `MemoryLimitError` when no schedule at all can meet the memory limit.

        Any schedule must hold one micro-batch's activation at a stage while its forward runs, so the
        least workable limit is the largest per-stage activation; one micro-batch at a time always fits.
        """
        if self.topology.chunks > 1:
            self._check_chunk_memory()
            return
        costs = self.costs
        short = [s for s in range(self.pp) if costs.activation[s] > costs.limit_at(s) * (1 + 1e-9)]
        if short:
            from schedcomp.memory import show_memory

            s = max(short, key=lambda t: costs.activation[t] - costs.limit_at(t))
            need, have = show_memory(costs.activation[s], costs), show_memory(costs.limit_at(s), costs, unit=False)
            if isinstance(costs.memory_limit, tuple):
                least = "the limit of stage " + ", ".join(f"{t} to at least {costs.activation[t]:g}" for t in short)
            else:
                least = f"the limit to at least {show_memory(max(costs.activation), costs, unit=False)}"
            raise MemoryLimitError(
                f"memory limit {have} is below the {need} one micro-batch's activations need at stage {s}: "
                f"raise {least} (or split the model into more stages)"
            )

    def _check_chunk_memory(self) -> None:
        """`check_memory` with virtual stages: a micro-batch keeps its activation at a worker's chunk until
        that chunk's B, which waits for its later chunks there, so each worker holds one micro-batch's
        activations of all its chunks at once."""
        from schedcomp.memory import show_memory

        costs, held = self.costs, self.topology.chunks_of
        need = [sum(costs.activation[c] for c in held(p)) for p in range(self.pp)]
        p = max(range(self.pp), key=lambda q: need[q] - costs.limit_at(q))
        if need[p] > costs.limit_at(p) * (1 + 1e-9):
            raise MemoryLimitError(
                f"memory limit {show_memory(costs.limit_at(p), costs, unit=False)} is below the "
                f"{show_memory(need[p], costs)} one micro-batch's activations need on a worker at place {p}, which "
                f"holds them for its chunks {', '.join(map(str, held(p)))} at once: raise the limit to at least "
                f"{show_memory(max(need), costs, unit=False)} (or split the model into more stages)"
            )
