"""What the replicas of each reduction share (its holders, `runtime.layout`): the lowest rank's state at
start (`sync_replicas`), and which holder counts each parameter in the global gradient norm
(`counted_params`, so replicas are not counted twice; `runtime.training`).

Without re-formed pipelines a reduction is a stage group over every parameter the worker holds; with
them, a segment over its holders on that segment's layers (`Layout.layers_of`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from schedcomp.runtime.comm import Comm, RankMap
from schedcomp.runtime.executor import segment_params
from schedcomp.runtime.layout import Layout
from schedcomp.runtime.stage import Stage
from schedcomp.topology import Worker


def sync_replicas(layout: Layout, worker: Worker, stages: dict[int, Stage], ranks: RankMap, comm: Comm) -> None:
    """Give every replica of `worker`'s stages (every holder of a segment) the lowest rank's parameters and
    buffers, reduction by reduction, in the all-reduce's order (collective over each reduction's holders)."""
    stage = next(iter(stages.values()))  # a plan with segments has no virtual stages: the only one
    for reduction in layout.reductions_of(worker):
        group = comm.stage_group(reduction.holders)
        if group is None:
            continue
        src = min(ranks.rank(w) for w in reduction.holders)
        if reduction.layers is None:
            modules = [stage.module for stage in stages.values()]
        else:
            modules = layout.layers_of(worker, stage.module, reduction.layers)
        with torch.no_grad():
            for t in [t for module in modules for t in (*module.parameters(), *module.buffers())]:
                comm.wait(dist.broadcast(t.data, src=src, group=group, async_op=True))


def counted_params(layout: Layout, worker: Worker, stage: Stage) -> list[nn.Parameter]:
    """The parameters whose gradients' norm `worker` adds to the global one: each reduction's lowest
    holder counts it (a stage's lowest live replica its stage's; with re-formed pipelines, per segment)."""
    out: list[nn.Parameter] = []
    for reduction in layout.reductions_of(worker):
        if worker == min(reduction.holders):
            out += (stage.params if reduction.layers is None
                    else segment_params(layout, worker, stage, reduction.layers))
    return out
