"""Mixed precision in the pipeline (`PipelineTrainer(autocast=...)`, `runtime.training`), 4 processes (pp 2, dp 2).

bfloat16: F and the loss run under torch.autocast, the loss falls, parameters and their gradients
stay float32. float16: the loss is scaled by a dynamic scale that every worker updates alike from
the global overflow flag; an overflow injected in one stage of one pipeline skips the update on
every stage and replica and halves the scale everywhere.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from momentum import ScheduledMomentum
from training_models import H, poison

from schedcomp import CostModel, Topology
from schedcomp.errors import RuntimeSetupError
from schedcomp.lower import lower
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.training import LossScaler, TrainingOptions
from schedcomp.schedules import fault_free_order

ITERATIONS, POISONED = 8, (0, 3)  # (stage, iteration) of the injected overflow, float16 run


def build(stage: int, poisoned: int) -> torch.nn.Module:
    from training_models import Poison

    torch.manual_seed(40 + stage)
    layers = [torch.nn.Linear(H, 4 * H), torch.nn.GELU(), torch.nn.Linear(4 * H, H)]
    return torch.nn.Sequential(*layers, *([Poison()] if stage == poisoned else []))


def run(rank: int, outdir: str) -> None:
    from schedcomp.runtime import PipelineTrainer

    torch.set_num_threads(1)
    plan = lower(fault_free_order("zb-h1", Topology.of(2, 2), 4), CostModel.uniform(2))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8 * 4, H, generator=g)
    y = torch.tanh(x @ torch.randn(H, H, generator=g))
    for dtype in (torch.bfloat16, torch.float16):
        poisoned = POISONED[0] if dtype == torch.float16 else -1
        trainer = PipelineTrainer(plan, functools.partial(build, poisoned=poisoned), F.mse_loss,
                                  lambda p: ScheduledMomentum(p, lr=0.1, momentum=0.5), autocast=dtype)
        losses, skipped, scales = [], [], []
        for i in range(ITERATIONS):
            poison(trainer.stage.module, trainer.worker.pipeline == 1 and i == POISONED[1])
            result = trainer.step((x, y))
            losses.append(float(result))
            skipped.append(result.skipped)
            scales.append(trainer.stage.scaler.scale if trainer.stage.scaler is not None else None)
        trainer.settle()
        torch.save({"losses": losses, "skipped": skipped, "scales": scales,
                    "dtypes": sorted({str(p.dtype) for p in trainer.stage.module.parameters()})},
                   Path(outdir) / f"{str(dtype).removeprefix('torch.')}.{rank}.pt")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_trains_with_float32_master_weights_and_fp16_skips_overflows_everywhere(tmp_path: Path) -> None:
    spawn(run, 4, (str(tmp_path),), timeout=240)
    for name in ("bfloat16", "float16"):
        results = [torch.load(f) for f in sorted(tmp_path.glob(f"{name}.[0-9]*.pt"))]
        assert len(results) == 4
        for r in results:
            assert r["dtypes"] == ["torch.float32"], name
            kept = [v for v, s in zip(r["losses"], r["skipped"], strict=True) if not s]
            falling = all(b < a for a, b in itertools.pairwise(kept))
            assert falling and kept[-1] < 0.97 * kept[0], (name, r["losses"])
        if name == "float16":
            for r in results:  # every stage and replica skipped exactly the poisoned iteration
                assert r["skipped"] == [i == POISONED[1] for i in range(ITERATIONS)]
                assert r["scales"] == [2.0 ** 16] * POISONED[1] + [2.0 ** 15] * (ITERATIONS - POISONED[1])
        else:
            assert all(not any(r["skipped"]) for r in results)


def test_loss_scaler_halves_on_overflow_and_grows_after_a_clean_run() -> None:
    scaler = LossScaler(scale=8.0, interval=2)
    scaler.update(overflow=True)
    assert scaler.scale == 4.0
    scaler.update(overflow=False)
    assert scaler.scale == 4.0
    scaler.update(overflow=False)
    assert scaler.scale == 8.0
    copy = LossScaler()
    copy.load_state_dict(scaler.state_dict())
    assert copy.state_dict() == scaler.state_dict()


def test_autocast_takes_half_precisions_only() -> None:
    with pytest.raises(RuntimeSetupError, match="autocast"):
        TrainingOptions(autocast=torch.float64)
    assert TrainingOptions(autocast=torch.float16).checks_globally
    assert not TrainingOptions(autocast=torch.bfloat16).checks_globally
