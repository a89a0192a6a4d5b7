"""Random streams per micro-batch (`runtime.rng`): dropout draws the same masks in any order, on any worker.

The multi-process test trains a model with dropout on a 1F1B-like plan and then on a plan re-routed
around a failed worker (another pipeline's worker runs its micro-batches), and compares every stage
with `stream_models.stream_reference`, which runs the micro-batches in plain order in one process
(float64, 1e-10). The one-process tests show the pieces: seeds, the fork, a forward's independence
of what ran before it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from momentum import Momentum
from stream_models import SEED, noisy_stage, stream_reference
from torch import Tensor

from schedcomp import CostModel, Topology
from schedcomp.errors import RuntimeSetupError
from schedcomp.lower import lower
from schedcomp.repair import repair
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.rng import drawing, stream_seed
from schedcomp.runtime.stage import Stage
from schedcomp.schedules import fault_free_order

TOLERANCE = 1e-10
PP, DP, MICROBATCHES, ITERATIONS = 2, 2, 4, 3


def _batch(iteration: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(40 + iteration)
    rows = 2 * DP * MICROBATCHES
    return (torch.randn(rows, 8, generator=g, dtype=torch.float64),
            torch.randn(rows, 8, generator=g, dtype=torch.float64))


def test_each_key_has_its_own_stream() -> None:
    keys = [(s, i, st, p, m) for s in (0, 1) for i in (0, 1, 7) for st in (0, 3) for p in (0, 1) for m in (0, 1, 5)]
    seeds = {stream_seed(*k) for k in keys}
    assert len(seeds) == len(keys) and all(0 <= s < 1 << 63 for s in seeds)
    assert stream_seed(1, 2, 3, 4, 5) == stream_seed(1, 2, 3, 4, 5)


def test_drawing_forks_the_global_stream() -> None:
    cpu = torch.device("cpu")
    torch.manual_seed(5)
    with drawing(stream_seed(SEED, 0, 0, 0, 0), cpu):
        first = torch.rand(4)
    after = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(4))  # the global stream went on as if nothing had drawn
    torch.rand(100)  # whatever drew before, the stream's numbers are the same
    with drawing(stream_seed(SEED, 0, 0, 0, 0), cpu):
        assert torch.equal(first, torch.rand(4))
    with drawing(None, cpu):
        assert not torch.equal(first, torch.rand(4))


def test_a_forward_on_its_stream_ignores_what_ran_before() -> None:
    stage = Stage(0, PP, noisy_stage(0, PP), None, Momentum)
    x = (torch.randn(4, 8, dtype=torch.float64),)
    seed = stream_seed(SEED, 3, 0, 1, 2)
    first = stage.forward((1, 2), x, seed=seed)[0]
    stage.forward((0, 0), x, seed=stream_seed(SEED, 3, 0, 0, 0))  # another micro-batch draws in between
    again = stage.forward((1, 3), x, seed=seed)[0]
    assert torch.equal(first, again)
    assert not torch.equal(first, stage.forward((0, 1), x)[0])  # the global stream: another mask


def test_a_seed_must_be_a_whole_number() -> None:
    from schedcomp.runtime import PipelineTrainer

    plan = lower(fault_free_order("1f1b", Topology.of(1, 1), 2), CostModel.uniform(1))
    with pytest.raises(RuntimeSetupError, match="seed"):
        PipelineTrainer(plan, functools.partial(noisy_stage, pp=1), F.mse_loss, Momentum, seed=1.5,
                        process=(0, 1, torch.device("cpu")))


def _train(rank: int, plans: list, outdir: str) -> None:
    from schedcomp.runtime import PipelineTrainer

    trainer = PipelineTrainer(plans[0], functools.partial(noisy_stage, pp=PP), F.mse_loss, Momentum, seed=SEED)
    for i in range(ITERATIONS):
        if i == 1:
            trainer.use_plan(plans[1])  # re-routed: worker 0:1's micro-batches run on 1:1
        float(trainer.step(_batch(i)))
    torch.save({"worker": str(trainer.worker), "state": trainer.stage.module.state_dict(),
                "active": trainer.worker in trainer.plan.streams}, Path(outdir) / f"{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dropout_equals_the_reference_in_another_order_and_rerouted(tmp_path: Path) -> None:
    before = lower(fault_free_order("zb-h1", Topology.of(PP, DP), MICROBATCHES), CostModel.uniform(PP))
    after = repair(before, (0, 1))
    spawn(_train, PP * DP, ([before, after], str(tmp_path)), timeout=150.0)
    want = stream_reference(functools.partial(noisy_stage, pp=PP), PP, DP, MICROBATCHES, ITERATIONS, _batch)
    results = [torch.load(f) for f in sorted(tmp_path.glob("*.pt"))]
    assert len(results) == PP * DP
    checked = 0
    for r in results:
        if not r["active"]:
            continue  # the failed worker's process idles after the switch
        stage = int(r["worker"].split(":")[1])
        for name, value in want[stage].items():
            err = (r["state"][name] - value).abs().max().item()
            assert err <= TOLERANCE, (r["worker"], name, err)
        checked += 1
    assert checked == PP * DP - 1
