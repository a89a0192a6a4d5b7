"""Agreeing on one view per generation: every survivor ends with the same generation and failed set.

The protocol, per generation G, in the store (nothing but `compare_set`, `add`, `check`, `get`):
1. Propose: `compare_set(gen/G/view, "", my proposal)`; the first writer wins and everyone adopts
   the winner's view (a worker never argues with it; it only moves on, step 3).
2. Acknowledge: a member that knows of no failure the view misses bumps `gen/G/ack`.
3. Decide, with `compare_set(gen/G/outcome, "", ...)`, first writer wins again:
   - `sealed` once every member acknowledged: G is the job's generation, everyone returns it;
   - `superseded` by a member that knows of a failure the view misses (its detector saw a member
     die, before or after acknowledging). It first proposes G+1 with everything it knows, then
     marks G superseded, so everyone moving on adopts a view with its news. If G was sealed
     first, everyone returns G, and the G+1 proposal left in the store trips every detector:
     the next round starts at once and adopts it.
   A generation is superseded only by news, and the next view holds that news, so failed sets
   grow from one generation to the next and a round ends; every worker obeys the same
   first-writer-wins keys, so all of them return the same view.
A member that finds itself in the adopted view's failed set was declared dead while alive (a
false suspicion): it raises `Evicted`; its process should exit so that the launcher starts a
replacement, which rejoins like any other.

Joining: a replacement announces itself (`announce_join`); at an iteration boundary the
survivors see it (`pending_joins`), fix the iteration at which it enters (`propose_switch`,
first writer wins, see `switch_iteration`) and, at that boundary, call `agree` with
`joiners`; the replacement calls `agree` with `propose=False` and waits for a view that has it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from torch.distributed import Store

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.membership import FailureDetector, View
from schedcomp.runtime.fault.protocol import DONE, RecoveryTimeout, begin, step, waiting_for
from schedcomp.runtime.fault.protocol import Evicted as Evicted  # raised by `agree`; importable from here
from schedcomp.runtime.fault.store import SEALED, Keys, backoff, get_int
from schedcomp.topology import Worker

log = logging.getLogger(__name__)


class AgreementTimeout(RecoveryTimeout):
    """The survivors did not agree on a generation in time."""


def agree(store: Store, view: View, me: Worker, detector: FailureDetector, *, joiners: Iterable[Worker] = (),
          propose: bool = True, timeout: float = 60.0, poll: float = 0.005, most: float = 0.02) -> View:
    """Agree with the other survivors on the generation after `view`; return it (sealed).

    `view` is the last generation this worker ran (or, for a replacement, any generation it
    knows of: it waits for a later one that admits it, with `propose=False`). `joiners` are
    replacements admitted by this change (workers failed in `view`). On return the detector
    watches the new view's members. The steps are `protocol.step`'s (the model checks those).
    Between steps that change nothing it sleeps `poll` seconds, backing off to `most` until one does.

    `timeout` bounds the whole call, however many generations come and go meanwhile (workers failing
    one after another, a bug that supersedes every view): past it, `AgreementTimeout`. Giving up is
    leaving the protocol between two steps, which the others cannot tell from dying there; the
    caller's process must then exit (`FaultSession`), so its launcher reports it as any failure.
    """
    deadline = time.monotonic() + timeout
    r = begin(view, me, detector, joiners=joiners, propose=propose)
    first, delays = r.generation, backoff(poll, most)
    while r.phase != DONE:
        if time.monotonic() > deadline:
            went_by = f" (generations {first} to {r.generation - 1} came and went)" if r.generation > first else ""
            raise AgreementTimeout(f"{waiting_for(store, r)} within {timeout:g} s{went_by}: {_CHECK}")
        after = step(store, detector, r)
        if after == r:
            time.sleep(next(delays))
            continue
        delays = backoff(poll, most)  # progress: the next change is likely soon
        if after.generation != r.generation and r.winner is not None:
            log.info("worker %s: generation %d superseded (also failed: %s)", me, r.winner.generation,
                     ", ".join(map(str, sorted(after.failed - r.winner.failed))) or "-")
        r = after
    assert r.winner is not None
    log.info("worker %s: generation %d sealed, failed: %s", me, r.winner.generation,
             ", ".join(map(str, sorted(r.winner.failed))) or "none")
    return r.winner


def join_job(store: Store, pp: int, dp: int, me: Worker, detector: FailureDetector, *,
             timeout: float = 120.0) -> View:
    """Agree on the first generation: every worker of the job, minus those that never showed up."""
    return agree(store, View(-1, View.initial(pp, dp).topology), me, detector, timeout=timeout)


def latest_view(store: Store) -> View | None:
    """The newest generation proposed so far (sealed or not), or None before the job started."""
    generation = -1
    while store.check([Keys.view(generation + 1)]):
        generation += 1
    return View.from_json(store.get(Keys.view(generation))) if generation >= 0 else None


def sealed_before(store: Store, generation: int) -> View | None:
    """The newest sealed generation older than `generation` (None if there is none)."""
    for g in range(generation - 1, -1, -1):
        if store.check([Keys.outcome(g)]) and store.get(Keys.outcome(g)).decode() == SEALED:
            return View.from_json(store.get(Keys.view(g)))
    return None


_CHECK = "raise the agreement timeout or check that the workers can reach the store"


def _tick(deadline: float, poll: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise AgreementTimeout(f"{what}: {_CHECK}")
    time.sleep(poll)


# ---- joins ---------------------------------------------------------------------------------------


def announce_join(store: Store, me: Worker, incarnation: int) -> None:
    """A replacement process for `me` asks to be admitted at the survivors' next iteration boundary."""
    store.set(Keys.join(me), str(incarnation))
    store.add(Keys.events(), 1)


def counted_failed(store: Store, me: Worker, *, timeout: float, poll: float = 0.005, most: float = 0.05) -> View:
    """A replacement for `me`, before any sign of life: wait for a proposed view that counts `me` failed; return it.

    Until the survivors propose one, they may not know yet that its predecessor died, and a
    replacement must not hide it from them: its incarnation in the store makes the launcher's
    death notice look stale to their detectors, its heartbeats (on the same key) make the
    predecessor look alive, and acknowledging a view that still counts the predecessor, proposed
    by a survivor that only saw a broken connection, would seal it with us taken for the
    predecessor, state and all. Failed sets only grow from one proposal to the next except by an
    admission, which needs our announcement, so every view after this one counts us failed too.
    """
    deadline, delays = time.monotonic() + timeout, backoff(poll, most)
    while (known := latest_view(store)) is None or me not in known.failed:
        _tick(deadline, next(delays), f"no generation counts {me} failed yet, so no replacement of it can be admitted")
    return known


def admit(store: Store, me: Worker, incarnation: int, known: View, detector: FailureDetector, *,
          timeout: float) -> tuple[View, float]:
    """A replacement for `me`: announce itself, wait until the survivors admit it; (the view, when it announced).

    `known` is the view `counted_failed` returned, read *before* announcing: the survivors propose
    the view that admits us only after they see the announcement, so it comes after the one read.
    Read after announcing, it could already be that view; we would then wait for the generation
    after it, while it waits for our acknowledgement (both until the agreement timeout). The
    exhaustive model starts a replacement the same way (`tests/support/protocol_model.admission`:
    the joiner is failed in the view it knows).
    """
    announce_join(store, me, incarnation)
    announced_at = time.time()
    return agree(store, known, me, detector, propose=False, timeout=timeout), announced_at


def pending_joins(store: Store, view: View) -> frozenset[Worker]:
    """Failed workers of `view` whose replacement is up and waiting (costs nothing when none failed)."""
    return frozenset(w for w in view.failed if get_int(store, Keys.join(w)) > get_int(store, Keys.dead(w)))


@dataclass(frozen=True)
class Switch:
    """Replacements enter the job at the start of iteration `iteration` (after generation `generation`)."""

    generation: int
    iteration: int
    joiners: frozenset[Worker]


def propose_switch(store: Store, view: View, iteration: int, joiners: Iterable[Worker]) -> Switch:
    """Fix when `joiners` enter; the first survivor to propose wins and every survivor gets its choice."""
    key = f"gen/{view.generation}/switch"
    mine = json.dumps({"iteration": iteration, "joiners": sorted(str(w) for w in joiners)})
    d = json.loads(store.compare_set(key, "", mine))
    return Switch(view.generation, int(d["iteration"]), frozenset(Worker.parse(w) for w in d["joiners"]))


def agreed_switch(store: Store, view: View) -> Switch | None:
    """The switch fixed for this generation, if any (checked by every survivor at each boundary)."""
    key = f"gen/{view.generation}/switch"
    if not store.check([key]):
        return None
    d = json.loads(store.get(key))
    return Switch(view.generation, int(d["iteration"]), frozenset(Worker.parse(w) for w in d["joiners"]))


def switch_iteration(completed: int, lead: int = 2) -> int:
    """The first iteration replacements can join at, proposed by a worker that just completed `completed`.

    `lead` bounds how far ahead of this worker another may be: with per-stage steps and no global
    barrier, a worker finishing iteration j+1 needs every other to have finished j (its backward
    of j+1 needs its neighbours' iteration j+1, which their streams start only after their step
    of j). While this worker sits at the end of `completed`, another may have finished
    `completed + 1` and started `completed + 2`, but not finished it, so nobody has started
    `completed + 3`: lead = 2. Use lead = 1 with a synchronous optimizer (a barrier after every
    step). This assumes every member runs a stream tied to the others by transfers and its
    stage's all-reduce (true of our plans).
    """
    if lead < 1:
        raise RecoveryError(f"lead must be at least 1, got {lead}")
    return completed + lead + 1


# ---- commit records --------------------------------------------------------------------------------


class CommitLog:
    """Per-worker commit records: the last iteration whose optimizer step each worker applied.

    A worker records right after its STEP, before it waits on anything again, so the survivors'
    records are final by the time they agree on the next generation; `rollback.rollback_decision`
    reads them. (A stage's record is its replicas' records: they step together after their
    all-reduce, but a replica may abort just before stepping, so each keeps its own.)
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    def record(self, worker: Worker, iteration: int) -> None:
        self.store.set(Keys.commit(worker), str(iteration))

    def read(self, workers: Iterable[Worker]) -> dict[Worker, int]:
        """Each worker's last stepped iteration (-1: none yet)."""
        return {w: get_int(self.store, Keys.commit(w)) for w in workers}
