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
- one group per stage over its live workers (created when a plan first needs it) for ALLREDUCE; with
  re-formed pipelines one per distinct holder set of a segment, in layer order (`runtime.layout`).

Devices: the groups serve both the CPU and the GPU (`"cpu:gloo,cuda:nccl"`, see `backend_spec`):
activations, gradients and parameters go over NCCL on the GPU, small control tensors (plan
digests, shape metadata, the clock origin, trace tables) stay on the CPU over gloo, where reading
them back costs no device synchronisation (`Comm.control_device`). A group that serves only the
GPU (a default group the caller made with plain `"nccl"`) gets its control tensors on the GPU.

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


BACKENDS = ("gloo", "nccl")
GPU_BACKEND = "cpu:gloo,cuda:nccl"  # control tensors on the CPU over gloo, the rest on the GPU over NCCL


def backend_spec(backend: str) -> dict[str, str]:
    """Device type -> backend for a backend string in torch's forms: "gloo", "nccl", "cpu:gloo,cuda:nccl".

    "nccl" alone means the GPU setup, `GPU_BACKEND`: an NCCL-only group cannot carry a CPU tensor,
    and the runtime's small control tensors live on the CPU.
    """
    name = backend.strip().lower()
    if name in BACKENDS:
        return {"cpu": "gloo"} if name == "gloo" else backend_spec(GPU_BACKEND)
    spec: dict[str, str] = {}
    for part in name.split(","):
        device, _, impl = part.strip().partition(":")
        if device not in ("cpu", "cuda") or impl not in BACKENDS or device in spec:
            raise RuntimeSetupError(f"backend {backend!r} is not one this runtime builds: use gloo, nccl or a "
                                    "list like 'cpu:gloo,cuda:nccl' (each of cpu and cuda at most once)")
        spec[device] = impl
    if spec.get("cpu") == "nccl":
        raise RuntimeSetupError(f"backend {backend!r} puts NCCL on the CPU: NCCL serves only cuda, use cpu:gloo")
    return spec


def backend_config(spec: dict[str, str]) -> str:
    """`spec` as torch's backend string ("cpu:gloo,cuda:nccl"), for `init_process_group` and group tables.

    Gloo on the CPU alone is plain "gloo" (torch then also registers it for cuda, as it always did here).
    """
    if spec == {"cpu": "gloo"}:
        return "gloo"
    return ",".join(f"{device}:{impl}" for device, impl in spec.items())


def pick_backend() -> str:
    """`GPU_BACKEND` when every local rank can have its own GPU, gloo otherwise."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dist.is_nccl_available() and torch.cuda.is_available() and torch.cuda.device_count() >= local:
        return GPU_BACKEND
    return "gloo"


def local_device(spec: dict[str, str]) -> torch.device:
    """This process's compute device: its own GPU (LOCAL_RANK, made current) when NCCL serves cuda, else the CPU."""
    if spec.get("cuda") != "nccl":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available() or local >= torch.cuda.device_count():
        raise RuntimeSetupError(f"NCCL needs a GPU per process but local rank {local} sees "
                                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: "
                                "launch at most one process per GPU, or use the gloo backend")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the job (from torchrun's environment) unless already joined; return (rank, size, device)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeSetupError(
                "no distributed job found: launch with `torchrun --standalone --nproc-per-node N ...` "
                "or call torch.distributed.init_process_group first"
            )
        spec = backend_spec(backend or pick_backend())
        device = local_device(spec)
        dist.init_process_group(backend_config(spec))
        return dist.get_rank(), dist.get_world_size(), device
    if "nccl" in str(dist.get_backend_config()).lower():  # joined by the caller, who chose the GPU
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def served_devices(group: dist.ProcessGroup) -> frozenset[str]:
    """The device types `group` has a backend for (a tensor of another type cannot go over it)."""
    if hasattr(group, "_device_types"):  # torch's own list (private; present in the versions we run on)
        return frozenset(d.type for d in group._device_types)
    served = set()
    for kind in ("cpu", "cuda"):
        try:
            group._get_backend(torch.device(kind))
            served.add(kind)
        except RuntimeError:  # "No backend type associated with device type ..."
            pass
    return frozenset(served)


def control_device(group: dist.ProcessGroup, compute: torch.device) -> torch.device:
    """Where small control tensors for `group` live: the CPU when the group serves it, else `compute`."""
    served = served_devices(group)
    if "cpu" in served:
        return torch.device("cpu")
    if compute.type in served:
        return compute
    raise RuntimeSetupError(f"the control group serves only {', '.join(sorted(served))}, not {compute.type}: "
                            f"initialise with backend {GPU_BACKEND!r} (or gloo on the CPU)")


def require_device(group: dist.ProcessGroup, device: torch.device, role: str) -> None:
    """Refuse a group that cannot carry this worker's tensors (instead of failing at the first transfer)."""
    served = served_devices(group)
    if device.type not in served:
        raise RuntimeSetupError(f"the {role} group serves {', '.join(sorted(served)) or 'no device'} but this "
                                f"worker computes on {device.type}: initialise with backend {GPU_BACKEND!r} "
                                "on GPUs, gloo on the CPU")


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
        for role, group in (("point-to-point", self._up), ("point-to-point", self._down), ("control", self.control)):
            require_device(group, device, role)
        # Digests, shape metadata, the clock origin, trace tables: read back on the host at once.
        self.control_device = control_device(self.control, device)
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
                group = self._make_group(list(members)) if len(members) > 1 else None
                if group is not None and self.rank in members:
                    require_device(group, self.device, "all-reduce")
                self._stage_groups[members] = group

    def connect(self, channels: Iterable[tuple[Worker, Worker]]) -> None:
        """Open these (sender, receiver) channels with one message each (collective: same call everywhere)."""
        pairs = sorted({(self.ranks.rank(a), self.ranks.rank(b)) for a, b in channels} - self._connected)
        token = torch.zeros(1, device=self.device)
        for src, dst in pairs:
            if self.rank == src:
                self.wait(dist.isend(token, dst=dst, group=self.p2p_group(src, dst)))
            elif self.rank == dst:
                self.wait(dist.irecv(token, src=src, group=self.p2p_group(src, dst)))
        self._connected |= set(pairs)

    def stage_group(self, workers: tuple[Worker, ...]) -> dist.ProcessGroup | None:
        """The all-reduce group of these workers (None when there is only one)."""
        return self._stage_groups[tuple(sorted(self.ranks.rank(w) for w in workers))]

    def p2p_group(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group carrying point-to-point messages from rank `src` to rank `dst` (one per direction)."""
        return self._up if src < dst else self._down

    def isend(self, tensor: torch.Tensor, peer: Worker, tag: int) -> dist.Work:
        dst = self.ranks.rank(peer)
        return dist.isend(tensor, dst=dst, group=self.p2p_group(self.rank, dst), tag=tag)

    def irecv(self, tensor: torch.Tensor, peer: Worker, tag: int) -> dist.Work:
        src = self.ranks.rank(peer)
        return dist.irecv(tensor, src=src, group=self.p2p_group(src, self.rank), tag=tag)
