"""What a resilient worker does between iterations: recover from a failure, admit replacements, take a better plan.

Each is a switch to another plan (`ResilientTrainer` calls these with itself as `rt`):

- `recover(rt, error, kept)`: agree on the next generation, let the recovery policy finish the interrupted
  iteration or roll back (`roll_back`: undo this worker's step if it made one, switch to the plan of the new
  failed set), hand the state to replacements; returns the iteration to run next;
- `admit(rt, completed)`: at an iteration boundary, admit the replacements due there, regroup, hand over;
- `improve(rt, completed)`: switch to the plan source's better plan at the boundary all members agreed on
  (not to a re-cut one with a piece too small for the job's batches: `data.PieceRows`).

How a worker starts (joins, or is restored from a checkpoint) is in `fault.worker_start`.

A plan that cuts the model elsewhere (`Plan.partition`, or per pipeline `Plan.partitions`: re-formed pipelines)
moves layers at the switch (`runtime.moves`), once the policy has restored a consistent state (after the
rollback's undo), among the survivors only: replacements (`session.joiners()`) take no part, they receive
their whole state afterwards from a donor at their place that holds their layers (`moves.holds_like`).
The lossy and logging-based policies, which work one fixed stage per worker, refuse plans that change the
cut (`policies.refuse_moves`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from schedcomp.ir import Plan
from schedcomp.runtime.fault.chunks import held_of, held_snapshot, send_held_state
from schedcomp.runtime.fault.membership import GenerationAborted
from schedcomp.runtime.fault.policies import runs_pieces
from schedcomp.runtime.fault.report import Recovery
from schedcomp.runtime.fault.rollback import Rollback
from schedcomp.runtime.moves import holds_like

log = logging.getLogger(__name__)


def follow(rt: Any) -> None:
    """After a switch: the snapshot and what recovery moves follow the trainer's stages (rebuilt by a move)."""
    stages = rt.trainer.stages
    if held_of(stages) != dict(rt.held):
        rt.held = held_of(stages)
        rt.snapshot = held_snapshot(rt.held)


def regroup(rt: Any, plan: Plan) -> None:
    """Move to the session's current generation with `plan` (layers move among the survivors)."""
    session = rt.session
    rt.trainer.regroup(plan, session.groups.rank, session.generation.new_group, rt.wait, joined=session.joiners())
    follow(rt)


def recover(rt: Any, error: BaseException, kept: bool) -> int:
    """Agree on the next generation, let the policy finish the interrupted iteration or roll back, switch
    plans; returns the iteration to run next. `kept`: the iteration in flight was kept."""
    session, report = rt.session, rt.report
    noticed = time.perf_counter()
    log.warning("worker %s: generation %d broke (%s): recovering", session.me,
                session.view.generation if session.view else -1, error)
    session.report(error)
    if not kept:
        rt.drop()
    while True:
        try:
            view = session.recover()
            if session.finished():  # everyone had trained every iteration: a death after the final meeting
                return rt.iterations
            agreed = time.perf_counter() - noticed
            decision = session.rollback()
            if rt.after_recovery is not None:
                rt.after_recovery(decision.rerun)
            finished = rt.policy.finish(rt, decision)
            failed = tuple(sorted(map(str, view.failed)))
            if finished is not None:
                report.recoveries.append(Recovery(view.generation, failed, decision.rerun, False, agreed,
                                                  time.perf_counter() - noticed, rt.policy.name))
                return finished
            if kept:  # the policy declined to finish it: roll back instead
                rt.drop()
                kept = False
            undone = roll_back(rt, decision)
            report.recoveries.append(Recovery(view.generation, failed, decision.rerun, undone, agreed,
                                              time.perf_counter() - noticed))
            return decision.rerun
        except (GenerationAborted, RuntimeError) as e:  # another failure while recovering
            log.warning("worker %s: failure during recovery (%s): recovering again", session.me, e)
            session.report(e)
            rt.drop()
            kept = False


def roll_back(rt: Any, decision: Rollback) -> bool:
    """Undo this worker's step of `decision.rerun` if it made one (returns whether), forget what the report
    says of the iterations to re-run, and switch to the current generation's plan."""
    session, report = rt.session, rt.report
    undone = session.me in decision.undo
    if undone:
        rt.snapshot.restore()
        session.commit(decision.rerun - 1)  # a second recovery must not undo it again
    for i in [i for i in report.ledger if i >= decision.rerun]:
        for table in (report.ledger, report.losses, report.completed_at, report.skipped, report.skipped_samples,
                      report.updates, report.log_bytes):
            table.pop(i, None)
    regroup(rt, rt.plan_for(session.view.topology))  # the consistent state restored: layers may move now
    hand_over(rt, decision.rerun)
    return undone


def hand_over(rt: Any, resume_at: int) -> None:
    """After a change of generation: the donor of this stage sends its state (every chunk it holds) to
    each replacement."""
    session = rt.session
    stage = session.me.stage
    for joiner in session.joiners():
        if joiner.stage == stage and session.donor_for(stage, holds_like(rt.trainer.cuts, joiner)) == session.me:
            send_held_state(rt.held, session.groups.world, [session.groups.rank_of(joiner)],
                            info={"iteration": resume_at}, wait=rt.wait)
            rt.report.handed_over += 1


def admit(rt: Any, completed: int) -> None:
    """Admit replacements due at this iteration boundary (else take a better plan if one is due)."""
    session = rt.session
    switch = session.boundary(completed)
    if switch is None:
        improve(rt, completed)
        return
    view = session.admit(switch)
    regroup(rt, rt.plan_for(view.topology))
    hand_over(rt, completed + 1)
    rt.report.admitted.append(completed + 1)


def improve(rt: Any, completed: int) -> None:
    """Switch to the plan source's better plan at the boundary every member agreed on (`fault.better`)."""
    plan = rt.better.due(rt.session.view, completed) if rt.better is not None else None
    problem = rt.plans.pieces.piece_problem(plan.cut, plan.topology.dp, plan.microbatches) if plan is not None else None
    if plan is not None and plan.cut and not runs_pieces(rt.policy):  # every member decides alike: all keep theirs
        log.warning("not switching to the better plan: it re-cuts micro-batches, which the %s policy does not run",
                    rt.policy.name)
    elif problem:
        log.warning("not switching to the better plan: its piece %s at this batch size", problem)
    elif plan is not None:
        rt.plans.refuse_cut(plan)
        if plan.cut:  # later batch sizes are checked against its pieces too
            rt.plans.pieces.add(plan.cut)
        rt.trainer.use_plan(plan)
        follow(rt)
        rt.report.improved.append(completed + 1)
