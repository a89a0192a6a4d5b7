"""How a resilient worker starts (`ResilientTrainer.start`, which calls these with itself as `rt`).

- `start_worker(rt)`: build this worker's chunks, join the job (generation 0, or admitted as a
  replacement), build the `PipelineTrainer` for the first plan on that generation's groups (in the job's
  base cut where it can), check up front what a later switch may move, and pick the checkpoint format;
  then take the state to train from:
- `join_as_replacement(rt)`: a replacement's state from a live replica (the donor), or rebuilt by the
  logging policy's replay when none is left;
- `resume(rt, stages)`: a run's replicas synchronised and the checkpoint every worker agrees on restored
  (`fault.restart`; per layer into the plan's cut).

Each returns the iteration to run next. What a worker does between iterations is in `fault.switches`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from torch import nn

from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.runtime.fault.chunks import held_of, held_snapshot, recv_held_state
from schedcomp.runtime.fault.policies import cut_of, refuse_chunks
from schedcomp.runtime.fault.report import Rejoined, Report
from schedcomp.runtime.moves import check_movable, holds_like, job_splits_per_layer
from schedcomp.runtime.stage import build_module
from schedcomp.runtime.trainer import PipelineTrainer
from schedcomp.topology import Topology


def start_worker(rt: Any) -> int:
    """Join the job; returns the iteration to start at (0, or a replacement's resume point)."""
    session, plans = rt.session, rt.plans
    # Build the chunks before joining: a replacement's build would otherwise stall the survivors
    # at its admission (they wait for it to build its groups; 0.7 s for a 384 MB stage).
    job = Topology.of(session.env.pp, session.env.dp, chunks=plans.chunks, placement=plans.placement)
    # An nn.Sequential goes to the trainer as is: it cuts it by the plan's partition and moves its layers.
    sequential = isinstance(rt.build_stage, nn.Sequential)
    built = {} if sequential else {s: build_module(rt.build_stage, s, job.stages)
                                   for s in job.chunks_of(session.me.stage)}
    view = session.start() if session.view is None else session.view
    plan = rt.plan_for(view.topology)
    refuse_chunks(rt.policy, plan.topology.chunks)  # a plan source that is a function: known only now
    stages = plan.topology.stages
    if stages != job.stages:  # a function's first plan has chunks: the model splits otherwise
        built.clear()

    def build(s: int) -> nn.Module:  # what was built before joining, else now
        return built.pop(s) if s in built else build_module(rt.build_stage, s, stages)

    # The base cut is the healthy plan's: a plan without a partition runs it, the first one too (a
    # replacement builds the plan the survivors switch to, whose digest they compare: as it is).
    # Checkpoints hold each layer (`checkpoint_layers`), so a run whose first plan cuts elsewhere (a
    # restart short of workers) builds that cut and restores into it directly.
    base = plans.base_cut(job.pp, job.dp) if sequential else None
    own_base = sequential and not session.env.rejoining and plan.partition is None \
        and cut_of(plan, rt.build_stage) != base
    first = dataclasses.replace(plan, partition=base) if own_base else plan
    trainer = rt.trainer = PipelineTrainer(first, rt.build_stage if sequential else build, rt.loss_fn,
                                           rt.make_optimizer,
                                           process=(session.groups.rank, len(view.members),
                                                    session.generation.device),
                                           make_group=session.generation.new_group, wait=rt.wait,
                                           setup_collectives=False, seed=rt.seed, **rt.options.__dict__)
    if base is not None:
        trainer.base_partition = base
    # refused now, not in the middle of a recovery that moves one; a first plan off the base cut restores
    # per-layer checkpoints (per-stage ones would load other layers' weights)
    if plans.moves_layers or (sequential and not trainer.on_base_cut):
        for stage in trainer.stages.values():
            check_movable(stage)
    # checkpoints hold each layer where every stage's layers can move (else each stage, restored into the
    # base cut), judged alike by every worker: one job never writes both formats
    rt.per_layer = sequential and job_splits_per_layer(rt.build_stage, base, rt.make_optimizer)
    if sequential and not rt.per_layer and not session.env.rejoining and not trainer.on_base_cut \
            and rt.last_resort.schedule is not None:
        raise RuntimeSetupError("this job's checkpoints hold each stage, not each layer (some stage's optimizer "
                                "has several param groups or a tensor setting), so they restore only into the "
                                "job's own cut, but this run's first plan cuts the model elsewhere: start it with "
                                "every worker")
    rt.held = held_of(trainer.stages)  # every chunk this worker holds, by virtual stage
    rt.snapshot = held_snapshot(rt.held)
    rt.report = Report(session.me, 0, view.generation, tuple(sorted(map(str, view.failed))))
    start = join_as_replacement(rt) if session.env.rejoining else resume(rt, stages)
    trainer.iteration = rt.iteration = start
    rt.policy.on_start(rt, start)
    return start


def join_as_replacement(rt: Any) -> int:
    """A replacement's start: its stage's state from a live replica (the donor), or rebuilt by the logging
    policy's replay when none is left; returns the iteration to run next."""
    session = rt.session
    donor = session.donor_for(session.me.stage, holds_like(rt.trainer.cuts, session.me))
    rebuild = getattr(rt.policy, "rebuild", None)  # logging-based recovery replays the stage
    if donor is None and rebuild is not None:
        try:
            start = rebuild(rt)
        except RecoveryError as e:  # a parallel replay lost a worker: restart from the checkpoints
            rt.last_resort.give_up(e)
        rt.report.resumed_at = start
        session.commit(start - 1)
        return start
    if donor is None:  # (a re-formed pipeline beside it holds other spans): the job restarts from its checkpoints
        rt.last_resort.give_up(RecoveryError(f"no live replica of stage {session.me.stage} holding its layers to "
                                             "copy from: restart the job from a checkpoint"))
    receiving = time.time()
    got = recv_held_state(rt.held, session.groups.world, src=session.groups.rank_of(donor), wait=rt.wait)
    assert session.announced_at is not None and session.admitted_at is not None
    rt.report.rejoined = Rejoined(session.announced_at, session.admitted_at, receiving, time.time(), got.nbytes)
    start = int(got.info["iteration"])
    session.commit(start - 1)  # it holds the donor's state after that step
    rt.report.resumed_at = start
    return start


def resume(rt: Any, stages: int) -> int:
    """A run's start: the replicas synchronised and the checkpoint every worker agrees on restored into the
    cut the trainer was built with (`fault.restart`; per layer, so whichever cut wrote it). Returns the
    iteration to run next."""
    session = rt.session
    rt.trainer.sync_replicas()
    resumed = rt.last_resort.resume(rt.held, stages, rt.checkpoint_cut)
    start = resumed.start
    if start > 0:
        session.commit(start - 1)  # it holds the checkpoint's state after that step
    rt.report.run, rt.report.restored_from = session.env.run, resumed.restored_from
    rt.report.iterations_lost = resumed.iterations_lost
    rt.report.restart_reason = resumed.previous.reason if resumed.previous is not None else None
    return start
