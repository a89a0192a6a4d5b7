"""What crosses each stage boundary (what receivers allocate): learnt once per input shape, by a probe.

`probe_boundaries`: the first live worker of each (virtual) stage runs its module once on zeros of the
incoming shape (eval mode, no grad, random state kept, `Stage.output_meta`) and broadcasts the output
shapes and dtypes over the control group, stage by stage, as a fixed-size integer message (`encode`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from schedcomp.errors import RuntimeSetupError
from schedcomp.runtime.comm import Comm
from schedcomp.runtime.iteration import MAX_PARTS
from schedcomp.runtime.stage import Stage, TensorMeta
from schedcomp.topology import Topology

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
META_INTS = 256


def probe_boundaries(first: tuple[Tensor, ...], topology: Topology, stages: Mapping[int, Stage], comm: Comm,
                     device: torch.device) -> list[tuple[TensorMeta, ...]]:
    """The tensors crossing each boundary s -> s + 1 for the micro-batch inputs `first` (collective over
    `comm`'s control group; `stages`: this worker's, by virtual stage)."""
    boundaries, metas = [], tuple(TensorMeta.of(t) for t in first)
    for s in range(topology.stages - 1):
        src = min(comm.ranks.rank(w) for w in topology.stage_group(topology.place_of(s)))
        buffer = torch.zeros(META_INTS, dtype=torch.int64, device=comm.control_device)
        if comm.rank == src:
            x = first if s == 0 else tuple(torch.zeros(m.shape, dtype=m.dtype, device=device) for m in metas)
            buffer.copy_(encode(stages[s].output_meta(tuple(t.to(device) for t in x))))
        comm.wait(dist.broadcast(buffer, src=src, group=comm.control, async_op=True))
        metas = decode(buffer)
        if len(metas) > MAX_PARTS:
            raise RuntimeSetupError(f"stage {s} returns {len(metas)} tensors: pass at most {MAX_PARTS} "
                                    "(concatenate some)")
        boundaries.append(metas)
    return boundaries


def encode(metas: tuple[TensorMeta, ...]) -> Tensor:
    ints = [len(metas)]
    for m in metas:
        ints += [DTYPES.index(m.dtype), len(m.shape), *m.shape]
    if len(ints) > META_INTS:
        raise RuntimeSetupError(f"a stage returns too many or too large tensors to describe in {META_INTS} integers: "
                                "return fewer tensors")
    return torch.tensor(ints + [0] * (META_INTS - len(ints)), dtype=torch.int64)


def decode(buffer: Tensor) -> tuple[TensorMeta, ...]:
    ints = buffer.tolist()
    metas, pos = [], 1
    for _ in range(ints[0]):
        dtype, ndim = DTYPES[ints[pos]], ints[pos + 1]
        metas.append(TensorMeta(tuple(ints[pos + 2 : pos + 2 + ndim]), dtype))
        pos += 2 + ndim
    return tuple(metas)
