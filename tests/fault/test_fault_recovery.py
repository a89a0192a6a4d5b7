"""The recovery-policy interface (`fault.recovery`): what each policy decides, and that the trainer
calls a policy's hooks where the interface says, a user-defined one included.

No processes: the hooks' decisions are checked on fake iterations, and `ResilientTrainer` runs a
real one-worker job in this process (its real `PipelineTrainer` and executor, gloo groups of one)
under a scripted session that stands in for the store and the other workers. A failure is an
error raised before an instruction; the session then "agrees" on the next generation at once.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import NoReturn

import pytest
import torch
import torch.nn.functional as F
from momentum import Momentum
from scripted_session import ScriptedSession, mse_reference
from torch import nn

from schedcomp import CostModel, Topology
from schedcomp.errors import RecoveryError
from schedcomp.lower import lower
from schedcomp.runtime.fault.checkpoint import latest_complete
from schedcomp.runtime.fault.recovery import OnFailure, RecoveryPolicy, RestartPolicy, RollbackPolicy, StepDecision
from schedcomp.runtime.fault.restart import EXIT_RESTART, CheckpointPolicy, restart_requested
from schedcomp.runtime.fault.rollback import Rollback
from schedcomp.runtime.lossy import LossyPolicy
from schedcomp.runtime.resilient import ResilientTrainer, recovery_policy
from schedcomp.schedules import fault_free_order

pytestmark = pytest.mark.timeout(60)

MICROBATCHES, ROWS, WIDTH, ITERATIONS = 2, 4, 3, 4


# ---- what each policy decides -----------------------------------------------------------------------


def test_names_map_to_fresh_policies_and_objects_pass_through(tmp_path) -> None:
    assert type(recovery_policy("rollback")) is RollbackPolicy
    assert type(recovery_policy("lossy")) is LossyPolicy
    assert type(recovery_policy("restart", CheckpointPolicy(tmp_path))) is RestartPolicy
    assert recovery_policy("lossy") is not recovery_policy("lossy")  # a policy holds state: one per trainer
    mine = LossyPolicy()
    assert recovery_policy(mine) is mine
    # the older spelling of the restart policy
    assert type(recovery_policy("rollback", CheckpointPolicy(tmp_path, on_failure="restart"))) is RestartPolicy


def test_bad_policies_are_one_clear_error(tmp_path) -> None:
    with pytest.raises(RecoveryError, match="unknown recovery policy 'pray': use one of rollback, lossy, restart"):
        recovery_policy("pray")
    with pytest.raises(RecoveryError, match="lacks the hooks"):
        recovery_policy(object())  # type: ignore[arg-type]
    with pytest.raises(RecoveryError, match="needs a checkpoint"):
        recovery_policy("restart")
    with pytest.raises(RecoveryError, match="would never run"):
        recovery_policy(LossyPolicy(), CheckpointPolicy(tmp_path, on_failure="restart"))


def test_rollback_and_restart_decide_nothing_but_what_to_do_on_a_failure() -> None:
    it = SimpleNamespace(number=3, ledger=torch.ones(4, dtype=torch.float64), keep_sent=False)
    for policy, keep in ((RollbackPolicy(), OnFailure.DROP), (RestartPolicy(), OnFailure.RESTART)):
        assert isinstance(policy, RecoveryPolicy)
        policy.on_iteration(it)
        assert not it.keep_sent  # nothing kept: no cost when nothing fails
        assert policy.on_step(it) == StepDecision(1.0, True)
        assert policy.on_failure(RuntimeError("peer gone")) is keep
        assert policy.finish(None, Rollback(3, frozenset())) is None  # type: ignore[arg-type]


def test_lossy_keeps_the_last_two_iterations_and_forgets_them_when_dropped() -> None:
    policy = LossyPolicy()
    its = [SimpleNamespace(number=n, keep_sent=False) for n in range(4)]
    for it in its:
        policy.on_iteration(it)
    assert policy.recent == {2: its[2], 3: its[3]} and all(it.keep_sent for it in its)
    assert policy.on_failure(RuntimeError("peer gone")) is OnFailure.KEEP and policy.intact
    policy.on_drop()
    assert policy.recent == {} and not policy.intact


@pytest.mark.parametrize(("counts", "decision"), [
    ([1.0, 1.0, 1.0, 1.0], StepDecision(1.0, True)),  # nothing lost
    ([1.0, 0.0, 1.0, 1.0], StepDecision(4 / 3, True)),  # the mean over the 3 micro-batches held
    ([0.0, 0.0, 0.0, 0.0], StepDecision(1.0, False)),  # nothing held: no step, momentum must not move it
])
def test_lossy_step_is_the_mean_over_the_microbatches_held(counts: list[float], decision: StepDecision) -> None:
    it = SimpleNamespace(number=0, ledger=torch.tensor(counts, dtype=torch.float64))
    assert LossyPolicy().on_step(it) == decision


# ---- the trainer calls the hooks: a one-worker job in this process ------------------------------------


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)).double()


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    rows = ROWS * MICROBATCHES
    return (torch.randn(rows, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(rows, 1, generator=g, dtype=torch.float64))


def fault_free() -> dict[str, torch.Tensor]:
    """The single-process reference: full-batch mean loss (= the mean over equal micro-batches), same optimizer."""
    return mse_reference(model(), batch, ITERATIONS)


def train(policy: str | RecoveryPolicy, fail_at: tuple[int, int] | None, checkpoint: CheckpointPolicy | None = None,
          leave: Callable[[int], NoReturn] | None = None, session: ScriptedSession | None = None) -> ResilientTrainer:
    """Run the one-worker job; `fail_at` = (iteration, instruction): a transfer error there, once.

    `leave` replaces `os._exit` when the job asks for a restart from its checkpoint.
    """
    plan = lower(fault_free_order("1f1b", Topology.of(1, 1), MICROBATCHES), CostModel.uniform(1))
    failed: list[tuple[int, int]] = []

    def before(iteration: int, index: int, _ins) -> None:
        if (iteration, index) == fail_at and not failed:
            failed.append(fail_at)
            raise RuntimeError("Connection closed by peer")

    trainer = ResilientTrainer(lambda _topology: plan, lambda _stage: model(), F.mse_loss, Momentum, batch,
                               session=session or ScriptedSession(), before=before, policy=policy,  # type: ignore[arg-type]
                               checkpoint=checkpoint)
    if leave is not None:
        trainer.last_resort.leave = leave
    try:
        trainer.run(ITERATIONS)
    finally:
        trainer.close()
    assert failed == ([fail_at] if fail_at is not None else [])
    return trainer


def assert_fault_free(trainer: ResilientTrainer) -> None:
    reference = fault_free()
    for name, value in trainer.state().items():
        assert torch.allclose(value, reference[name], rtol=0, atol=1e-10), name


@pytest.mark.parametrize("policy", ["rollback", "lossy"])
def test_a_failure_mid_iteration_is_recovered_through_the_policy(policy: str) -> None:
    # One worker: nothing is lost, so rollback (re-run) and lossy (finish from where it stopped)
    # both train the fault-free model; the report says which way the iteration was dealt with.
    trainer = train(policy, fail_at=(2, 3))
    assert_fault_free(trainer)
    report = trainer.report
    assert report is not None
    (recovery,) = report.recoveries
    assert (recovery.method, recovery.rerun, recovery.undone) == (policy, 2, False)
    assert sorted(report.ledger) == list(range(ITERATIONS))
    assert report.skipped == ({2: []} if policy == "lossy" else {})


class Recording(RollbackPolicy):
    """A user-defined policy: records every hook call; `skip` finishes an iteration by skipping it."""

    name = "recording"

    def __init__(self, skip: bool = False) -> None:
        self.skip, self.calls = skip, []

    def on_start(self, host, start: int) -> None:
        self.calls.append(("start", start))

    def on_iteration(self, it) -> None:
        self.calls.append(("iteration", it.number))

    def on_step(self, it) -> StepDecision:
        self.calls.append(("step", it.number))
        return StepDecision()

    def on_completed(self, it) -> None:
        self.calls.append(("completed", it.number))

    def on_failure(self, error: BaseException) -> OnFailure:
        self.calls.append(("failure", str(error)))
        return OnFailure.DROP

    def on_drop(self) -> None:
        self.calls.append(("drop",))

    def finish(self, host, decision: Rollback) -> int | None:
        self.calls.append(("finish", decision.rerun))
        assert host.trainer is not None and host.plan_for(host.session.view.topology) is host.trainer.plan
        return decision.rerun + 1 if self.skip else None


def run_of(i: int) -> list[tuple]:
    return [("iteration", i), ("step", i), ("completed", i)]


def test_a_user_policy_is_called_at_each_point_and_may_roll_back() -> None:
    policy = Recording()
    trainer = train(policy, fail_at=(2, 3))
    assert trainer.policy is policy
    assert policy.calls == [("start", 0), *run_of(0), *run_of(1), ("iteration", 2),
                            ("failure", "Connection closed by peer"), ("drop",), ("finish", 2),
                            *run_of(2), *run_of(3)]
    assert_fault_free(trainer)
    assert trainer.report is not None and trainer.report.recoveries[0].method == "rollback"


def test_a_user_policy_may_finish_the_iteration_its_own_way() -> None:
    # Skipping the interrupted iteration altogether (a policy the trainer was not written for).
    policy = Recording(skip=True)
    trainer = train(policy, fail_at=(2, 3))
    assert policy.calls[-5:] == [("drop",), ("finish", 2), *run_of(3)]
    report = trainer.report
    assert report is not None
    assert report.recoveries[0].method == "recording" and sorted(report.ledger) == [0, 1, 3]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # single-process DCP saves, by design
def test_the_restart_policy_asks_for_a_restart_instead_of_recovering(tmp_path) -> None:
    def leave(code: int) -> NoReturn:
        raise SystemExit(code)

    session = ScriptedSession()
    with pytest.raises(SystemExit) as left:
        train("restart", fail_at=(2, 3), checkpoint=CheckpointPolicy(tmp_path), leave=leave, session=session)
    assert left.value.code == EXIT_RESTART
    request = restart_requested(session.store)
    assert request is not None and request.reason == "Connection closed by peer"
    assert session.reported == []  # no recovery was tried
    assert latest_complete(tmp_path, 1) == 1  # iterations 0 and 1 were checkpointed; the save in flight waited for
