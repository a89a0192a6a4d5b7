"""Logging-based recovery (SWIFT, PPoPP 2023): rebuild a stage that lost every replica, not the whole job.

    trainer = ResilientTrainer(..., checkpoint=CheckpointPolicy("ckpt/", every=10),
                               logging=LoggingPolicy(where="memory", budget_bytes=1 << 30))

launched with `--respawn N` so that the launcher starts replacements. Without logging, losing
every replica of a stage restarts every worker from the last checkpoint (`fault.restart`) and
recomputes every iteration since, on every worker. With it (`SwiftPolicy`):

1. Logging (`fault.boundary_log`): each worker keeps the tensors it sent across stage boundaries
   since its neighbours' checkpoints. Random layers need nothing logged: each forward draws from
   its micro-batch's own stream (`runtime.rng`), which a replay derives again from the job's seed.
2. Recovery: the survivors agree on the next generation as for any failure and the commit
   records give the iteration to re-run, r (`rollback`). Then, in `finish`:
   - each lost stage's source is its newest complete checkpoint c <= r - 1 (first survivor's
     reading wins); every neighbour publishes which chunks it logged for that stage in
     c + 1 .. r - 1, and all check that together they cover every chunk in both directions;
   - they wait for the lost stage's replacements, admit them at once, and switch back to the
     fault-free plan: only the interrupted iteration r is dropped (a worker that stepped it
     restores its step snapshot), nothing before it is redone on any survivor;
   - each neighbour sends its log of c + 1 .. r - 1 to each replacement, which restores c and
     replays those iterations alone (`replay`: forward on the logged inputs, backward on the
     logged output gradients, one optimizer step per iteration, in order), then starts r with
     the others. The survivors go straight on with r and wait at the first transfer that needs
     the rebuilt stage.
3. Fallback: when two lost stages are adjacent, a lost stage's boundaries are not logged, it has
   no checkpoint at or before r - 1, a log has a gap (budget, or a neighbour that is itself a
   recent replacement), or no replacement shows up within the agreement timeout, `finish`
   raises `RecoveryError` saying which, and the trainer restarts the job from its checkpoints as
   without logging; the restarted run's `Report.restart_reason` is that line.

Exactness: the replacement sums the gradients of all the stage's micro-batches itself, where the
original replicas summed theirs and all-reduced: the same values up to summation order (1e-10 in
float64, as rollback). Random layers draw the same masks in the replay as in the original run,
in whatever order and on whichever worker each micro-batch is replayed (`runtime.rng`).
The replacements of a stage's replicas replay in parallel (SWIFT's parallel recovery): each its
share of the micro-batches, summing their gradients before each step; with `LoggingPolicy(helpers=k)`
idle survivors join them when the cost model says it is faster (`fault.swift_parallel`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping

from schedcomp.errors import RecoveryError
from schedcomp.runtime.executor import Iteration
from schedcomp.runtime.fault.agreement import pending_joins, propose_switch
from schedcomp.runtime.fault.boundary_log import BoundaryLog, LoggingPolicy
from schedcomp.runtime.fault.checkpoint import complete_iterations, restore
from schedcomp.runtime.fault.membership import GenerationAborted
from schedcomp.runtime.fault.protocol import await_keys
from schedcomp.runtime.fault.recovery import RecoveryHost, RollbackPolicy
from schedcomp.runtime.fault.restart import CheckpointPolicy
from schedcomp.runtime.fault.rollback import Rollback
from schedcomp.runtime.fault.swift_parallel import (
    choose_helpers,
    done_key,
    help_replay,
    helper_failed,
    post_logs,
    receive_logs,
    reducer,
    replay,
    replay_group,
    shares,
    unconfirmed,
    wait_sends,
)
from schedcomp.runtime.lossy import _exchange
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)

DROPPED = "dropped"  # a coverage record's key: receiving stage -> the newest iteration its budget dropped


def lost_stages(topology: Topology) -> list[int]:
    """Stages with no live worker."""
    return [s for s in range(topology.pp) if not topology.stage_group(s)]


class SwiftPolicy(RollbackPolicy):
    """Rollback for ordinary failures; a stage that lost every replica is rebuilt by replay (module docstring)."""

    name = "swift"

    def __init__(self, logging: LoggingPolicy, checkpoint: CheckpointPolicy) -> None:
        self.logging, self.checkpoint = logging, checkpoint
        self.host: RecoveryHost | None = None
        self.log: BoundaryLog | None = None
        self._parallel: dict[int, int] = {}  # lost stage -> generation of its parallel replay, until confirmed

    # ---- logging ---------------------------------------------------------------------------------

    def on_start(self, host: RecoveryHost, start: int) -> None:
        self.host = host
        self.log = BoundaryLog(self.logging, host.session.me)

    def on_iteration(self, it: Iteration) -> None:
        it.keep_sent = True  # logged in `on_completed`

    def on_completed(self, it: Iteration) -> None:
        assert self.host is not None and self.log is not None and self.host.report is not None
        report, me = self.host.report, it.worker
        report.log_bytes[it.number] = self.log.add(it.number, it.sent)
        for neighbour in (me.stage - 1, me.stage + 1):
            done = complete_iterations(self.checkpoint.directory, neighbour) if 0 <= neighbour < it.plan.topology.pp \
                else []
            if len(done) >= 2:  # see `boundary_log`: the log reaches back to the second newest
                self.log.prune(neighbour, done[-2])
        report.log_peak = self.log.peak
        if self._parallel:  # a store read per iteration only until the parallel replay is confirmed
            self._parallel = {s: g for s, g in self._parallel.items()
                              if not self.host.session.store.check([done_key(g, s)])}

    # ---- recovery on the survivors --------------------------------------------------------------

    def finish(self, host: RecoveryHost, decision: Rollback) -> int | None:
        """Rebuild lost stages by replay and return the iteration to run next (None: not a lost stage, or fall back)."""
        session = host.session
        assert session.view is not None and self.log is not None and host.report is not None
        assert host.trainer is not None
        stalled = unconfirmed(host, self._parallel)
        if stalled is not None:  # a replayer died in a parallel replay: the stage is half rebuilt
            raise helper_failed(stalled)
        lost = lost_stages(session.view.topology)
        if not lost:
            return None  # a replica is left everywhere: rollback and re-planning
        sources = self._sources(host, lost, decision.rerun)
        joiners = self._replacements(host, lost)
        rerun = decision.rerun
        plan = host.trainer.plan
        helpers = choose_helpers(plan.costs, lost, {s: rerun - 1 - c for s, c in sources.items()},
                                 session.env.dp * plan.microbatches, list(session.view.members),
                                 self.logging.helpers)
        session.admit(propose_switch(session.store, session.view, rerun, joiners))
        record = json.loads(session.store.compare_set(f"swift/gen{session.view.generation}", "", json.dumps(
            {"rerun": rerun, "from": {str(s): c for s, c in sources.items()}, "seed": host.trainer.seed,
             "helpers": {str(s): [str(w) for w in ws] for s, ws in helpers.items()}})))
        helpers = _helpers(record)
        self._parallel.update({s: session.view.generation for s in helpers})  # confirmed by the replacement
        self.log.discard_from(rerun)  # re-run, logged again
        host.roll_back(decision)
        me, world = session.me, session.groups.world
        replayers = {s: sorted(w for w in joiners if w.stage == s) + helpers.get(s, []) for s in lost}
        groups = {s: replay_group(host, replayers[s]) for s in sorted(helpers)}  # every member, in order
        pending = []
        for s, c in sources.items():
            if abs(me.stage - s) == 1 and c + 1 < rerun:  # a neighbour, with something to replay
                split = shares(replayers[s], session.env.dp, plan.microbatches)
                pending += post_logs(self.log, s, range(c + 1, rerun),
                                     {session.groups.rank_of(w): share for w, share in split.items()}, world,
                                     session.groups.rank)
        for s, ws in helpers.items():
            if me in ws:
                help_replay(host, self.log, self.checkpoint.directory, s, sources[s], rerun, host.trainer.seed,
                            shares(replayers[s], session.env.dp, plan.microbatches)[me], groups[s], replayers[s])
        wait_sends(host, pending)
        log.warning("worker %s: stage(s) %s rebuilt by replay from checkpoint(s) %s (helpers %s); going on with "
                    "iteration %d", me, lost, sources, {s: list(map(str, ws)) for s, ws in helpers.items()}, rerun)
        return rerun

    def _sources(self, host: RecoveryHost, lost: list[int], rerun: int) -> dict[int, int]:
        """Each lost stage's checkpoint to replay from, once all agree the logs cover it.

        Raises `RecoveryError` saying why not: the trainer restarts the job from its checkpoints, and
        the restarted run's `Report.restart_reason` carries that line.
        """
        session, pp = host.session, host.session.env.pp
        assert session.view is not None and self.log is not None and host.trainer is not None
        me, generation = session.me, session.view.generation
        complete = {s: complete_iterations(self.checkpoint.directory, s) for s in lost}
        proposal, _ = replay_sources(lost, pp, self.logging, complete, rerun)
        # The first survivor's reading wins: a checkpoint completing meanwhile must not split them.
        sources = {int(s): c for s, c in json.loads(session.store.compare_set(
            f"swift/gen{generation}/from", "", json.dumps({str(s): c for s, c in proposal.items()}))).items()}
        _, why = replay_sources(lost, pp, self.logging, {s: [c] for s, c in sources.items()}, rerun)
        mine = {str(s): {str(j): [list(k) for k in keys]
                         for j, keys in self.log.coverage(s, range(c + 1, rerun)).items()}
                for s, c in sources.items() if abs(me.stage - s) == 1}
        mine[DROPPED] = {str(s): self.log.gaps.get(s, -1) for s in sources}  # what the budget made it drop
        records = _exchange(host, f"swift/gen{generation}/coverage", mine)
        if why is None:
            why = _gap(records, sources, rerun, pp, session.env.dp, host.trainer.plan.microbatches)
        if why is not None:
            raise _cannot_replay(lost, why)
        return sources

    def _replacements(self, host: RecoveryHost, lost: list[int]) -> frozenset[Worker]:
        """Wait until a replacement of every worker of the lost stages has announced itself (`RecoveryError`: none
        came within the agreement timeout)."""
        session = host.session
        view = session.view
        assert view is not None
        needed = frozenset(w for w in view.failed if w.stage in lost)
        deadline = time.monotonic() + session.agree_timeout
        while pending_joins(session.store, view) & needed != needed:
            if time.monotonic() > deadline:
                raise _cannot_replay(lost, "no replacement came")
            if session.signal.wait(0.005):
                raise GenerationAborted("a member failed while waiting for replacements: agree again")
        return needed

    # ---- recovery on a replacement -------------------------------------------------------------------

    def rebuild(self, host: RecoveryHost) -> int:
        """A replacement of a lost stage: restore its checkpoint, replay the logs; returns the iteration to run next."""
        session, trainer, report = host.session, host.trainer, host.report
        assert session.view is not None and trainer is not None and report is not None
        me, view, store = session.me, session.view, session.store
        key = f"swift/gen{view.generation}"
        await_keys(store, [key], session.signal, timeout=session.agree_timeout,
                   what=f"the survivors' record of what to replay ({key})")
        record = json.loads(store.get(key))
        rerun, source = int(record["rerun"]), int(record["from"][str(me.stage)])
        trainer.seed = record["seed"]  # the survivors' random streams, whatever this process was given
        stage = trainer.stage
        restore(self.checkpoint.directory, source, me.stage, stage.module, stage.optimizer, host.checkpoint_cut)
        joiners = set(session.joiners())
        helpers = _helpers(record)
        replayers = sorted(w for w in joiners if w.stage == me.stage) + helpers.get(me.stage, [])
        iterations = range(source + 1, rerun)
        # SWIFT's parallel replay: the stage's replacements (and helpers) split its micro-batches and sum
        # their gradients, over the stage's group (replacements alone) or a group of their own (with helpers).
        share = shares(replayers, session.env.dp, trainer.plan.microbatches)[me]
        began = time.perf_counter()
        try:
            groups = {s: replay_group(host, sorted(w for w in joiners if w.stage == s) + ws)  # every member, in order
                      for s, ws in sorted(helpers.items())}
            group = groups.get(me.stage, trainer.comm.stage_group(trainer.plan.topology.stage_group(me.stage)))
            inputs, grads = receive_logs(host, me.stage, (w for w in view.members if w not in joiners)) \
                if len(iterations) else ({}, {})
            replay(stage, iterations, inputs, grads, trainer.seed, host.batch_for, session.env.dp,
                   trainer.plan.microbatches, trainer.device, share, reducer(host, group))
        except (GenerationAborted, RuntimeError) as e:
            if me.stage in helpers:  # a replayer died: no second replay, restart (`swift_parallel`)
                raise helper_failed(me.stage) from e
            raise
        if me.stage in helpers and me == replayers[0]:
            store.set(done_key(view.generation, me.stage), "1")
        report.replayed = list(iterations)
        report.replay_share = [list(k) for k in share]
        report.replayed_with = [str(w) for w in replayers]
        report.replay_seconds = time.perf_counter() - began
        report.restored_from = source
        log.warning("worker %s: rebuilt stage %d from checkpoint %d by replaying %d iterations", me, me.stage, source,
                    len(iterations))
        return rerun


def _helpers(record: Mapping) -> dict[int, list[Worker]]:
    """The survivors' record's helpers: lost stage -> the survivors that replay part of it."""
    return {int(s): [Worker.parse(w) for w in ws] for s, ws in record.get("helpers", {}).items()}


def replay_sources(lost: list[int], pp: int, logging: LoggingPolicy, complete: Mapping[int, list[int]],
                   rerun: int) -> tuple[dict[int, int], str | None]:
    """Each lost stage's checkpoint to replay from (-1: none), and why replay cannot go on (None: it can).

    `complete[s]`: the iterations stage s has complete checkpoints of; `rerun`: the iteration the
    survivors go on with, so each lost stage must be rebuilt to its state after `rerun - 1`.
    """
    sources = {s: max((i for i in complete.get(s, []) if i < rerun), default=-1) for s in lost}
    if any(s + 1 in lost for s in lost):
        return sources, "adjacent stages lost"
    if not all(logging.replayable(s, pp) for s in lost):
        return sources, "a lost stage's boundaries are not logged"
    if min(sources.values()) < 0:
        return sources, "no checkpoint of a lost stage before the iteration to re-run"
    return sources, None


def _cannot_replay(lost: list[int], why: str) -> RecoveryError:
    """The fallback's one line: the trainer restarts from checkpoints with it as the restart's reason."""
    return RecoveryError(f"stage(s) {', '.join(map(str, lost))} lost, cannot replay ({why})")


def _gap(records: Mapping[Worker, dict], sources: Mapping[int, int], rerun: int, pp: int, dp: int,
         microbatches: int) -> str | None:
    """What the neighbours' logs miss of the iterations to replay (None: nothing)."""
    every = {(p, m) for p in range(dp) for m in range(microbatches)}
    for s, c in sources.items():
        for neighbour in (n for n in (s - 1, s + 1) if 0 <= n < pp):
            for j in range(c + 1, rerun):
                held = {tuple(k) for w, r in records.items() if w.stage == neighbour
                        for k in r.get(str(s), {}).get(str(j), [])}
                if held != every:
                    dropped = any(r.get(DROPPED, {}).get(str(s), -1) >= j for w, r in records.items()
                                  if w.stage == neighbour)
                    return f"stage {neighbour} holds {len(held)} of the {len(every)} chunks it sent stage {s} " \
                           f"in iteration {j}" + (", dropped over the log budget" if dropped else "")
    return None
