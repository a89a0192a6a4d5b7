"""The scheduling problem the solvers share: which ops exist, who may run them, how long they take.

A *slot* is one (pipeline, microbatch, stage); it holds an F and a B and a W (or an F and a fused BW).
All ops of a slot run on one worker (its activations are local): the home worker `(pipeline, stage)`
when it is live, otherwise one of the stage's live peers. Slots and workers are numbered densely so the
solvers can work on flat lists:

    slot id   = (pipeline * microbatches + microbatch) * pp + stage
    worker id = pipeline * pp + stage              (the global rank of the fault-free job)
    op id     = slot id * kinds_per_slot + position of the kind in `kinds`
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, RecoveryError, ScheduleError
from schedcomp.ir import Op, OpKind, Order
from schedcomp.topology import Topology, Worker

SPLIT_KINDS = (OpKind.F, OpKind.B, OpKind.W)
FUSED_KINDS = (OpKind.F, OpKind.BW)


@dataclass(frozen=True)
class Problem:
    """One scheduling instance: topology (with failures), micro-batches per pipeline, costs, split backward."""

    topology: Topology
    microbatches: int
    costs: CostModel
    split: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ScheduleError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if self.costs.pp != self.topology.pp:
            raise ScheduleError(
                f"the cost model has {self.costs.pp} stages but the topology has pp={self.topology.pp}: "
                "give one cost entry per stage"
            )

    # ---- sizes and numbering -------------------------------------------------------------------

    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def dp(self) -> int:
        return self.topology.dp

    @property
    def kinds(self) -> tuple[OpKind, ...]:
        return SPLIT_KINDS if self.split else FUSED_KINDS

    @property
    def n_slots(self) -> int:
        return self.dp * self.microbatches * self.pp

    def slot_id(self, pipeline: int, microbatch: int, stage: int) -> int:
        return (pipeline * self.microbatches + microbatch) * self.pp + stage

    def slot_key(self, slot: int) -> tuple[int, int, int]:
        """(pipeline, microbatch, stage) of a slot id."""
        rest, stage = divmod(slot, self.pp)
        pipeline, microbatch = divmod(rest, self.microbatches)
        return pipeline, microbatch, stage

    def worker_id(self, worker: Worker) -> int:
        return worker.pipeline * self.pp + worker.stage

    def worker_of(self, wid: int) -> Worker:
        return Worker(*divmod(wid, self.pp))

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
        return Worker(pipeline, stage) not in self.topology.failed

    @cached_property
    def orphan_slots(self) -> tuple[tuple[int, ...], ...]:
        """Per stage, the slots whose home worker has failed (ordered by microbatch, then pipeline)."""
        per_stage: list[list[tuple[int, int, int]]] = [[] for _ in range(self.pp)]
        for w in self.topology.failed:
            for m in range(self.microbatches):
                per_stage[w.stage].append((m, w.pipeline, self.slot_id(w.pipeline, m, w.stage)))
        return tuple(tuple(slot for _, _, slot in sorted(lst)) for lst in per_stage)

    @property
    def model_size(self) -> int:
        """Intervals of the CP-SAT model: re-routed slots count once per live worker of their stage."""
        nk = len(self.kinds)
        orphans = sum(len(o) * len(self.survivors[s]) for s, o in enumerate(self.orphan_slots))
        return nk * (orphans + self.n_slots - sum(map(len, self.orphan_slots)))

    # ---- costs ---------------------------------------------------------------------------------

    def duration(self, kind: OpKind, worker: Worker) -> float:
        return self.costs.compute_time(kind.value, worker)

    @cached_property
    def allreduce_times(self) -> tuple[float, ...]:
        """All-reduce time per stage: nothing for a group of one (there is nobody to reduce with)."""
        return tuple(self.costs.allreduce[s] if len(g) > 1 else 0.0 for s, g in enumerate(self.survivors))

    def step_time(self, wid: int) -> float:
        """The optimizer step of a worker (divided by its speed factor, like compute)."""
        worker = self.worker_of(wid)
        return self.costs.optimizer[worker.stage] / self.costs.speed.get(worker, 1.0)

    def check_memory(self) -> None:
        """Raise `MemoryLimitError` when no schedule at all can meet the memory limit.

        Any schedule must hold one micro-batch's activation at a stage while its forward runs, so the
        least workable limit is the largest per-stage activation; one micro-batch at a time always fits.
        """
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


def order_from_sequences(problem: Problem, sequences: dict[Worker, list[Op]], family: str) -> Order:
    """Wrap per-worker op lists into an `Order` (every live worker gets an entry, possibly empty)."""
    ops = {w: tuple(sequences.get(w, ())) for w in problem.topology.live_workers}
    return Order(problem.topology, problem.microbatches, ops, family)
