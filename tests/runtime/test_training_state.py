"""An LR schedule travels with its stage's state (`runtime.training`, `fault.transfer`, `fault.checkpoint`).

Snapshots (the rollback undo), replica transfers and checkpoints all move `transfer.stage_state`,
which holds the schedule of the stage's optimizer: undoing a step undoes the schedule's step, a
restart resumes the schedule where the checkpoint left it, and a state without one is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from momentum import ScheduledMomentum
from torch import nn

from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, restore
from schedcomp.runtime.fault.transfer import StepSnapshot, load_stage_state, stage_state
from schedcomp.runtime.stage import Stage
from schedcomp.runtime.training import attach_lr_scheduler, lr_scheduler_of

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")


def scheduled_stage(seed: int, schedule: bool = True) -> Stage:
    torch.manual_seed(seed)
    stage = Stage(0, 1, nn.Linear(3, 2).double(), None, ScheduledMomentum)
    if schedule:
        attach_lr_scheduler(stage.optimizer, lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    return stage


def train(stage: Stage, steps: int) -> None:
    for _ in range(steps):
        stage.module(torch.ones(4, 3, dtype=torch.float64)).sum().backward()
        stage.step()


def lr(stage: Stage) -> float:
    return stage.optimizer.param_groups[0]["lr"]


def test_a_step_advances_the_schedule_and_undoing_it_undoes_the_schedule() -> None:
    stage = scheduled_stage(0)
    train(stage, 2)
    assert lr(stage) == 0.05 * 0.25
    snapshot = StepSnapshot(stage.module, stage.optimizer)
    snapshot.take(2)
    train(stage, 1)
    assert lr(stage) == 0.05 * 0.125
    snapshot.restore()
    assert lr(stage) == 0.05 * 0.25 and lr_scheduler_of(stage.optimizer).last_epoch == 2
    train(stage, 1)  # and the redone step lands where it did the first time
    assert lr(stage) == 0.05 * 0.125


def test_a_checkpoint_restores_the_schedule_and_refuses_a_stage_without_one(tmp_path: Path) -> None:
    stage = scheduled_stage(0)
    train(stage, 3)
    saver = AsyncCheckpointer(tmp_path, stage=0, every=1)
    saver.save(2, stage.module, stage.optimizer)
    saver.wait()
    fresh = scheduled_stage(1)
    restore(tmp_path, 2, 0, fresh.module, fresh.optimizer)
    assert lr(fresh) == lr(stage) and lr_scheduler_of(fresh.optimizer).state_dict() == \
        lr_scheduler_of(stage.optimizer).state_dict()
    train(fresh, 1)
    train(stage, 1)
    assert lr(fresh) == lr(stage) and torch.equal(fresh.module.weight, stage.module.weight)
    plain = scheduled_stage(2, schedule=False)
    with pytest.raises(RecoveryError, match="lr_scheduler"):
        restore(tmp_path, 2, 0, plain.module, plain.optimizer)


def test_a_state_without_a_schedule_is_refused_by_a_stage_with_one() -> None:
    plain, scheduled = scheduled_stage(0, schedule=False), scheduled_stage(0)
    assert "lr_scheduler" not in stage_state(plain.module, plain.optimizer)
    with pytest.raises(RecoveryError, match="lr_scheduler"):
        load_stage_state(scheduled.module, scheduled.optimizer, stage_state(plain.module, plain.optimizer))


def test_schedulers_that_need_a_metric_or_are_not_schedulers_are_refused() -> None:
    stage = scheduled_stage(0, schedule=False)
    with pytest.raises(RuntimeSetupError, match="ReduceLROnPlateau"):
        attach_lr_scheduler(stage.optimizer, torch.optim.lr_scheduler.ReduceLROnPlateau)
    with pytest.raises(RuntimeSetupError, match="lacks step"):
        attach_lr_scheduler(stage.optimizer, lambda o: 0.1)
