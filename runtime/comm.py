"""Processes, ranks and process groups: how workers of a plan talk over torch.distributed.

Rank <-> worker mapping: the job runs one process per live worker of the plan it starts with;
process rank i is the i-th live worker in sorted order (`Plan.workers`, pipeline-major). In a
fault-free job that is the usual `rank = pipeline * pp + stage`. A process keeps its worker for
life: a later plan (`PipelineTrainer.use_plan`) may leave workers out, never add unknown ones.

Groups (every rank creates them, in the same order, so no call can mismatch):
- two p2p groups, one per direction (sender rank < receiver rank, and the reverse). NCCL runs a
  pair's transfers on one stream per group; with one direction per group a receive posted early
  can never sit in front of a send the peer is waiting for. Gloo does not need it and does not mind.
- a control group over every rank: shape probe, parameter sync, loss reduction.
- one group per stage over its live workers (created when a plan first needs it) for ALLREDUCE.

Channels are connected before the first iteration that uses them (`connect`): one tiny message
per (sender, receiver) pair, in one global order, each waited on. NCCL builds a pair's
communicator at its first transfer and blocks the sender until the receiver joins; done in the
middle of a schedule that could deadlock, done up front it cannot (the first pair in the order
not yet connected always has both ends waiting on it).

Issue 5 (fault tolerance) rebuilds all of these per generation: `Comm` takes the group factory,
so a new generation can build its groups from a fresh store prefix instead of `dist.new_group`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import InstrKind, Plan
from schedcomp.topology import Worker

log = logging.getLogger(__name__)

GroupFactory = Callable[[list[int]], dist.ProcessGroup]
Waiter = Callable[[dist.Work], None]


def plain_wait(work: dist.Work) -> None:
    """Wait for a work item with no way out (the fault-free default; see `fault.membership.wait_work`)."""
    work.wait()


def pick_backend() -> str:
    """NCCL when every local rank can have its own GPU, gloo otherwise."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.device_count() >= local:
        return "nccl"
    return "gloo"


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the job (from torchrun's environment) unless already joined; return (rank, size, device)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeSetupError(
                "no distributed job found: launch with `torchrun --standalone --nproc-per-node N ...` "
                "or call torch.distributed.init_process_group first"
            )
        backend = backend or pick_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    if dist.get_backend() == "nccl":
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


@dataclass(frozen=True)
class RankMap:
    """Which process runs which worker: rank i runs `workers[i]` (the plan's live workers, sorted)."""

    workers: tuple[Worker, ...]

    @classmethod
    def of(cls, plan: Plan) -> RankMap:
        return cls(plan.workers)

    def rank(self, worker: Worker) -> int:
        try:
            return self.workers.index(worker)
        except ValueError:
            raise RuntimeSetupError(
                f"worker {worker} has no process in this job (processes run {', '.join(map(str, self.workers))}): "
                "use a plan whose workers are among them"
            ) from None

    def worker(self, rank: int) -> Worker:
        if not 0 <= rank < len(self.workers):
            raise RuntimeSetupError(
                f"rank {rank} has no worker: the plan has {len(self.workers)} live workers, "
                f"so launch exactly {len(self.workers)} processes"
            )
        return self.workers[rank]


def channels(plan: Plan, among: Collection[Worker] | None = None) -> Iterator[tuple[Worker, Worker]]:
    """The (sender, receiver) pairs `plan`'s transfers use (only those between workers in `among`)."""
    for w, stream in plan.streams.items():
        for ins in stream:
            if (ins.kind in (InstrKind.SEND_ACT, InstrKind.SEND_GRAD) and ins.peer is not None
                    and (among is None or (w in among and ins.peer in among))):
                yield w, ins.peer


class Comm:
    """The process groups of one generation of the job, and the transfers over them."""

    def __init__(self, ranks: RankMap, rank: int, device: torch.device,
                 make_group: GroupFactory | None = None, wait: Waiter | None = None) -> None:
        self.ranks, self.rank, self.device = ranks, rank, device
        # Every wait on a transfer or collective goes through `wait`: a resilient job passes one
        # that gives up when its generation breaks (gloo cannot interrupt a blocked `wait()`).
        self.wait: Waiter = wait or plain_wait
        self._make_group = make_group or (lambda members: dist.new_group(members))
        everyone = list(range(len(ranks.workers)))
        self._up = self._make_group(everyone)
        self._down = self._make_group(everyone)
        self.control = self._make_group(everyone)
        self._stage_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._connected: set[tuple[int, int]] = set()

    @property
    def backend(self) -> str:
        return dist.get_backend(self.control)

    def prepare_stage_groups(self, groups: Sequence[tuple[Worker, ...]]) -> None:
        """Create the all-reduce groups for these worker sets (collective: same call on every rank)."""
        for workers in groups:
            members = tuple(sorted(self.ranks.rank(w) for w in workers))
            if members not in self._stage_groups:
                self._stage_groups[members] = self._make_group(list(members)) if len(members) > 1 else None

    def connect(self, channels: Iterable[tuple[Worker, Worker]]) -> None:
        """Open these (sender, receiver) channels with one message each (collective: same call everywhere)."""
        pairs = sorted({(self.ranks.rank(a), self.ranks.rank(b)) for a, b in channels} - self._connected)
        token = torch.zeros(1, device=self.device)
        for src, dst in pairs:
            if self.rank == src:
                self.wait(dist.isend(token, dst=dst, group=self._p2p_group(src, dst)))
            elif self.rank == dst:
                self.wait(dist.irecv(token, src=src, group=self._p2p_group(src, dst)))
        self._connected |= set(pairs)

    def stage_group(self, workers: tuple[Worker, ...]) -> dist.ProcessGroup | None:
        """The all-reduce group of these workers (None when there is only one)."""
        return self._stage_groups[tuple(sorted(self.ranks.rank(w) for w in workers))]

    def _p2p_group(self, src: int, dst: int) -> dist.ProcessGroup:
        return self._up if src < dst else self._down

    def isend(self, tensor: torch.Tensor, peer: Worker, tag: int) -> dist.Work:
        dst = self.ranks.rank(peer)
        return dist.isend(tensor, dst=dst, group=self._p2p_group(self.rank, dst), tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: Worker, tag: int) -> dist.Work:
        src = self.ranks.rank(peer)
        return dist.irecv(tensor, src=src, group=self._p2p_group(src, self.rank), tag=tag)
