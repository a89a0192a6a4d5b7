"""What crosses each stage boundary (what receivers allocate): learnt once per input shape, by a probe.

`probe_boundaries`: the first live worker of each (virtual) stage runs its module once on zeros of the
incoming shape (eval mode, no grad, random state kept, `Stage.output_meta`) and broadcasts the output
shapes and dtypes over the control group, stage by stage, as a fixed-size integer message (`encode`).
With re-formed pipelines the stages of different pipelines end at different layers: every cut of any
pipeline is probed, in layer order (`runtime.layout`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from schedcomp.errors import RuntimeSetupError
from schedcomp.runtime.comm import Comm
from schedcomp.runtime.iteration import MAX_PARTS
from schedcomp.runtime.layout import Layout
from schedcomp.runtime.stage import Stage, TensorMeta
from schedcomp.topology import Topology

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
META_INTS = 256


def probe_boundaries(first: tuple[Tensor, ...], layout: Layout, topology: Topology, stages: Mapping[int, Stage],
                     comm: Comm, device: torch.device) -> dict[int, tuple[TensorMeta, ...]]:
    """The tensors crossing each boundary inside the model for the micro-batch inputs `first`, keyed by the
    unit they fall before (`runtime.layout`; without per-pipeline partitions: boundary s -> s + 1 is key
    s + 1). Collective over `comm`'s control group; `stages`: this worker's, by virtual stage. Cuts go in
    increasing order, so a stage's incoming shapes are known when it is probed: the lowest-rank live worker
    whose stage ends at the cut runs it."""
    place_of = {s: topology.place_of(s) for s in range(topology.stages)}
    known: dict[int, tuple[TensorMeta, ...]] = {0: tuple(TensorMeta.of(t) for t in first)}
    cuts = sorted({held.stop for spans in layout.spans for held in spans if len(held)} - {layout.units})
    for cut in cuts:
        src_worker, s = min(layout.sources(cut, place_of), key=lambda ws: comm.ranks.rank(ws[0]))
        src = comm.ranks.rank(src_worker)
        buffer = torch.zeros(META_INTS, dtype=torch.int64, device=comm.control_device)
        if comm.rank == src:
            start = layout.span(src_worker.pipeline, s).start
            x = first if start == 0 else tuple(torch.zeros(m.shape, dtype=m.dtype, device=device)
                                               for m in known[start])
            buffer.copy_(encode(stages[s].output_meta(tuple(t.to(device) for t in x))))
        comm.wait(dist.broadcast(buffer, src=src, group=comm.control, async_op=True))
        metas = decode(buffer)
        if len(metas) > MAX_PARTS:
            raise RuntimeSetupError(f"stage {s} returns {len(metas)} tensors: pass at most {MAX_PARTS} "
                                    "(concatenate some)")
        known[cut] = metas
    del known[0]
    return known


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
