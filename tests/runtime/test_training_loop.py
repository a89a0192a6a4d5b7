"""The training loop users expect (`runtime.training`), 4 processes against one (float64, 1e-10).

A single-process model trained with `clip_grad_norm_`, the same LR schedule and the same skip rule
(`training_models.reference_run`) is the reference for: global clipping active on some iterations
and not others, by post-validation and by the synchronous barrier; a non-finite gradient injected in
one stage skipping that iteration on every stage; the LR schedule across a plan switch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from momentum import ScheduledMomentum
from training_models import SCHEDULES, batch_for, build_stage, poison, reference_run

from schedcomp import CostModel, Plan, Topology
from schedcomp.errors import RuntimeSetupError
from schedcomp.lower import lower
from schedcomp.runtime.launch import spawn
from schedcomp.runtime.training import TrainingOptions, clip_coefficient, decide
from schedcomp.schedules import fault_free_order

ITERATIONS, TOL = 5, 1e-10
MAX_NORM = 1.5  # between the norms of the small-target (even) and large-target (odd) iterations


@dataclass(frozen=True)
class Config:
    name: str
    plans: tuple[Plan, ...]
    switch: tuple[int, ...] = (0,)
    schedule: str | None = "step"
    max_norm: float | None = MAX_NORM
    skip_nonfinite: bool = False
    grad_check: str = "post"
    poisoned: tuple[int, int] = (-1, -1)  # (stage, iteration) whose backward turns inf


def run_configs(rank: int, configs: list[Config], outdir: str) -> None:
    from schedcomp.runtime import PipelineTrainer

    torch.set_num_threads(1)
    for c in configs:
        first = c.plans[0]
        pp, dp = first.topology.pp, first.topology.dp
        trainer = PipelineTrainer(first, functools.partial(build_stage, pp=pp, poisoned=c.poisoned[0]), F.mse_loss,
                                  ScheduledMomentum, lr_scheduler=SCHEDULES[c.schedule] if c.schedule else None,
                                  max_grad_norm=c.max_norm, skip_nonfinite=c.skip_nonfinite, grad_check=c.grad_check)
        results = []
        for i in range(ITERATIONS):
            if i in c.switch[1:]:
                trainer.use_plan(c.plans[c.switch.index(i)])
            poison(trainer.stage.module, i == c.poisoned[1])
            results.append(trainer.step(batch_for(i, dp * first.microbatches)))
        outcomes = [r.outcome for r in results]
        lr = trainer.stage.optimizer.param_groups[0]["lr"]
        torch.save({"worker": str(trainer.worker), "losses": [float(r) for r in results],
                    "outcomes": [o.__dict__ if o is not None else None for o in outcomes],
                    "lr": lr, "state": trainer.stage.module.state_dict()}, Path(outdir) / f"{c.name}.{rank}.pt")


def plan_of(family: str, pp: int, dp: int) -> Plan:
    return lower(fault_free_order(family, Topology.of(pp, dp), 2 * pp), CostModel.uniform(pp))


def check(c: Config, outdir: Path) -> None:
    plan = c.plans[0]
    pp, dp = plan.topology.pp, plan.topology.dp
    want = reference_run(pp, dp * plan.microbatches, ITERATIONS, c.schedule, c.max_norm, c.skip_nonfinite, c.poisoned)
    results = [torch.load(f) for f in sorted(outdir.glob(f"{c.name}.[0-9]*.pt"))]
    assert len(results) == 4
    for r in results:
        stage = int(r["worker"].split(":")[1])
        for name, value in want["states"][stage].items():
            err = (r["state"][name] - value).abs().max().item()
            assert err <= TOL, (c.name, r["worker"], name, err)
        assert r["lr"] == pytest.approx(want["lr"][-1], abs=1e-15), (c.name, r["worker"])
        got = r["outcomes"]
        if c.max_norm is None and not c.skip_nonfinite:
            assert got == [None] * ITERATIONS
            continue
        assert [o["clipped"] for o in got] == want["clipped"], (c.name, r["worker"])
        assert [o["skipped"] for o in got] == want["skipped"], (c.name, r["worker"])
        for o, norm in zip(got, want["norms"], strict=True):
            assert (math.isfinite(o["grad_norm"]) == math.isfinite(norm))
            if math.isfinite(norm):
                assert o["grad_norm"] == pytest.approx(norm, rel=1e-12)
        finite = [loss for loss, s in zip(want["losses"], want["skipped"], strict=True) if not s]
        assert [v for v, s in zip(r["losses"], want["skipped"], strict=True) if not s] == pytest.approx(finite, abs=TOL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_clipping_skip_and_schedules_match_one_process(tmp_path: Path) -> None:
    h1, f1b = plan_of("zb-h1", 2, 2), plan_of("1f1b", 4, 1)
    configs = [
        Config("clip-post", (h1,)),
        Config("clip-barrier", (h1,), grad_check="barrier"),
        Config("skip", (f1b,), skip_nonfinite=True, poisoned=(1, 2), schedule="warmup"),
        Config("switch", (f1b, plan_of("zb-h2", 4, 1)), switch=(0, 2), schedule="warmup"),
        Config("schedule-only", (h1,), max_norm=None),
    ]
    want = reference_run(2, 2 * h1.microbatches, ITERATIONS, "step", MAX_NORM, False)
    assert any(want["clipped"]) and not all(want["clipped"]), want["norms"]  # the test means something
    spawn(run_configs, 4, (configs, str(tmp_path)), timeout=240)
    for c in configs:
        check(c, tmp_path)
    # post-validation undid and redid steps (pp = 4: stages 0-2 stay under the limit while the model
    # is over it); the barrier never steps before knowing
    assert any(o["redone"] for o in outcomes_of("switch", tmp_path))
    assert not any(o["redone"] for o in outcomes_of("clip-barrier", tmp_path))


def outcomes_of(name: str, outdir: Path) -> list[dict]:
    return [o for f in outdir.glob(f"{name}.[0-9]*.pt") for o in torch.load(f)["outcomes"]]


def test_options_are_checked_in_one_line() -> None:
    for bad in (0, -1.0, math.inf, math.nan, True):
        with pytest.raises(RuntimeSetupError, match="max_grad_norm"):
            TrainingOptions(max_grad_norm=bad)
    with pytest.raises(RuntimeSetupError, match="grad_check"):
        TrainingOptions(grad_check="sometimes")
    with pytest.raises(RuntimeSetupError, match="lr_scheduler"):
        TrainingOptions(lr_scheduler=3)  # type: ignore[arg-type]


def test_decide_follows_clip_grad_norm_and_the_skip_rule() -> None:
    options = TrainingOptions(max_grad_norm=2.0, skip_nonfinite=True)
    assert decide(options, 0, 1.0, 0.0).clipped is False
    assert decide(options, 0, 9.0, 0.0).clipped is True
    assert decide(options, 0, 9.0, 1.0).skipped is True
    assert decide(options, 0, math.inf, 0.0).skipped is True
    assert not decide(TrainingOptions(max_grad_norm=2.0), 0, math.nan, 1.0).skipped
    assert clip_coefficient(4.0, 2.0) == pytest.approx(2.0 / (4.0 + 1e-6))
    assert clip_coefficient(1.0, 2.0) == 1.0
