"""Single-process pieces of the runtime: micro-batch addressing, stage splitting, rank mapping, shape messages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from schedcomp.compiler import compile
from schedcomp.errors import RuntimeSetupError
from schedcomp.runtime.comm import RankMap
from schedcomp.runtime.data import chunk_index, micro_batch
from schedcomp.runtime.shapes import decode, encode
from schedcomp.runtime.stage import TensorMeta, build_module, even_split
from schedcomp.topology import Worker


def test_micro_batch_m_of_pipeline_p_is_chunk_p_times_m_plus_m() -> None:
    dp, microbatches = 2, 3
    rows = torch.arange(dp * microbatches * 2)  # 2 rows per micro-batch
    seen = []
    for p in range(dp):
        for m in range(microbatches):
            index = chunk_index(p, m, microbatches)
            assert index == p * microbatches + m
            chunk = micro_batch(rows, index, dp * microbatches)
            seen += chunk.tolist()
            assert chunk.tolist() == [2 * index, 2 * index + 1]
    assert seen == rows.tolist()  # every sample exactly once
    x, ids = micro_batch((torch.zeros(12, 4), torch.arange(12)), 5, 6)  # tuples are cut alike
    assert x.shape == (2, 4) and ids.tolist() == [10, 11]


def test_micro_batch_refuses_uneven_batches() -> None:
    with pytest.raises(RuntimeSetupError, match="multiple of 4"):
        micro_batch(torch.zeros(10, 3), 0, 4)


def test_sequential_split_by_layer_counts() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(5)))
    assert even_split(5, 3) == (2, 2, 1)
    parts = [build_module(model, s, 3) for s in range(3)]
    assert [len(p) for p in parts] == [2, 2, 1]
    assert parts[2][0] is model[4]
    assert [len(build_module(model, s, 2, layers_per_stage=[1, 4])) for s in range(2)] == [1, 4]
    with pytest.raises(RuntimeSetupError, match="summing to the model's 5 layers"):
        build_module(model, 0, 2, layers_per_stage=[1, 3])
    with pytest.raises(RuntimeSetupError, match="at least one layer per stage"):
        even_split(2, 3)
    with pytest.raises(RuntimeSetupError, match=r"return an nn\.Module"):
        build_module(lambda s: "not a module", 0, 1)  # type: ignore[arg-type,return-value]


def test_ranks_are_the_live_workers_in_sorted_order() -> None:
    plan = compile(2, 3, microbatches=4, failed=[(1, 0)], schedule="adaptive", time_limit=2.0)
    ranks = RankMap.of(plan)
    assert ranks.workers == (Worker(0, 0), Worker(0, 1), Worker(1, 1), Worker(2, 0), Worker(2, 1))
    assert [ranks.rank(w) for w in ranks.workers] == list(range(5))
    with pytest.raises(RuntimeSetupError, match="has no process"):
        ranks.rank(Worker(1, 0))
    with pytest.raises(RuntimeSetupError, match="launch exactly 5"):
        ranks.worker(5)


def test_shape_messages_round_trip() -> None:
    metas = (TensorMeta((4, 8, 16), torch.float32), TensorMeta((4, 8), torch.int64), TensorMeta((), torch.bfloat16))
    assert decode(encode(metas)) == metas
    assert [m.has_grad for m in metas] == [True, False, True]
    with pytest.raises(RuntimeSetupError, match="fewer tensors"):
        encode(tuple(TensorMeta((1,) * 8, torch.float32) for _ in range(40)))


def test_a_plan_with_virtual_stages_splits_a_sequential_into_pp_times_v_stages() -> None:
    from schedcomp.runtime.trainer import PipelineTrainer

    plan = compile(2, microbatches=4, schedule="zb-v")  # pp 2, two chunks each: four stages
    with pytest.raises(RuntimeSetupError, match="cannot split 3 layers into 4 stages"):
        PipelineTrainer(plan, nn.Sequential(*(nn.Linear(2, 2) for _ in range(3))), nn.MSELoss(),
                        lambda p: torch.optim.SGD(p, lr=0.1), process=(0, 2, torch.device("cpu")))
