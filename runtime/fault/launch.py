"""Launch a resilient job: one process per worker, all sharing the job's store; survivors live on.

Why not plain `torchrun`: one torchrun agent tears down all of its workers when one of them
dies, and restarts the whole group. This launcher starts one process per worker, watches them,
and when one dies it only (1) leaves a death notice in the store, so the survivors' detectors
see the crash within one poll instead of waiting out the heartbeat timeout, and (2) optionally
starts a replacement (`--respawn`), which rejoins: it announces itself, the survivors admit it at
an iteration boundary, and a live replica hands it the stage's state. It also fences: a local
worker that the survivors declared failed (hung, or cut off) is killed, so it can neither wake
up and interfere nor keep the survivors' old connections open.

One host (the store listens on 127.0.0.1 and every process group on loopback):

    python -m schedcomp.runtime.fault.launch --pp 4 --dp 2 --respawn 1 -- python train.py --steps 100

Several hosts: one launcher per host, each starting its own workers. One of them serves the store
on an address the others can reach; `--bind` is the address this host's workers listen on:

    host A (10.0.0.1): python -m schedcomp.runtime.fault.launch --pp 4 --dp 2 --pipelines 0 \\
                           --serve-store 10.0.0.1:29400 --bind 10.0.0.1 -- python train.py
    host B (10.0.0.2): python -m schedcomp.runtime.fault.launch --pp 4 --dp 2 --pipelines 1 \\
                           --store 10.0.0.1:29400 --bind 10.0.0.2 -- python train.py

Restart from a checkpoint (`--max-restarts N`, default 3): when a stage has lost every replica,
re-planning cannot go on; the survivors of a job trained with checkpoints (`ResilientTrainer(...,
checkpoint=CheckpointPolicy(dir, every))`) record a restart request in the store and exit. Every
launcher sees it, lets its workers leave (killing those still there after `restart_grace`
seconds), and starts all of them again as the job's next run: SCHEDCOMP_RUN = k, a fresh key
namespace `run{k}/` in the same store (nothing of the old run's generations, commits or death
notices is seen), the old run's request copied to `restart/previous`. The new run resumes from
the latest complete checkpoint (see `restart`). Each run is a fresh job: its workers start as
incarnation 0 and the respawn budget (`--respawn`) starts over, so a job starts at most
(1 + max restarts) x (1 + respawn) processes per worker.

(`--workers 0:0,0:1,...` names workers one by one instead of whole pipelines.) The host serving
the store must outlive the job: put it where failures are least likely, or give it no workers;
once its own workers are done it keeps serving while other hosts' workers still beat (a signal
ends that at once: they lose the store and fence themselves; `launch_hosts`). A whole
host lost is detected by heartbeats (`detection_time`), since no launcher is left there to
leave death notices; its workers' replacements can be started by a new launcher on another
host with `--workers ... --store ... --incarnation 1`.

A network partition: the side with the store goes on (after `detection_time` its survivors
declare the others failed and re-plan). The other side fences itself: each of its workers exits
once it has had no answer from the store for `detection_time` (`fence`, exit status 75), and
its launcher, with no answer for `--store-timeout` seconds, kills what is left of its workers and
exits with status 75. When the network heals nothing comes back silently: a process that
outlived the cut finds itself in the failed set (`agreement.Evicted`), and a replacement
rejoins only through an announced join.

Each worker finds its identity in the environment (`WorkerEnv.from_env()`): SCHEDCOMP_STORE,
SCHEDCOMP_WORKER (d:s), SCHEDCOMP_SHAPE (pp,dp), SCHEDCOMP_INCARNATION (0, then 1, 2, ... for
replacements), SCHEDCOMP_BIND, SCHEDCOMP_RUN (0, then 1, 2, ... after restarts), plus LOCAL_RANK /
LOCAL_WORLD_SIZE to pick a GPU. A training script uses `FaultSession` (see `session`). The
launcher exits 0 when some worker finished its training (exit 0) in the last run and every other
one either finished or was lost; 1 otherwise (e.g. a restart was requested with no restart left);
2 on bad usage: every argument is checked before anything starts (`launch_args`), and a launcher
joining another's store (`--store`) waits for it at most `--store-timeout` seconds (default 30),
so it may start first; either failure is one line on stderr; 75 when this host lost the store (see
partitions above).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed import Store

from schedcomp.errors import RecoveryError, SchedcompError
from schedcomp.runtime.fault.agreement import latest_view
from schedcomp.runtime.fault.fence import FENCED_EXIT
from schedcomp.runtime.fault.launch_args import DEFAULT_STORE_TIMEOUT, parse_args, seconds
from schedcomp.runtime.fault.launch_hosts import cut_off_watch, open_store, serve_other_hosts
from schedcomp.runtime.fault.membership import View
from schedcomp.runtime.fault.restart import RestartRequest, restart_requested
from schedcomp.runtime.fault.store import LOOPBACK, SEALED, Keys, StoreAddress, WorkerEnv, run_store
from schedcomp.runtime.fault.zygote import ForkedProcess, Zygote, flush_streams
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """One worker and the process running it now (None between a death and its replacement)."""

    worker: Worker
    incarnation: int = 0
    proc: subprocess.Popen | ForkedProcess | None = None
    spawned_after: int = -1  # the newest generation proposed when this process started
    admitted: int | None = None  # the first sealed generation after that with this worker a member
    respawns_left: int = 0
    respawn_at: float | None = None  # when to start the replacement (monotonic time)
    returncode: int | None = None  # of the last process to exit


class Launcher:
    """Starts, watches, fences and replaces the workers of this host (see the module docstring)."""

    def __init__(self, command: Sequence[str], pp: int, dp: int, workers: Sequence[Worker] | None = None, *,
                 store: StoreAddress | None = None, serve: StoreAddress | None = None, bind: str = LOOPBACK,
                 respawn: int = 0, respawn_delay: float = 0.0, fence: bool = True, incarnation: int = 0,
                 max_restarts: int = 3, restart_grace: float = 5.0, poll: float = 0.02,
                 store_timeout: float = DEFAULT_STORE_TIMEOUT, linger: float = 6.0,
                 preload: Sequence[str] = ()) -> None:
        if not command:
            raise RecoveryError("no worker command given: put it after `--`, e.g. -- python train.py")
        if shutil.which(command[0]) is None:  # found now, not as a FileNotFoundError once some workers run
            raise RecoveryError(f"worker command {command[0]!r} is not an executable file or on PATH: "
                                "give the program that runs a worker, e.g. -- python train.py")
        respawn_delay = seconds(respawn_delay, "respawn_delay")
        restart_grace, poll = seconds(restart_grace, "restart_grace"), seconds(poll, "poll", least=0.001)
        store_timeout = seconds(store_timeout, "store_timeout", least=0.001)
        topology = Topology.of(pp, dp)
        workers = tuple(workers) if workers else topology.workers
        for w in workers:
            if not topology.is_live(w):
                raise RecoveryError(f"worker {w} is outside a pp={pp}, dp={dp} job: pipelines 0..{dp - 1}, "
                                    f"stages 0..{pp - 1}")
        self.command, self.pp, self.dp, self.bind = list(command), pp, dp, bind
        self.fence, self.respawn_delay, self.poll = fence, respawn_delay, poll
        self.store_timeout, self.linger = store_timeout, linger
        # the job's store (`launch_hosts`): `root` holds every run's keys, under `run{k}/` (`store.run_store`)
        self.server, self.address, self.root = open_store(store, serve, store_timeout)
        self.run_number, self.restarts_left, self.restart_grace = 0, max_restarts, restart_grace
        self.store: Store = run_store(self.root, 0)  # the current run's keys
        self.respawn = respawn
        self.slots = [Slot(w, incarnation, respawns_left=respawn) for w in workers]
        self._request: RestartRequest | None = None  # the current run asked for a restart
        self._events = -1
        self._next_view = 0  # the first generation whose outcome we have not read yet
        self._finished = False  # some worker completed its training: no more replacements
        self._retired = False  # replacements that can no longer be admitted were stopped
        self.zygote = Zygote(preload) if preload else None  # forks workers with `preload` imported (`zygote`)

    # ---- running ---------------------------------------------------------------------------------------

    def start(self) -> None:
        for slot in self.slots:
            self._spawn(slot)

    def run(self) -> int:
        """Start the workers and watch them until none is left; returns the launcher's exit code."""
        stop: list[int] = []
        previous = {s: signal.signal(s, lambda sig, _frame: stop.append(sig)) for s in (signal.SIGINT, signal.SIGTERM)}
        # Only a launcher that reaches the store over the network can lose it (the server is not
        # in this process): with no answer for store_timeout, this host is cut off (see partitions).
        cut = (cut_off_watch(self.store_timeout, [s.worker for s in self.slots], self._kill_running)
               if self.server is None else None)
        try:
            self.start()
            if cut is not None:
                cut.start()
            while self.step():
                if cut is not None:
                    cut.contact()
                if stop:
                    log.warning("signal %d: stopping every worker", stop[0])
                    self.terminate()
                    return 128 + stop[0]
                time.sleep(self.poll)
            if cut is not None:
                cut.stop()
            # the store outlives this host's workers while other hosts' still beat (`launch_hosts`)
            local = {s.worker for s in self.slots}
            others = [w for w in Topology.of(self.pp, self.dp).workers if w not in local]
            interrupted = serve_other_hosts(self.store, others, self.linger, stop) if self.server is not None else None
            return 128 + interrupted if interrupted is not None else self.exit_code()
        finally:
            if cut is not None:
                cut.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.terminate()
            if self.zygote is not None:
                self.zygote.close()

    def _kill_running(self) -> None:
        """Kill every local worker still running (this host is cut off: `launch_hosts.cut_off_watch`)."""
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()

    def step(self) -> bool:
        """One round of watching: restart, reap, notify, fence, replace. False once nothing is left to watch."""
        if self._restart_due():
            self.restart()
        now = time.monotonic()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is not None:
                self._reap(slot, now)
            if slot.proc is None and slot.respawn_at is not None and now >= slot.respawn_at and not self._finished:
                self._spawn(slot)
        if self.fence:
            self._fence()
        if self._finished and not self._retired:
            self._retire_waiting_replacements()
        return any(s.proc is not None or (s.respawn_at is not None and not self._finished) for s in self.slots)

    def _restart_due(self) -> bool:
        if self._request is not None:
            return False  # this run's request was seen; with no restart left, it just ends
        self._request = restart_requested(self.store)
        if self._request is None:
            return False
        if self.restarts_left <= 0:
            log.error("run %d asked for a restart (%s) but no restart is left: stopping", self.run_number,
                      self._request.reason)
            return False
        return True

    def restart(self) -> None:
        """Stop this run's workers and start every one of them again as the job's next run."""
        request = self._request or RestartRequest("restart requested by the launcher", -1, self.run_number)
        log.warning("run %d ended (%s; iteration %d reached): restarting every worker as run %d",
                    self.run_number, request.reason, request.reached, self.run_number + 1)
        self._drain(self.restart_grace)
        self.run_number += 1
        self.restarts_left -= 1
        self.store = run_store(self.root, self.run_number)
        self.store.add(Keys.events(), 0)
        self.store.set(Keys.previous_run(), request.to_json())
        self.slots = [Slot(s.worker, 0, respawns_left=self.respawn) for s in self.slots]
        self._request, self._events, self._next_view = None, -1, 0
        self._finished = self._retired = False
        self.start()

    def _drain(self, grace: float) -> None:
        """Let the workers leave by themselves (a save in flight ends on disk), then stop the rest."""
        for slot in self.slots:  # replacements not admitted yet hold nothing to save and wait for nobody
            if slot.proc is not None and slot.incarnation > 0 and slot.admitted is None:
                slot.proc.kill()
        deadline = time.monotonic() + grace
        while any(s.proc is not None and s.proc.poll() is None for s in self.slots) and time.monotonic() < deadline:
            time.sleep(self.poll)
        self.terminate(grace=1.0)
        for slot in self.slots:
            if slot.proc is not None:
                slot.returncode, slot.proc = slot.proc.poll(), None

    def exit_code(self) -> int:
        codes = [s.returncode for s in self.slots]
        return 0 if 0 in codes else 1

    def terminate(self, grace: float = 5.0) -> None:
        """Stop every worker still running (SIGTERM, then SIGKILL after `grace` seconds)."""
        running = [s.proc for s in self.slots if s.proc is not None and s.proc.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # ---- one worker --------------------------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> None:
        env = WorkerEnv(self.address, slot.worker, self.pp, self.dp, slot.incarnation, self.bind, self.run_number)
        local = self.slots.index(slot)
        child_env = {**os.environ, **env.to_env(), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(len(self.slots))}
        try:
            slot.proc = (self.zygote.spawn(self.command, child_env) if self.zygote is not None
                         else subprocess.Popen(self.command, env=child_env))
        except OSError as e:  # e.g. the program was removed or made non-executable since the launch
            raise RecoveryError(f"cannot start worker {slot.worker} with {self.command[0]!r}: "
                                f"{e.strerror or e}") from None
        slot.spawned_after, slot.admitted, slot.respawn_at = self._newest_generation(), None, None
        log.info("started worker %s (incarnation %d, pid %d)", slot.worker, slot.incarnation, slot.proc.pid)

    def _reap(self, slot: Slot, now: float) -> None:
        assert slot.proc is not None
        code = slot.proc.returncode
        slot.proc, slot.returncode = None, code
        if code == 0:
            self._finished = True
            log.info("worker %s finished", slot.worker)
            return
        if code == FENCED_EXIT:
            log.warning("worker %s fenced itself: it had no answer from the store at %s", slot.worker, self.address)
        if self._request is not None or restart_requested(self.store) is not None:
            log.info("worker %s left (exit status %s): its run asked for a restart", slot.worker, code)
            return  # no notice, no replacement: the whole job restarts (or ends, with no restart left)
        # Tell the survivors at once: their detectors read this on their next poll.
        self.store.set(Keys.dead(slot.worker), str(slot.incarnation))
        self.store.add(Keys.events(), 1)
        log.warning("worker %s (incarnation %d) died with %s", slot.worker, slot.incarnation,
                    f"signal {-code}" if code < 0 else f"exit status {code}")
        if slot.respawns_left > 0 and not self._finished:
            slot.respawns_left -= 1
            slot.incarnation += 1
            slot.respawn_at = now + self.respawn_delay

    def _retire_waiting_replacements(self) -> None:
        """Once a worker finished training, stop replacements not yet admitted: none ever will be.

        Workers leave only together (after the last iteration every member meets), so the newest
        generation is the last one; a replacement that is not a member of it, admitted after it
        started, would otherwise wait out its agreement timeout.
        """
        self._retired = True
        view = latest_view(self.store)
        if view is None:  # the workers do not agree on generations: nothing says who would be admitted
            return
        for slot in self.slots:
            if slot.proc is None or slot.incarnation == 0:
                continue
            if view.generation <= slot.spawned_after or slot.worker not in view.members:
                log.warning("stopping replacement %s: training finished before it was admitted", slot.worker)
                slot.proc.kill()

    def _fence(self) -> None:
        """Kill local workers that a sealed generation declared failed after having admitted them."""
        events = self.store.add(Keys.events(), 0)
        if events == self._events:
            return
        self._events = events
        while self.store.check([Keys.outcome(self._next_view)]):
            g = self._next_view
            self._next_view += 1
            if self.store.get(Keys.outcome(g)).decode() != SEALED:
                continue
            view = View.from_json(self.store.get(Keys.view(g)))
            for slot in self.slots:
                if slot.proc is None or g <= slot.spawned_after:
                    continue
                if slot.admitted is None and slot.worker in view.members:
                    slot.admitted = g
                elif slot.admitted is not None and slot.worker in view.failed:
                    log.warning("fencing worker %s: generation %d declared it failed", slot.worker, g)
                    slot.proc.kill()

    def _newest_generation(self) -> int:
        g = self._next_view - 1
        while self.store.check([Keys.view(g + 1)]):
            g += 1
        return g


# ---- command line ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args, command = parse_args(sys.argv[1:] if argv is None else argv)
    except SchedcompError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s launch %(levelname)s %(message)s")
    try:
        launcher = Launcher(command, args.pp, args.dp, args.workers, store=args.store, serve=args.serve_store,
                            bind=args.bind, respawn=args.respawn, respawn_delay=args.respawn_delay,
                            fence=not args.no_fence, incarnation=args.incarnation, max_restarts=args.max_restarts,
                            store_timeout=args.store_timeout, preload=args.preload)
        print(f"schedcomp launch: store at {launcher.address}", file=sys.stderr, flush=True)
        return launcher.run()
    except SchedcompError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    _code = main()
    # Every worker is gone and every exit handler ran (logging's included): skip the interpreter's
    # teardown of torch, seconds of CPU while whoever started the job waits for our exit status.
    atexit._run_exitfuncs()
    flush_streams()
    os._exit(_code)
