"""One worker's life in a resilient job: the few calls a training loop makes (`FaultSession`).

    session = FaultSession(WorkerEnv.from_env())
    view = session.start()                         # joins generation 0, or rejoins as a replacement
    ... build the trainer with session.generation.new_group as its group factory ...
    if session.env.rejoining:                      # receive the stage from its donor, resume where it is
        got = recv_stage_state(module, optimizer, session.groups.world, session.groups.rank_of(
            session.donor_for(stage)))
        it = got.info["iteration"]; session.commit(it - 1)
    while it < iterations:
        try:
            run iteration `it` (waits: wait_abortable(work, session.signal); after STEP: session.commit(it))
            it += 1
            switch = session.boundary(it - 1)      # a replacement is due to enter now?
            if switch: session.admit(switch); hand_over(it)
        except (GenerationAborted, RuntimeError) as e:
            session.report(e)
            session.recover()                      # agree on the next generation and regroup
            decision = session.rollback()          # undo half-applied steps, re-run decision.rerun
            if session.me in decision.undo: snapshot.restore()
            it = decision.rerun; hand_over(it)
        (then, inside the same try: session.finish() -- leave together; on a failure there, stop
        if session.finished(): everyone had arrived, a death after the meeting changes nothing)

    hand_over(it): after any change of generation, for each of `session.joiners()` at my stage, if
    `session.donor_for(stage) == session.me`: send_stage_state(..., info={"iteration": it}).

Nothing here knows about plans or stages: the caller maps the view's failed set to a plan
(the plan cache) and rebuilds its communication on `session.groups` / `session.generation`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from torch.distributed import Store

from schedcomp.runtime.comm import backend_spec, local_device, pick_backend
from schedcomp.runtime.fault.agreement import (
    CommitLog,
    Switch,
    admit,
    agree,
    agreed_switch,
    counted_failed,
    join_job,
    pending_joins,
    propose_switch,
    sealed_before,
    switch_iteration,
)
from schedcomp.runtime.fault.groups import Abort, Generation, Graveyard, Groups, regroup
from schedcomp.runtime.fault.membership import WAITER_THREAD, FailureDetector, Heartbeat, View
from schedcomp.runtime.fault.protocol import AGREEMENT_TIMEOUT, meet, met
from schedcomp.runtime.fault.rollback import Rollback, rollback_decision
from schedcomp.runtime.fault.store import Keys, WorkerEnv
from schedcomp.topology import Worker

log = logging.getLogger(__name__)


class FaultSession:
    """Membership, detection, agreement and process groups of one worker, generation after generation.

    `agree_timeout` bounds each wait of a change of generation: an agreement (`agree`, every call as a
    whole), a replacement's wait to be counted failed, and each meeting (`meet`: after an agreement, and
    the final one). Past it they raise a `RecoveryTimeout`: the worker must leave the job (exit), and its
    launcher reports it as any failure. (`ResilientTrainer` hands it to its last resort: a restart from
    checkpoints, else one line and status 1.)
    """

    def __init__(self, env: WorkerEnv, *, detection_time: float = 3.0, heartbeat: float | None = None,
                 startup_time: float = 120.0, backend: str | None = None, group_timeout: float = 60.0,
                 agree_timeout: float = AGREEMENT_TIMEOUT, lead: int = 2) -> None:
        self.env, self.me = env, env.worker
        # None: NCCL (with gloo for the CPU) when every local worker has a GPU, gloo otherwise (`comm.pick_backend`)
        self.backend = backend or pick_backend()
        self.group_timeout, self.agree_timeout, self.lead = group_timeout, agree_timeout, lead
        self.device = local_device(backend_spec(self.backend))  # "nccl": this process's GPU (LOCAL_RANK), current
        self.store: Store = env.store.connect()
        self.commits = CommitLog(self.store)
        self.heartbeat = Heartbeat(env.store, self.me, env.incarnation,
                                   interval=heartbeat if heartbeat is not None else detection_time / 6)
        self.detector = FailureDetector(env.store, self.me, detection_time=detection_time,
                                        startup_time=startup_time)
        self.graveyard = Graveyard()
        self.view: View | None = None
        self.previous: View | None = None  # the generation before the current one
        self.groups: Groups | None = None
        self.announced_at: float | None = None  # a replacement: when it announced itself
        self.admitted_at: float | None = None  # when `start` returned (joined or admitted)
        self._finals: list[tuple[str, int]] = []  # the final meetings this worker went to (key, size)

    # ---- joining -------------------------------------------------------------------------------------

    def start(self) -> View:
        """Join the job (generation 0) or, for a replacement, wait until the survivors admit it."""
        # A replacement gives no sign of life before the survivors count its predecessor failed.
        known = counted_failed(self.store, self.me, timeout=self.agree_timeout) if self.env.rejoining else None
        self.heartbeat.start()
        self.detector.start()
        if known is not None:
            view, self.announced_at = admit(self.store, self.me, self.env.incarnation, known, self.detector,
                                            timeout=self.agree_timeout)
        else:
            view = join_job(self.store, self.env.pp, self.env.dp, self.me, self.detector, timeout=self.agree_timeout)
        self._enter(view)
        self.admitted_at = time.time()
        return view

    @property
    def signal(self) -> threading.Event:
        """Set when the current generation is broken: pass it to `wait_abortable` (or `wait_work`)."""
        return self.detector.signal

    @property
    def generation(self) -> Generation:
        assert self.groups is not None, "call start() first"
        return self.groups.generation

    # ---- during an iteration ---------------------------------------------------------------------------

    def commit(self, iteration: int) -> None:
        """Record that this worker applied its optimizer step of `iteration` (right after STEP)."""
        self.commits.record(self.me, iteration)

    def report(self, error: BaseException | str, peer: Worker | None = None) -> None:
        """The executor failed talking to the others: the generation is broken."""
        self.detector.report(peer, error)

    # ---- after a failure --------------------------------------------------------------------------------

    def recover(self) -> View:
        """Leave the broken generation, agree on the next one with the other survivors, regroup."""
        assert self.view is not None and self.groups is not None, "call start() first"
        self.groups.close(self.graveyard)  # operations may still wait on the dead: bury, do not destroy
        view = agree(self.store, self.view, self.me, self.detector, timeout=self.agree_timeout)
        self._enter(view)
        return view

    def rollback(self) -> Rollback:
        """Which steps to undo and which iteration to re-run, from the survivors' commit records."""
        assert self.view is not None and self.previous is not None
        ran = [w for w in self.view.members if w in self.previous.members]  # replacements have no record yet
        return rollback_decision(self.commits.read(ran))

    # ---- at an iteration boundary ---------------------------------------------------------------------

    def boundary(self, completed: int) -> Switch | None:
        """Call after each completed iteration; returns a switch when replacements enter right now.

        Costs nothing in a fault-free job, a few store lookups per failed worker otherwise. When a
        replacement waits, the first survivor to get here fixes the iteration it enters at
        (`agreement.switch_iteration`); everyone admits it at that boundary.
        """
        assert self.view is not None
        if not self.view.failed:  # only failed workers have replacements
            return None
        switch = agreed_switch(self.store, self.view)
        if switch is None:
            joiners = pending_joins(self.store, self.view)
            if not joiners:
                return None
            switch = propose_switch(self.store, self.view, switch_iteration(completed, self.lead), joiners)
        return switch if switch.iteration == completed + 1 else None

    def admit(self, switch: Switch) -> View:
        """Move to the generation that admits `switch.joiners` (every survivor calls it at the same boundary)."""
        assert self.view is not None and self.groups is not None
        self.groups.close(self.graveyard)
        view = agree(self.store, self.view, self.me, self.detector, joiners=switch.joiners,
                     timeout=self.agree_timeout)
        self._enter(view)
        return view

    def donor_for(self, stage: int, holds: Callable[[Worker], bool] | None = None) -> Worker | None:
        """The replica that hands stage `stage`'s state to replacements: its lowest member that ran before (and, with
        `holds`, holds what the replacement will: a re-formed pipeline's worker at the place holds other layers)."""
        assert self.view is not None and self.previous is not None
        old = [w for w in self.view.topology.stage_group(stage) if w in self.previous.members
               and (holds is None or holds(w))]
        return old[0] if old else None

    def joiners(self) -> tuple[Worker, ...]:
        """Members of the current generation that were not members of the previous one."""
        assert self.view is not None
        before = self.previous.members if self.previous is not None else ()
        return tuple(w for w in self.view.members if w not in before)

    # ---- plumbing ---------------------------------------------------------------------------------------

    def _enter(self, view: View) -> None:
        """Meet the other members of `view` in the store, then build its groups; both give up
        (`GenerationAborted`) as soon as the generation breaks, e.g. a member died after the
        agreement: nobody waits for a group timeout (see `protocol.Meeting`, `groups.Abort`)."""
        # A survivor's previous generation is the one it adopted before; a replacement looks it
        # up, so that both agree on who ran before (donors, commit records). Every member of a
        # sealed generation adopts it, so this holds even when building its groups broke off.
        self.previous = self.view if self.view is not None else sealed_before(self.store, view.generation)
        self.view = view
        meet(self.store, f"gen{view.generation}/arrived", len(view.members), self.signal, timeout=self.agree_timeout)
        self.groups = regroup(self.store, view, self.me, backend=self.backend, host=self.env.bind,
                              timeout=self.group_timeout, device=self.device,
                              abort=Abort(self.env.store.connect, self.signal), graveyard=self.graveyard)
        self.graveyard.sweep()
        log.info("worker %s: generation %d, rank %d of %d", self.me, view.generation, self.groups.rank,
                 len(view.members))

    def finish(self) -> None:
        """The final meeting: return once every member of the generation got here (every worker
        trained every iteration), or raise `GenerationAborted` if the generation breaks first.

        A worker whose meeting broke asks `finished()` before recovering: a death after everyone
        arrived changes nothing, and the workers that already left must not be waited for.
        """
        assert self.view is not None
        key, size = f"gen{self.view.generation}/final", len(self.view.members)
        self._finals.append((key, size))
        if not self.finished():
            # No deadline: an arrival cannot be taken back, so a worker giving up here would leave a
            # meeting that later completes, and restart (or fail) a job that finished everywhere. A slow
            # member is legitimate here (a checkpoint save in flight); a dead or silent one trips the signal.
            meet(self.store, key, size, self.signal, timeout=None)

    def finished(self) -> bool:
        """Whether a final meeting this worker went to was complete (then the job is done everywhere)."""
        return any(met(self.store, key, size) for key, size in self._finals)

    def close(self, linger: float = 10.0) -> None:
        """Leave the job. Call it once training is over on every member (after `run` returns).

        Waits abandoned in broken generations may still block daemon threads inside gloo, and a
        daemon thread inside a C++ call when the interpreter exits aborts the process. Destroying
        every group we hold closes our end of those pairs; the peers' blocked waits then fail and
        return, and so do ours when they close theirs: wait up to `linger` seconds for them.
        """
        if self.groups is not None:
            self.groups.close()
            self.groups = None
        self.graveyard.sweep(now=float("inf"))
        deadline = time.monotonic() + linger
        for thread in threading.enumerate():
            if thread.name == WAITER_THREAD:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.detector.stop()
        self.heartbeat.stop()
        if self.finished():  # tell the others at once that we left (a worker still recovering waits for no one)
            self.store.set(Keys.dead(self.me), str(self.env.incarnation))
            self.store.add(Keys.events(), 1)
