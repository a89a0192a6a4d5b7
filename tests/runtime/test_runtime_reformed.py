"""Until the runtime half exists, trainers refuse plans with re-formed pipelines (per-pipeline partitions)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from schedcomp.costs import CostModel
from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import Op, OpKind, Order
from schedcomp.layers import LayerCosts, stage_costs
from schedcomp.lower import lower
from schedcomp.runtime import PipelineTrainer
from schedcomp.topology import Topology, Worker


def test_a_plan_with_re_formed_pipelines_is_refused_in_one_line_before_any_process_group() -> None:
    layers = LayerCosts.even(CostModel.uniform(2), 2)
    ops = {w: tuple(Op(k, w.pipeline, m, w.stage) for m in range(2) for k in (OpKind.F, OpKind.B, OpKind.W))
           for w in (Worker(0, 0), Worker(0, 1), Worker(1, 0))}
    order = Order(Topology.of(2, 2, ["1:1"]), 2, ops, partition=(2, 2), partitions=((2, 2), (4, 0)))
    plan = lower(order, stage_costs(layers, (2, 2)), pipeline_costs={1: stage_costs(layers, (4, 0))},
                 layer_allreduce=layers.costs.allreduce)
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(4)))
    with pytest.raises(RuntimeSetupError, match="re-formed pipelines") as exc:
        PipelineTrainer(plan, model, nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1),
                        process=(0, 3, torch.device("cpu")))
    assert "\n" not in str(exc.value)
