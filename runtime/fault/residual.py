"""Lossy forward: what each survivor still runs of the iteration a failure interrupted (pure functions).

Under the lossy policy (Nicolae et al., CCGrid 2022) the survivors do not re-run the iteration:
they finish it from where each of them stopped, without the micro-batches the failure took, and
each stage rescales its gradient to the mean over the micro-batches it holds. This module
computes, from the plan of that iteration and every survivor's progress in its stream (the index
of the first instruction it had not completed), each survivor's `Residual`:

- `lost`: a micro-batch is lost when any of its (stage) slots ran on a failed worker: its
  activations, input gradients or weight gradients died there. Everything not yet done for it
  is dropped everywhere; what a survivor already accumulated for it stays (it cannot be taken out
  of `.grad`), and the ledger says so.
- Transfers in flight die with the broken generation's groups. A message of a kept micro-batch
  that its receiver had not consumed (the compute op that reads it had not completed) is sent
  again on the new generation: the receiver re-posts its receive (`repost`) and the sender, if it
  had already posted the send, posts it again from the tensor it kept (`resend`); if it had not,
  its remaining stream sends it as planned. Both sides then see, per channel, the same messages in
  the same order (the unconsumed suffix of the channel's sequence), so NCCL's FIFO matching holds.
- `rest`: the survivor's remaining instructions without the lost micro-batches. A residual is a
  suffix of a valid execution with whole micro-batch chains removed, so any wait-for cycle in it
  would be one in the plan: no deadlock.
- Stages: ALLREDUCE runs on the new generation's stage group. If some live replicas of a stage
  had already stepped and others had not (the all-reduce completed for some before the failure
  was noticed), the others cannot all-reduce with them any more: they receive the stepped
  replica's state instead (`donor` / `recipients`), as a replacement does.

Nothing here imports torch: the runtime (`runtime/lossy.py`) executes what this decides.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from schedcomp.errors import RecoveryError
from schedcomp.ir import InstrKind, Instruction, Plan
from schedcomp.planindex import plan_index
from schedcomp.semantics import RECV, SEND, semantics_of
from schedcomp.topology import Worker

MicroBatch = tuple[int, int]  # (home pipeline, microbatch)


@dataclass(frozen=True)
class Residual:
    """What one survivor still runs of the interrupted iteration (see the module docstring)."""

    worker: Worker
    resend: tuple[Instruction, ...]  # SEND_* posted in the broken generation, not consumed: post again
    repost: tuple[Instruction, ...]  # RECV_* posted in the broken generation, not consumed: post again
    rest: tuple[Instruction, ...]  # the stream from its progress on, without lost micro-batches
    lost: frozenset[MicroBatch]  # drop whatever this worker holds of these
    donor: Worker | None = None  # receive the stage's stepped state from this replica instead of ALLREDUCE, STEP
    recipients: tuple[Worker, ...] = ()  # send this worker's stepped state to these replicas

    @property
    def stepped(self) -> bool:
        """Whether this worker had applied its optimizer step before the failure."""
        return not any(i.kind is InstrKind.STEP for i in self.rest) and self.donor is None


def lost_microbatches(plan: Plan, failed: Iterable[Worker]) -> frozenset[MicroBatch]:
    """Micro-batches with a slot (at any stage) on a failed worker in `plan`."""
    failed = frozenset(failed)
    return frozenset((op.pipeline, op.microbatch) for w in plan.workers if w in failed
                     for op in plan.compute_ops(w))


def _key(ins: Instruction) -> MicroBatch:
    assert ins.op is not None
    return (ins.op.pipeline, ins.op.microbatch)


def residuals(plan: Plan, progress: Mapping[Worker, int], failed: Iterable[Worker]) -> dict[Worker, Residual]:
    """Every survivor's residual of an iteration of `plan` (see the module docstring).

    `progress[w]`: how many instructions of its stream survivor w had completed (its length when
    it finished the iteration, STEP included). Every worker of `plan` is in `progress` or `failed`.
    """
    failed = frozenset(failed)
    survivors = [w for w in plan.workers if w not in failed]
    missing = [str(w) for w in survivors if w not in progress]
    if missing:
        raise RecoveryError(f"no progress record from {', '.join(missing)}: every survivor must report one")
    for w in survivors:
        if not 0 <= progress[w] <= len(plan.streams[w]):
            raise RecoveryError(f"worker {w} reports progress {progress[w]} in a stream of {len(plan.streams[w])} "
                                "instructions: it ran a different plan")
    lost = lost_microbatches(plan, failed)
    index = plan_index(plan)  # pairs every transfer with its receive and that receive's consumer

    def consumed(ins: Instruction) -> bool:
        """Whether the receiver of this transfer had completed the compute op that reads it."""
        transfer = index.id_of(ins)
        return index.consumed[transfer] < progress[index.receive_of(transfer)[0]]

    donors = _donors(plan, progress, survivors)
    out: dict[Worker, Residual] = {}
    for w in survivors:
        stream, done = plan.streams[w], progress[w]
        resend, repost = [], []
        for ins in stream[:done]:
            if ins.op is None or _key(ins) in lost:
                continue
            direction = semantics_of(ins.kind).direction
            if direction == SEND and not consumed(ins):
                resend.append(ins)
            elif direction == RECV and not consumed(ins):
                repost.append(ins)
        rest = tuple(i for i in stream[done:] if i.op is None or _key(i) not in lost)
        donor = donors.get(w)
        if donor is not None:  # it waits at ALLREDUCE; its replica stepped: take that state instead
            rest = tuple(i for i in rest if i.kind not in (InstrKind.ALLREDUCE, InstrKind.STEP))
        recipients = tuple(r for r, d in sorted(donors.items()) if d == w)
        out[w] = Residual(w, tuple(resend), tuple(repost), rest, lost, donor, recipients)
    return out


def _donors(plan: Plan, progress: Mapping[Worker, int], survivors: list[Worker]) -> dict[Worker, Worker]:
    """Replicas that have not stepped, in stages where another live replica has: who gives them its state."""
    out: dict[Worker, Worker] = {}
    for s in range(plan.topology.pp):
        replicas = [w for w in survivors if w.stage == s]
        stepped = [w for w in replicas if progress[w] == len(plan.streams[w])]
        if not stepped or len(stepped) == len(replicas):
            continue
        for w in replicas:
            if w in stepped:
                continue
            stream = plan.streams[w]
            reduce_at = next((i for i, ins in enumerate(stream) if ins.kind is InstrKind.ALLREDUCE), None)
            if progress[w] != reduce_at:
                raise RecoveryError(f"worker {w} stopped at instruction {progress[w]} while its replica {stepped[0]} "
                                    "had stepped: the all-reduce cannot have completed; use the rollback policy")
            out[w] = stepped[0]
    return out


def skipped_chunks(lost: Iterable[MicroBatch], microbatches: int) -> tuple[int, ...]:
    """Global-batch chunk indices of the lost micro-batches (chunk p * microbatches + m), sorted."""
    return tuple(sorted(p * microbatches + m for p, m in lost))

