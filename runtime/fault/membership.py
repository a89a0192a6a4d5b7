"""Who is in the job: views (generation + failed set), heartbeats, and the failure detector.

A `View` is what the survivors agree on (see `agreement`): a generation number and the topology
with its failed workers; its members are the live workers, and a member's rank in that
generation is its index among them (the rank order of `Plan.workers`, so `RankMap` agrees).

Detection, each worker in its own background threads, each with its own store client:
- `Heartbeat` bumps `hb/W` every `interval` seconds.
- `FailureDetector` polls the store every `poll` seconds and declares a member failed when
  (a) the launcher that reaped its process left a death notice (`dead/W` >= `inc/W`): a crash on
      a live host is seen within one poll;
  (b) its heartbeat counter has not moved for `detection_time` seconds by *this* host's clock
      (a hung process, a dead host or a cut network: no clocks are compared across hosts), or
      it has not beaten at all within `startup_time` (slow starts are not failures);
  (c) the executor declared it failed (`declare_failed`, e.g. after an operation timed out).
  Its polls are also this worker's proof of contact with the store: with `fence` on (the
  default), a worker whose detector has had no answer from the store for `detection_time`
  exits (`fence.Fence`): by then the others have declared it failed, as (b) does for them.
  It trips its `signal` when the current generation is broken: a member failed, another worker
  proposed a newer generation (other than one that only admits replacements at an iteration
  boundary), or the executor reported a communication error (`report`). An
  error alone names no one: "connection closed by peer" is also what a live peer causes when it
  drops a broken generation's groups, so the peer is only declared failed by (a), (b) or (c).
- `wait_work(work, signal)` waits for a `torch.distributed` work item but gives up as soon as the
  signal trips: gloo offers no way to interrupt a blocked `wait()` (neither `abort()` nor
  `shutdown()` wakes it), so the executor polls with a short exponential back-off instead.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property

import torch.distributed as dist

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.fence import Fence
from schedcomp.runtime.fault.store import SEALED, Keys, StoreAddress, backoff, get_int
from schedcomp.topology import Topology, Worker

log = logging.getLogger(__name__)

VIEW_FORMAT = 1
WAITER_THREAD = "schedcomp-wait"  # threads blocked in a gloo wait for `wait_abortable`


class GenerationAborted(RecoveryError):
    """The current generation broke while this worker waited on it: agree on the next one and re-run."""


@dataclass(frozen=True)
class View:
    """One generation of the job: its number and the topology (pp, dp, failed workers)."""

    generation: int
    topology: Topology

    @classmethod
    def initial(cls, pp: int, dp: int) -> View:
        return cls(0, Topology.of(pp, dp))

    @property
    def failed(self) -> frozenset[Worker]:
        return self.topology.failed

    @cached_property  # the model checker asks for it millions of times
    def members(self) -> tuple[Worker, ...]:
        """The live workers, in rank order (the same order as `Plan.workers`)."""
        return self.topology.live_workers

    def rank(self, worker: Worker) -> int:
        """This generation's rank of a member (its index among the live workers)."""
        try:
            return self.members.index(worker)
        except ValueError:
            raise RecoveryError(f"worker {worker} is not a member of generation {self.generation}: "
                                "it was declared failed; restart it so it rejoins") from None

    def next(self, failed: Iterable[Worker]) -> View:
        """The following generation with this failed set."""
        return View(self.generation + 1, Topology.of(self.topology.pp, self.topology.dp, failed))

    def to_json(self) -> str:
        t = self.topology
        return json.dumps({"format": VIEW_FORMAT, "generation": self.generation, "pp": t.pp, "dp": t.dp,
                           "failed": sorted(str(w) for w in t.failed)})

    @classmethod
    def from_json(cls, text: str | bytes) -> View:
        try:
            d = json.loads(text)
            if d.get("format") != VIEW_FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            return cls(int(d["generation"]), Topology.of(int(d["pp"]), int(d["dp"]),
                                                         [Worker.parse(w) for w in d["failed"]]))
        except (ValueError, KeyError, TypeError) as e:
            raise RecoveryError(f"unreadable view in the store ({e}): "
                                "every worker must run the same schedcomp") from None


class Heartbeat:
    """A background thread that bumps this worker's heartbeat counter every `interval` seconds."""

    def __init__(self, address: StoreAddress, worker: Worker, incarnation: int = 0, interval: float = 0.5) -> None:
        self.address, self.worker, self.incarnation, self.interval = address, worker, incarnation, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> Heartbeat:
        """Start beating; returns after the first beat is in the store."""
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name=f"heartbeat-{self.worker}",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # a daemon thread inside a store call when the interpreter exits aborts it
        if not started.wait(timeout):
            raise RecoveryError(f"worker {self.worker} cannot reach the store at {self.address}: "
                                "check the address and that the launcher is running")
        return self

    def _run(self, started: threading.Event) -> None:
        # The client is made and used in this thread only (a client handed over from another thread
        # makes the interpreter abort at exit while this daemon thread still uses it).
        store = self.address.connect()
        key = Keys.heartbeat(self.worker)
        store.set(Keys.incarnation(self.worker), str(self.incarnation))
        store.add(key, 1)  # present before anyone can count this worker a member
        started.set()
        while not self._stop.wait(self.interval):
            try:
                store.add(key, 1)
            except Exception as e:  # the store is gone: the job is over, nothing to report to
                log.warning("heartbeat of %s stopped: %s", self.worker, e)
                return

    def stop(self) -> None:
        """Stop beating (a test can stop a worker's heartbeat to make it look hung)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        atexit.unregister(self.stop)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class _Watch:
    count: int = -1  # last heartbeat counter seen (-1: none yet)
    since: float = 0.0  # local monotonic time of the last change (or of the start of watching)
    failed: bool = False


@dataclass
class FailureDetector:
    """Watches the members of the current view; see the module docstring for the rules."""

    address: StoreAddress
    me: Worker
    detection_time: float = 3.0
    poll: float = 0.05
    startup_time: float = 120.0  # how long a worker that never beat may take to start (importing torch...)
    signal: threading.Event = field(default_factory=threading.Event)
    fence: bool = True  # exit the process when the store is silent for detection_time (see `fence`)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._watch: dict[Worker, _Watch] = {}
        self._declared: set[Worker] = set()
        self._generation = -1
        self._failed_set: frozenset[Worker] = frozenset()  # the watched view's failed workers
        self._recheck = False  # `watch` asks the thread to read the death notices again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fence = Fence(self.detection_time, f"worker {self.me}") if self.fence else None
        self.reason = ""

    # ---- what the worker calls ------------------------------------------------------------------

    def start(self, view: View | None = None) -> FailureDetector:
        if view is not None:
            self.watch(view)
        self._thread = threading.Thread(target=self._run, name=f"detector-{self.me}", daemon=True)
        self._thread.start()
        if self._fence is not None:
            self._fence.start()
        atexit.register(self.stop)  # see Heartbeat.start
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._fence is not None:
            self._fence.stop()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        atexit.unregister(self.stop)

    def watch(self, view: View) -> None:
        """Watch the members of `view` from now on; clears the signal (and sets it again at once when
        a member of `view` is already known failed: that view is broken from the start).

        A worker watched before keeps its heartbeat clock, so agreeing on a view never makes a
        hung worker look fresh again.
        """
        now = time.monotonic()
        members = set(view.members) - {self.me}
        with self._lock:
            # A declaration stands until the worker comes back as a new member (a replacement).
            self._declared -= members - set(self._watch)
            self._watch = {w: self._watch.get(w) or _Watch(since=now) for w in members}
            self._generation = view.generation
            self._failed_set = view.failed
            self._recheck = True  # read the death notices again: a new member may have died before we watched it
            self.signal.clear()
            self.reason = ""
            known = sorted(w for w, s in self._watch.items() if s.failed) + sorted(self._declared & members)
        if known:  # a member we already know failed: this view is broken from the start
            self._trip(f"{known[0]} failed before generation {view.generation} was agreed", view.generation)

    def failed(self) -> frozenset[Worker]:
        """Watched workers found failed so far (a snapshot)."""
        with self._lock:
            return frozenset(w for w, s in self._watch.items() if s.failed) | frozenset(self._declared)

    def report(self, peer: Worker | None, error: BaseException | str) -> None:
        """The executor's operation with `peer` failed: the generation is broken (the peer may be fine)."""
        self._trip(f"error with {peer}: {error}")

    def declare_failed(self, peer: Worker, why: str) -> None:
        """The executor is sure `peer` failed (e.g. an operation with it timed out)."""
        with self._lock:
            self._declared.add(peer)
        self._trip(f"{peer} declared failed: {why}")

    # ---- the thread ------------------------------------------------------------------------------

    def _trip(self, reason: str, generation: int | None = None) -> None:
        """Set the signal; with `generation`, only if we still watch that generation (a poll
        that read the store just before `watch` moved on must not break the new generation)."""
        with self._lock:
            if generation is not None and generation != self._generation:
                return
        if not self.signal.is_set():
            self.reason = reason
            log.info("worker %s: generation broken: %s", self.me, reason)
        self.signal.set()

    def _run(self) -> None:
        store = self.address.connect()
        events, ensured, next_beat_check = -1, frozenset[Worker](), 0.0
        while not self._stop.wait(self.poll):
            try:
                with self._lock:
                    watched = tuple(self._watch)
                    generation = self._generation
                latest = store.add(Keys.events(), 0)
                with self._lock:
                    recheck, self._recheck = self._recheck, False
                if latest != events or recheck:  # something happened: look for death notices and newer generations
                    events = latest
                    self._check_notices(store, watched, generation)
                now = time.monotonic()
                if now >= next_beat_check:  # heartbeats are read a few times per detection_time, not every poll
                    next_beat_check = now + self.detection_time / 5
                    if ensured != frozenset(watched):  # multi_get blocks on missing keys: create them (as 0)
                        for w in watched:
                            store.add(Keys.heartbeat(w), 0)
                        ensured = frozenset(watched)
                    counts = store.multi_get([Keys.heartbeat(w) for w in watched]) if watched else []
                    self._check_beats(watched, [int(c) for c in counts], now)
                if self._fence is not None:
                    self._fence.contact()
            except Exception as e:  # the store is gone: nobody can agree on anything any more
                self._trip(f"store unreachable: {e}")
                return

    def _check_notices(self, store: dist.Store, watched: tuple[Worker, ...], generation: int) -> None:
        dead = [w for w in watched if get_int(store, Keys.dead(w)) >= get_int(store, Keys.incarnation(w), 0)]
        with self._lock:
            newly = [w for w in dead if w in self._watch and not self._watch[w].failed]
            for w in newly:
                self._watch[w].failed = True
        for w in newly:
            self._trip(f"{w} failed (death notice)")  # a failed member breaks whatever generation we watch
        with self._lock:
            current = self._failed_set
        if generation >= 0 and store.check([Keys.view(generation + 1)]) and \
                not admits_only(store, generation + 1, current):
            self._trip(f"generation {generation + 1} was proposed", generation)

    def _check_beats(self, watched: tuple[Worker, ...], counts: list[int], now: float) -> None:
        newly = []
        with self._lock:
            for w, count in zip(watched, counts, strict=True):
                s = self._watch.get(w)
                if s is None or s.failed:
                    continue
                if count != s.count:
                    s.count, s.since = count, now
                elif now - s.since > (self.detection_time if count > 0 else self.startup_time):
                    s.failed = True
                    newly.append((w, now - s.since))
        for w, silent in newly:
            self._trip(f"{w} failed (no heartbeat for {silent:.1f}s)")


def admits_only(store: dist.Store, generation: int, current_failed: frozenset[Worker]) -> bool:
    """Whether the proposed `generation` only admits replacements (its failed set shrinks) and still stands.

    Survivors agree on an admission at an iteration boundary; a worker still finishing the
    iteration before it must not abort it, it will get to that boundary and join them.
    """
    proposed = View.from_json(store.get(Keys.view(generation)))
    superseded = store.check([Keys.outcome(generation)]) and store.get(Keys.outcome(generation)).decode() != SEALED
    return proposed.failed < current_failed and not superseded


def wait_work(work: dist.Work, signal: threading.Event, *, first_poll: float = 2e-5, max_poll: float = 1e-3) -> None:
    """`work.wait()`, except that it raises `GenerationAborted` as soon as `signal` is set.

    Polls `is_completed()` with a back-off from `first_poll` to `max_poll` seconds: a transfer that
    is already there costs one call; one that arrives later is noticed within `max_poll`. Only for
    work items that report their own completion, which they also do when they fail at the group's
    timeout (collectives, NCCL). A gloo point-to-point item reports nothing before `wait()`: here
    only the signal would end it, so wait for those with `wait_abortable`.
    """
    delays = backoff(first_poll, max_poll)
    while not work.is_completed():
        if signal.wait(next(delays)) and not work.is_completed():  # a transfer that made it still counts
            raise GenerationAborted("the generation broke while waiting for a transfer: agree on the next one")
    work.wait()  # raises the transfer's own error, if it failed


def wait_abortable(work: dist.Work, signal: threading.Event, *, poll: float = 0.02) -> None:
    """`work.wait()`, but raise `GenerationAborted` once `signal` is set (within `poll` seconds).

    `wait_work` polls `is_completed()`, which gloo's point-to-point work items
    never report before `wait()` is called, and gloo's timed `wait` breaks the pair on timeout. So
    a daemon thread makes the blocking call (it releases the GIL) and this thread watches both it
    and the signal: it wakes as soon as the call returns, and looks at the signal every `poll`
    seconds (a generation breaks far less often than transfers complete: no need to spin for it,
    on a CPU the training shares with every other worker of the host). An abandoned waiter ends
    when the broken generation's connections close or its operations time out
    (`fault.groups.Graveyard` keeps the groups alive until then).
    """
    if work.is_completed():
        work.wait()
        return
    done, errors = threading.Event(), []

    def block() -> None:
        try:
            work.wait()
        except BaseException as e:  # handed to the caller below
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=block, name=WAITER_THREAD, daemon=True).start()
    while not done.wait(poll):
        if signal.is_set() and not done.is_set():  # a transfer that made it still counts
            raise GenerationAborted("the generation broke while waiting for a transfer: agree on the next one")
    if errors:
        raise errors[0]
