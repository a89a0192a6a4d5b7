"""Before a worker runs a plan: is it for this job's shape, and does every rank hold the same one?

Ranks that compiled different plans would exchange mismatched tensors or hang, and a failure that
interrupted a layer move leaves some workers in the new cut and some in the old: both are refused
at switch time by one small all-gather of two digests (the plan's text, and the worker's cut).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence

import torch
import torch.distributed as dist

from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.ir import Plan
from schedcomp.partition import Partition
from schedcomp.partitions import Partitions
from schedcomp.runtime.comm import Comm
from schedcomp.topology import Worker

Shape = tuple[int, int, int, str]


def job_shape(plan: Plan) -> Shape:
    """What a job's processes are built for: pp, dp, and the chunks each holds (count and placement)."""
    topology = plan.topology
    return (topology.pp, topology.dp, topology.chunks, topology.placement if topology.chunks > 1 else "")


def describe_shape(shape: Shape) -> str:
    pp, dp, chunks, placement = shape
    return f"pp={pp}, dp={dp}" + (f", {chunks} chunks per worker ({placement})" if chunks > 1 else "")


def check_same_plan(plan: Plan, cut: Partition | Partitions | None, comm: Comm, workers: Sequence[Worker],
                    joined: Collection[Worker] = ()) -> None:
    """Collective over `workers` (every rank, in rank order): raise unless all hold `plan` and, but for
    `joined` workers and fresh ones (`cut` None: they hold the layers they were built with), one cut."""
    held = bytes(32) if cut is None else hashlib.sha256(repr(cut).encode()).digest()
    digest = torch.frombuffer(bytearray(hashlib.sha256(plan.to_text().encode()).digest() + held), dtype=torch.uint8)
    digest = digest.to(comm.control_device)
    gathered = [torch.empty_like(digest) for _ in range(len(workers))]
    comm.wait(dist.all_gather(gathered, digest, group=comm.control, async_op=True))
    differ = [r for r, d in enumerate(gathered) if not torch.equal(d[:32], gathered[0][:32])]
    if differ:
        raise RuntimeSetupError(f"ranks {differ} hold a different plan from rank 0: compile once and give every "
                                "rank the same plan file (or compile with identical arguments and costs)")
    cuts = {bytes(d[32:].tolist()) for r, d in enumerate(gathered) if workers[r] not in joined}
    cuts.discard(bytes(32))  # fresh workers
    if len(cuts) > 1:
        raise RecoveryError("the workers hold different cuts of the model (a failure interrupted a layer move): "
                            "restart the job from a checkpoint")
