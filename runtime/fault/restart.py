"""The last resort: checkpoint while training, and restart the whole job when a stage is gone.

    trainer = ResilientTrainer(..., checkpoint=CheckpointPolicy("ckpt/", every=10))

launched with `python -m schedcomp.runtime.fault.launch --max-restarts 3 ...`. What happens:

- After STEP of every `every`-th iteration, each stage's checkpoint writer (its lowest live
  replica, `checkpoint.checkpoint_writer`) starts an asynchronous save of its stage
  (`checkpoint.AsyncCheckpointer`: the state is copied, then written in the background, at most
  one save in flight per worker). Stages never wait for each other.
- When recovery cannot go on by re-planning (every replica of a stage is gone, so the plan cache
  has no plan, or the commit records cannot be reconciled), each survivor waits for its own save
  in flight, records a restart request in the store (`RestartRequest`: the reason and the highest
  iteration any worker committed; first writer wins) and leaves at once with status
  `EXIT_RESTART` (one line in the log, no traceback; `os._exit`, because threads still blocked on
  the dead peers' connections make the interpreter's normal shutdown abort). Under
  `ResilientTrainer(policy="restart")` (`recovery.RestartPolicy`) it does so on every failure,
  without re-planning (to measure the job under plain checkpoint-restart).
- The launcher sees the request, stops every worker and starts the job again as run k + 1 in a
  fresh key namespace of the same store (`store.run_store`), with the request copied to
  `restart/previous`. On start, every worker of the new run takes the newest iteration all stages
  have a complete checkpoint of (`checkpoint.latest_complete`; with an `nn.Sequential` model, whose
  checkpoints hold each layer, the newest whose stages hold every layer, written under any cut; the
  first worker to look fixes it for everyone in `restart/restored`), restores its own stage from it
  (per layer: the layers its first plan's cut gives it) and starts at the next iteration.
  `Report.restored_from` and `Report.iterations_lost` say where it resumed and how many
  iterations the restart threw away (the previous run's highest commit minus the checkpoint;
  without a checkpoint the job starts again at iteration 0 and loses them all).
- Without a `CheckpointPolicy` a lost stage ends the worker with a one-line error (status 1).

Why a checkpoint never has to be withdrawn after a rollback: a stage steps iteration i only after
its gradient all-reduce completed, i.e. with the full gradient of i, from its pre-step state of
i. Rollback undoes such a step only to re-run iteration i on the same batch from that same
pre-step state (restored bit-exactly), so the re-run step gives the same state, up to the order
in which the new plan sums the micro-batch gradients: exactly the guarantee rollback itself gives
(checked at 1e-10 against the fault-free model by the chaos tests). A checkpoint of (i, stage) is
therefore the fault-free state after step i whether or not that step was later undone and
re-done, and a complete one is never rewritten (`AsyncCheckpointer.save` skips it): rewriting it
in place could leave a torn file behind a valid manifest if the writer died meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from schedcomp.errors import RecoveryError
from schedcomp.partition import Partition
from schedcomp.runtime.fault.checkpoint import AsyncCheckpointer, checkpoint_writer, latest_complete, restore
from schedcomp.runtime.fault.chunks import Held
from schedcomp.runtime.fault.session import FaultSession
from schedcomp.runtime.fault.store import Keys, get_int
from schedcomp.topology import Topology

log = logging.getLogger(__name__)

EXIT_RESTART = 75  # EX_TEMPFAIL: this worker left so that the job restarts from its checkpoint
REPLAN, RESTART = "replan", "restart"


@dataclass(frozen=True)
class CheckpointPolicy:
    """The checkpoint schedule: every `every` iterations into `directory`; restart from there when a stage is lost.

    `on_failure`: "replan" (default: recover as the trainer's recovery policy says; restart only
    when re-planning cannot go on) or "restart", the older spelling of
    `ResilientTrainer(policy="restart")` (`recovery.RestartPolicy`), kept for existing jobs.
    """

    directory: Path
    every: int = 1
    on_failure: str = REPLAN

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", Path(self.directory))
        if self.every < 1:
            raise RecoveryError(f"checkpoint interval must be at least 1 iteration, got {self.every}")
        if self.on_failure not in (REPLAN, RESTART):
            raise RecoveryError(f"on_failure must be {REPLAN!r} or {RESTART!r}, got {self.on_failure!r}")


@dataclass(frozen=True)
class RestartRequest:
    """Why run `run` asked for a restart, and the highest iteration any of its workers committed."""

    reason: str
    reached: int
    run: int

    def to_json(self) -> str:
        return json.dumps({"reason": self.reason, "reached": self.reached, "run": self.run})

    @classmethod
    def from_json(cls, text: str | bytes) -> RestartRequest:
        d = json.loads(text)
        return cls(str(d["reason"]), int(d["reached"]), int(d["run"]))


def leave(code: int) -> NoReturn:
    """End this worker now with status `code` (logs and standard streams flushed first).

    Not `sys.exit`: after a failure, gloo waits of the broken generation may still block in
    daemon threads; the interpreter's shutdown would join or kill them inside C++ and abort.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def request_restart(store, request: RestartRequest) -> RestartRequest:
    """Record `request` unless a worker already did; returns the request that stands (first writer wins)."""
    return RestartRequest.from_json(store.compare_set(Keys.restart(), "", request.to_json()))


def restart_requested(store) -> RestartRequest | None:
    """The restart request of the run whose namespace `store` is, if any (never blocks)."""
    return RestartRequest.from_json(store.get(Keys.restart())) if store.check([Keys.restart()]) else None


def highest_commit(store, topology: Topology) -> int:
    """The highest iteration any worker of `topology`, dead or alive, recorded a step of (-1: none)."""
    return max((get_int(store, Keys.commit(w)) for w in Topology.of(topology.pp, topology.dp).workers), default=-1)


@dataclass(frozen=True)
class Resumed:
    """Where a run starts: the checkpoint restored (None: none, from scratch) and what the restart lost."""

    restored_from: int | None
    iterations_lost: int | None  # None in a first run: nothing was lost
    previous: RestartRequest | None

    @property
    def start(self) -> int:
        return self.restored_from + 1 if self.restored_from is not None else 0


class LastResort:
    """One worker's share of checkpoint-restart: resume at start, save after STEP, give up on a lost stage.

    Checkpoints are per model chunk: a worker holding several (virtual stages, `fault.chunks`)
    writes and restores each under its own virtual stage, `checkpoint_dir(directory, iteration, s)`;
    an `nn.Sequential` model's hold each layer's state (`checkpoint_layers`), so they are written
    under whatever cut the job runs and restore into any other.
    """

    def __init__(self, schedule: CheckpointPolicy | None, session: FaultSession,
                 leave: Callable[[int], NoReturn] = leave) -> None:
        self.schedule, self.session, self.leave = schedule, session, leave
        self.checkpointers: dict[int, AsyncCheckpointer] = {}  # by virtual stage, one save in flight each

    def resume(self, held: Held, stages: int, cut: Partition | None = None) -> Resumed:
        """Restore the checkpoint every worker of this run agrees on (the first to look picks it) into
        the chunks `held`; `stages`: the model's (virtual) stages, every one of which must have it. With
        `cut` (an `nn.Sequential` model's partition) the checkpoints are per layer: any iteration whose
        stage checkpoints hold every layer, written under any cut, restores into this one."""
        store, env = self.session.store, self.session.env
        previous = (RestartRequest.from_json(store.get(Keys.previous_run()))
                    if store.check([Keys.previous_run()]) else None)
        if self.schedule is None:
            return Resumed(None, None, previous)
        mine = latest_complete(self.schedule.directory, stages, sum(cut) if cut is not None else None)
        agreed = json.loads(store.compare_set(Keys.restored(), "", json.dumps(mine)))
        if agreed is not None:
            for s, (module, optimizer) in held.items():
                restore(self.schedule.directory, agreed, s, module, optimizer, cut)
            log.warning("worker %s: restored the checkpoint of iteration %d", env.worker, agreed)
        lost = None if previous is None else previous.reached - (agreed if agreed is not None else -1)
        return Resumed(agreed, lost, previous)

    def after_step(self, iteration: int, held: Held, cut: Partition | None = None) -> None:
        """Right after STEP of `iteration` (and its commit record): save every chunk held, if due and this
        worker writes (`cut`: the model's current partition, under which each layer is saved)."""
        if self.schedule is None:
            return
        view = self.session.view
        assert view is not None
        me = self.session.me
        writer = checkpoint_writer(view.topology, me.stage) == me
        for s, (module, optimizer) in held.items():
            if s not in self.checkpointers:
                self.checkpointers[s] = AsyncCheckpointer(self.schedule.directory, s, self.schedule.every)
            self.checkpointers[s].after_step(iteration, module, optimizer, writer, cut)

    def give_up(self, error: BaseException) -> NoReturn:
        """The job cannot go on by re-planning: ask for a restart (or, without checkpoints, just leave)."""
        me, session = self.session.me, self.session
        if session.view is None:  # never joined a generation: there is no job to restart from here
            log.error("worker %s: %s (before joining the job)", me, _one_line(error))
            self.leave(1)
        if self.schedule is None:
            log.error("worker %s: %s (no checkpoints to restart from: pass checkpoint=CheckpointPolicy(...))",
                      me, _one_line(error))
            self.leave(1)
        for checkpointer in self.checkpointers.values():
            try:
                checkpointer.wait()  # a save in flight may be the newest complete checkpoint
            except Exception as e:  # a failed save only makes the restart go further back
                log.warning("worker %s: checkpoint in flight failed (%s)", me, e)
        view = session.view
        assert view is not None
        mine = RestartRequest(_one_line(error), highest_commit(session.store, view.topology), session.env.run)
        request = request_restart(session.store, mine)
        log.error("worker %s: %s: restarting the job from its latest checkpoint (reached iteration %d)",
                  me, request.reason, request.reached)
        self.leave(EXIT_RESTART)

    def close(self) -> None:
        """Wait for the saves in flight: the last checkpoint is complete when training returns."""
        for checkpointer in self.checkpointers.values():
            checkpointer.wait()


def _one_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
