"""The agreement protocol as small steps: the same code runs in the job and in the exhaustive model.

`agreement.agree` drives a `Round` with the job's store and failure detector, sleeping between
steps that change nothing; `tests/fault/test_fault_protocol.py` drives the very same steps of several
workers against an in-memory store, in every interleaving, with deaths injected at every step.
Each step makes at most one store write (plus reads of write-once keys or monotone counters, and
the `events` wake-up), so the model's interleavings are the job's interleavings.

A round, per generation G (see `agreement` for why it is correct):
ADOPT    `compare_set(gen/G/view)` with our proposal (a replacement only reads it); first writer wins.
ACK      bump `gen/G/ack` (only when we know of no failure the view misses).
WAIT     until `gen/G/outcome` is decided, every member acknowledged (-> SEAL), or our detector
         reports a member of G failed (-> PROPOSE_NEXT).
SEAL     `compare_set(gen/G/outcome, sealed)`: first writer wins.
PROPOSE_NEXT  `compare_set(gen/G+1/view)` with everything we know, *before* retiring G, so whoever
         sees G superseded finds our news in G+1.
RETIRE   `compare_set(gen/G/outcome, superseded)`; if G was sealed first we return it anyway (the
         G+1 proposal breaks it at once).
DONE     G is sealed: `winner` is the job's view.

`Meeting` is the other wait of a change of generation: every member must show up (the store
meeting before a generation's groups are built, the final meeting); it gives up as soon as the
generation breaks, so nobody waits on a member that died after the agreement.

Both waits are also bounded in time (`agree`'s timeout, `meet`'s; not the final meeting, see
`FaultSession.finish`): the detector ends them on a failure it sees, the bound on one it cannot (a
member alive but stuck, a key that never fills).
Past it a worker raises a `RecoveryTimeout` and leaves the job: it stops taking steps, exactly as
if it had died between two of them, which the model explores at every step, so a timeout cannot
make two survivors disagree; the others then see it dead (its launcher's notice, or its heartbeat).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.membership import GenerationAborted, View
from schedcomp.runtime.fault.store import SEALED, SUPERSEDED, Keys, backoff
from schedcomp.topology import Topology, Worker

ADOPT, ACK, WAIT, SEAL, PROPOSE_NEXT, RETIRE, DONE = "adopt", "ack", "wait", "seal", "propose-next", "retire", "done"


class Evicted(RecoveryError):
    """This worker was declared failed by the others: exit, and let the launcher start a replacement."""


AGREEMENT_TIMEOUT = 180.0  # seconds: `FaultSession`'s default bound on each wait of a change of generation


class RecoveryTimeout(RecoveryError):
    """A wait of a change of generation ran past its bound: this worker leaves the job (its process
    exits; `ResilientTrainer` goes through its last resort). It is never retried in place: giving up
    between two steps is, to the others, the same as dying there (which the model explores)."""


class MeetingTimeout(RecoveryTimeout):
    """Not every member of a generation arrived at its meeting in time, and none is known failed."""


class KeyValue(Protocol):
    """What the protocol needs of a store (a `torch.distributed.Store` has it; so does the model's)."""

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    def add(self, key: str, amount: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def get(self, key: str) -> bytes: ...


class Watcher(Protocol):
    """What the protocol needs of a failure detector."""

    def watch(self, view: View) -> None: ...
    def failed(self) -> frozenset[Worker]: ...


@dataclass(frozen=True)
class Round:
    """One worker's progress through an agreement: everything `agree` keeps between two steps."""

    me: Worker
    shape: tuple[int, int]  # pp, dp
    generation: int  # the generation being agreed on
    failed: frozenset[Worker]  # what this worker proposes for it
    dead: frozenset[Worker]  # failures its detector reported during the round
    propose: bool = True  # False: a replacement, which only adopts views
    phase: str = ADOPT
    winner: View | None = None  # the adopted view of `generation` (from ADOPT on)


def begin(view: View, me: Worker, detector: Watcher, *, joiners: Iterable[Worker] = (), propose: bool = True) -> Round:
    """The round that agrees on the generation after `view` (see `agreement.agree`)."""
    dead = detector.failed()
    t = view.topology
    return Round(me, (t.pp, t.dp), view.generation + 1, (view.failed - frozenset(joiners)) | dead, dead, propose)


def step(store: KeyValue, detector: Watcher, r: Round) -> Round:
    """One step of the round; returns `r` itself when it has to wait (nothing changed)."""
    if r.phase == ADOPT:
        return _adopt(store, detector, r)
    assert r.winner is not None, r
    g = r.winner.generation
    if r.phase == ACK:
        store.add(Keys.ack(g), 1)
        return replace(r, phase=WAIT)
    if r.phase == WAIT:
        if store.check([Keys.outcome(g)]):
            return _decided(store, detector, r, store.get(Keys.outcome(g)).decode())
        if store.add(Keys.ack(g), 0) >= len(r.winner.members):
            return replace(r, phase=SEAL)
        news = detector.failed() - r.winner.failed
        return replace(r, dead=r.dead | news, phase=PROPOSE_NEXT) if news else r
    if r.phase == SEAL:
        return _decided(store, detector, r, store.compare_set(Keys.outcome(g), "", SEALED).decode())
    if r.phase == PROPOSE_NEXT:
        store.compare_set(Keys.view(g + 1), "", r.winner.next(r.winner.failed | r.dead).to_json())
        return replace(r, phase=RETIRE)
    if r.phase == RETIRE:
        outcome = store.compare_set(Keys.outcome(g), "", SUPERSEDED).decode()
        store.add(Keys.events(), 1)  # wake every detector: G is over, or G+1 breaks it
        return replace(r, phase=DONE) if outcome == SEALED else _next(r)
    return r  # DONE


def waiting_for(store: KeyValue, r: Round) -> str:
    """What a round that made no progress waits for (for the timeout's message)."""
    if r.winner is None:
        return f"no generation {r.generation} was proposed"
    g = r.winner.generation
    acks = store.add(Keys.ack(g), 0)
    return f"generation {g} was not sealed ({acks} of {len(r.winner.members)} members acknowledged)"


def _adopt(store: KeyValue, detector: Watcher, r: Round) -> Round:
    key = Keys.view(r.generation)
    if r.propose:
        proposal = View(r.generation, Topology.of(*r.shape, r.failed))
        text = store.compare_set(key, "", proposal.to_json())
    elif store.check([key]):
        text = store.get(key)
    else:
        return r  # a replacement waits for the survivors to propose
    store.add(Keys.events(), 1)  # wake every detector: a generation change is under way
    winner = View.from_json(text)
    if r.me in winner.failed:
        if r.propose:
            raise Evicted(f"worker {r.me} was declared failed in generation {winner.generation}: "
                          "exit and let the launcher start a replacement")
        return replace(r, generation=r.generation + 1)  # a replacement waits for a view that admits it
    detector.watch(winner)
    dead = r.dead | detector.failed()
    return replace(r, winner=winner, dead=dead, phase=PROPOSE_NEXT if dead - winner.failed else ACK)


def _decided(store: KeyValue, detector: Watcher, r: Round, outcome: str) -> Round:
    if outcome == SEALED:
        return replace(r, phase=DONE)
    assert r.winner is not None
    news = detector.failed() - r.winner.failed
    if (r.dead | news) - r.winner.failed:  # G is over, but the next view must hold what we know
        return replace(r, dead=r.dead | news, phase=PROPOSE_NEXT)
    return _next(r)


def _next(r: Round) -> Round:
    assert r.winner is not None
    return Round(r.me, r.shape, r.winner.generation + 1, r.winner.failed | r.dead, r.dead, r.propose)


# ---- meetings ------------------------------------------------------------------------------------

MET, ABORTED = "met", "aborted"


@dataclass(frozen=True)
class Meeting:
    """Waiting for every member of a generation at `key` (a counter in the store)."""

    key: str
    size: int
    arrived: bool = False


def meet(store: KeyValue, key: str, size: int, signal: threading.Event, *,
         timeout: float | None = AGREEMENT_TIMEOUT, poll: float = 0.002, most: float = 0.02) -> None:
    """Wait until `size` workers arrived at `key`; raise `GenerationAborted` if the generation breaks first.

    Polls every `poll` seconds, backing off to `most` (`store.backoff`); a broken generation wakes it at once.
    The signal is the usual way out, but it trips only on a failure the detector sees: a member alive
    and stuck before the meeting (or a bug that loses an arrival) would hold everyone forever, so past
    `timeout` seconds it raises `MeetingTimeout`: the caller leaves the job, see `RecoveryTimeout`.
    `timeout=None` waits for the meeting or the signal only (the final meeting: see `FaultSession.finish`).
    """
    m: Meeting | str = Meeting(key, size)
    deadline, delays = time.monotonic() + (float("inf") if timeout is None else timeout), backoff(poll, most)
    while m != MET:
        got = meet_step(store, m, signal.is_set())
        if got == ABORTED:
            raise GenerationAborted(f"the generation broke before everyone met at {key}: agree on the next one")
        if got == m:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MeetingTimeout(f"only {store.add(key, 0)} of {size} members arrived at {key} within "
                                     f"{timeout:g} s, and none is known failed: {_STUCK}")
            signal.wait(min(next(delays), left))
        m = got


def await_keys(store: KeyValue, keys: list[str], signal: threading.Event, *, timeout: float, what: str,
               poll: float = 0.005, most: float = 0.02) -> None:
    """Wait until every one of `keys` is in the store (members' records), with `meet`'s bounds: raise
    `GenerationAborted` as soon as the generation breaks, `MeetingTimeout` past `timeout` seconds.
    `what` names what is awaited, for the messages. Polls back off from `poll` to `most`, as `meet`'s do."""
    deadline, delays = time.monotonic() + timeout, backoff(poll, most)
    while not store.check(keys):
        if signal.wait(min(next(delays), max(0.0, deadline - time.monotonic()))):
            raise GenerationAborted(f"the generation broke while waiting for {what}: agree on the next one")
        if time.monotonic() > deadline and (missing := [k for k in keys if not store.check([k])]):
            raise MeetingTimeout(f"{what}: {len(missing)} of {len(keys)} keys missing after {timeout:g} s "
                                 f"(e.g. {missing[0]}), and no member is known failed: {_STUCK}")


_STUCK = "check the logs of the members missing (alive but stuck?), or raise the agreement timeout if they are slow"


def met(store: KeyValue, key: str, size: int) -> bool:
    """Whether everyone arrived at the meeting `key` (never blocks)."""
    return store.add(key, 0) >= size


def meet_step(store: KeyValue, m: Meeting, broken: bool) -> Meeting | str:
    """Arrive, then MET once everyone has; ABORTED when the generation broke first (`broken`); else `m`."""
    if not m.arrived:
        store.add(m.key, 1)
        return replace(m, arrived=True)
    if met(store, m.key, m.size):
        return MET
    return ABORTED if broken else m

