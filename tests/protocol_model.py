"""An exhaustive model of the recovery protocol: every interleaving, deaths at every step, up to renaming.

Pure (no processes, sockets or sleeps): each worker runs the real steps of
`runtime/fault/protocol.py` — the agreement rounds `agree` is made of (propose/adopt,
acknowledge, seal or supersede), the meeting before a generation's groups are built (gloo's
group construction waits for every member the same way), and recovery from the view it runs —
against an in-memory store with first-writer-wins `compare_set`, as the TCPStore has. A worker's
failure detector is a set of deaths it has noticed, restricted to the members of the view it
watches (as `FailureDetector.failed` is); its signal trips like the real one: a watched member
known failed, or a newer generation proposed that does not only admit replacements
(`membership.admits_only`, the detector's own function).

The search explores every order of every worker's steps, of up to `max_deaths` deaths (any live
worker, at any step) and of each survivor noticing each death, with memoisation on the whole
state. Noticing is folded into the next step that asks the detector (`Detector.consulted`): only
those steps can tell when it noticed, and each of them may have noticed any subset of the deaths
it has not yet, so every sequence of answers a monotone detector can give is explored. (A death
noticed at a step that does not ask is noticed at the next one that does; this needs noticing
never to disable a step, which `Model.moves` checks at every state.) At every quiescent state
(no step, no detection left to happen) it checks:
- termination / nobody waits on a dead member: every survivor runs a generation (no one is
  stuck waiting in a round or a meeting);
- agreement: all survivors run the same generation, whose failed set is exactly the dead
  (plus those failed before, minus admitted replacements);
and at every step: a worker that finishes a round finds that generation sealed in the store, no
survivor is evicted, and generations stay bounded (rounds end).

Encoding (the hot path). A state is `(store, rows)`: the store as a sorted tuple of int tuples
(`gen/G/view` as its generation and failed set, the counters as numbers, the outcome as 1 for
sealed), and one int tuple per worker (`ROW` names the fields) holding its step state, what its
detector noticed and the view it watches. Worker sets are bitmasks over `Model.workers`. Each
step decodes to the real objects (`Round`, `View`, a dict store), runs the real protocol code and
encodes the result; steps are memoised on (worker, row, store, what it noticed), which most
interleavings share. A dead worker's row keeps nothing: nobody reads a dead worker's state.

Symmetry reduction, and why it is sound. Let a permutation p of the workers act on a state by
renaming every worker everywhere: the rows change places (row i becomes row p(i)) and every
worker set (failed and dead sets of rounds, views' failed sets in rows and in the store's
`gen/G/view` values, noticed deaths) is renamed; keys never name a worker, and a worker's role
(member or joiner, proposing or not) is in its row, so it moves with it. Then
(1) the transitions commute with p: a step of worker p(i) in p(s) is the p-image of the step of
    i in s. The protocol reads workers only through set operations (union, difference, `in`,
    `<` in `admits_only`, the eviction test `me in winner.failed`) and `len(view.members)` (the
    meeting's size and the acknowledgement quorum), all invariant under renaming; the one place
    it orders workers, `View.members` (rank order), is only counted and searched, never indexed,
    in these steps, and `to_json` sorts the failed set, so equal sets give equal store values.
    `Topology.of` accepts any subset of the grid as failed, so every renamed view is valid. The
    deaths commute too (any live worker may die), and so does noticing (any subset of the
    unnoticed deaths).
(2) the checked properties are invariant under p: "every survivor runs a generation", "all run
    the same one", "its failed set equals the dead" (every scenario starts with
    `expected_failed` empty, so it is the dead set itself, which p renames alike), "the outcome
    is sealed", "nobody is evicted", and the generation bound.
By (1), s -> t implies p(s) -> p(t), so a path from the initial state maps, state by state, onto
a path between canonical representatives (`canonical` picks one state per orbit), and by (2)
each state on it violates a property iff its representative does: exploring one state per orbit
loses no interleaving that matters. (1) holds for every permutation, so no role needs fixing.
`canonical` takes the least of the images under every permutation of the workers named anywhere
in the state (at most the two dead and the joiner: nothing else is ever put in a worker set),
with the unnamed workers sorted by their rows (they refer to no one by name, so sorting them is
the same under every such permutation): one form per orbit. Of two unnamed workers with equal
rows only one steps or dies (the other's successors are renamings of its). Tests check (1)
directly on the real steps (`equivariant`, every permutation), and that the reduced search finds
exactly the orbits of the plain one.

Partial-order reduction, and why it is sound. A step of worker i is local at s when it writes
nothing, reads only keys that are present (every key is written once: `compare_set` against "",
so they stay) or a meeting counter that already reached its size (counters only grow), and
either does not ask the detector or cannot get another answer (no deaths left to happen and it
noticed every one). Where some live worker has a local step t, the search takes t alone. Then
(a) t is i's only transition from s and stays so, with the same result, in every state reached
    without i moving: what it reads cannot change and no other worker writes i's row;
(b) t commutes with every other transition (other workers' steps and deaths, which read and
    write only the store and their own rows, and the count of deaths, none of which t changes),
    and t followed by i's death ends in the same state as i's death (a dead row keeps nothing);
(c) the graph has no cycles (every step adds to the store, or moves a worker forward in a
    generation, or to a later one; generations are bounded), so every path from s is finite.
A path from s to a quiescent state must contain t or i's death (otherwise t is still enabled at
its end, by (a)); moving t to the front by (b) gives a path from t(s) with the same quiescent
end, and every property checked on a step of the original path is checked on the same step of
the moved one (those steps do not read i's row). By induction on the longest path from a state,
every quiescent state and every failing step reachable from s stays reachable, up to renaming,
in the reduced search. A test checks the reduced search ends in exactly the same quiescent
states as the unreduced one.

Forgetting, and why it is sound (`forget`). A worker reads only keys of the generation its round
agrees on (`Round.generation`, which its adopted view shares) or its meeting is for, and of the
generation after the one it meets at or runs (`Detector.broken`, `admits_only`); it writes only
those and the next one's view; and it only ever moves to later generations. So every key of a
generation below each live worker's lowest such generation is never read or written again, nor
is `gen/G/ack` once `gen/G/outcome` is written (a waiting member reads the outcome first;
sealing and superseding read only the outcome; a late acknowledgement writes the counter without
reading it). The checked properties do not read the store, except "the outcome is sealed", which
reads the finishing round's own generation. Two states that differ only in such keys therefore
have the same steps with the same results and checks, so dropping those keys (which merges
them) keeps every quiescent state and every failing step. A test checks the search with and
without it ends in the same quiescent states.

Measured with `python bench/bench_protocol_model.py` (one core of the shared 2-core machine):
see `bench/README.md` and the bench script's table.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from schedcomp.runtime.fault.membership import View, admits_only
from schedcomp.runtime.fault.protocol import (  # tests patch these names here
    ABORTED,
    ACK,
    ADOPT,
    DONE,
    MET,
    PROPOSE_NEXT,
    RETIRE,
    SEAL,
    WAIT,
    Evicted,
    Meeting,
    Round,
    begin,
    meet_step,
    step,
)
from schedcomp.runtime.fault.store import SEALED, SUPERSEDED, Keys
from schedcomp.topology import Topology, Worker

# ---- the encoding ---------------------------------------------------------------------------------

# A worker's row: what it runs, a round's fields, what its detector noticed and the view it watches.
ROW = ("kind", "gen", "failed", "dead", "propose", "phase", "win_gen", "win_failed", "arrived",
       "seen", "watch_gen", "watch_failed")
MASKS = (2, 3, 7, 9, 11)  # the fields of a row that are worker sets
DEAD_KIND, RUN, MEET, ROUND = 0, 1, 2, 3
DEAD_ROW = (DEAD_KIND, 0, 0, 0, 0, 0, -1, 0, 0, 0, -1, 0)
PHASES = (ADOPT, ACK, WAIT, SEAL, PROPOSE_NEXT, RETIRE, DONE)
VIEW_KEY, ACK_KEY, OUTCOME_KEY, ARRIVED_KEY = 0, 1, 2, 3  # store entries: (what, generation, value, failed)

Row = tuple[int, ...]
StoreCode = tuple[tuple[int, int, int, int], ...]
EncodedState = tuple[StoreCode, tuple[Row, ...]]
# (new row and store, or None: it waits), whether it asked the detector, whether it wrote nothing and
# read only what cannot change
Step = tuple[tuple[Row, StoreCode] | None, bool, bool]


def arrived_key(generation: int) -> str:
    """The counter of the meeting before generation `generation`'s groups are built."""
    return f"gen{generation}/arrived"


class Store:
    """A dict with the TCPStore's four operations (the `events` wake-up counter is not kept: it only wakes pollers).

    It notes whether a step wrote, and whether it read anything that another worker could still
    change (an absent key, a counter): a step that did neither is `local` (see `Model.moves`).
    """

    def __init__(self, items: dict[str, bytes]) -> None:
        self.d = items
        self.written = self.unstable = False

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.d.get(key)
        if (current is None and expected == "") or (current is not None and current == expected.encode()):
            self.d[key] = desired.encode()
            self.written = True
        return self.d[key]

    def add(self, key: str, amount: int) -> int:
        if key == Keys.events():
            return 0
        value = int(self.d.get(key, b"0")) + amount
        if amount:
            self.d[key] = str(value).encode()
            self.written = True
        else:
            self.unstable = True  # a counter others may still bump
        return value

    def check(self, keys: list[str]) -> bool:
        present = all(k in self.d for k in keys)
        self.unstable |= not present  # present keys are written once: they stay
        return present

    def get(self, key: str) -> bytes:
        return self.d[key]


class Detector:
    """A worker's failure detector: the deaths it noticed, among the members of the view it watches."""

    def __init__(self, seen: frozenset[Worker], watching: View | None) -> None:
        self.seen, self.watching = seen, watching
        self.consulted = False  # whether the step asked what it noticed (`failed` or `broken`)

    def watch(self, view: View) -> None:
        self.watching = view

    def failed(self) -> frozenset[Worker]:
        self.consulted = True
        return self.seen & frozenset(self.watching.members) if self.watching is not None else frozenset()

    def broken(self, store: Store) -> bool:
        """The signal: a watched member failed, or a newer generation (not just an admission) was proposed."""
        v = self.watching
        assert v is not None
        proposed = store.check([Keys.view(v.generation + 1)])
        return bool(self.failed()) or (proposed and not admits_only(store, v.generation + 1, v.failed))


@dataclass(frozen=True)
class Meet:
    view: View
    meeting: Meeting


@dataclass(frozen=True)
class Run:
    view: View


DEAD = "dead"
Node = Round | Meet | Run | str


class Violation(AssertionError):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class Codec:
    """Between the model's int tuples and the protocol's objects, for one job shape (memoised both ways)."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.shape = shape
        self.workers = Topology.of(*shape).workers
        self.index = {w: i for i, w in enumerate(self.workers)}
        self._sets: dict[int, frozenset[Worker]] = {}
        self._views: dict[tuple[int, int], View] = {}
        self._texts: dict[bytes, tuple[int, int]] = {}
        self._stores: dict[StoreCode, dict[str, bytes]] = {}
        self._keys: dict[str, tuple[int, int]] = {}

    def workers_of(self, mask: int) -> frozenset[Worker]:
        got = self._sets.get(mask)
        if got is None:
            got = self._sets[mask] = frozenset(w for i, w in enumerate(self.workers) if mask >> i & 1)
        return got

    def mask(self, workers: frozenset[Worker]) -> int:
        return sum(1 << self.index[w] for w in workers)

    def view(self, generation: int, mask: int) -> View:
        got = self._views.get((generation, mask))
        if got is None:
            got = self._views[generation, mask] = View(generation, Topology.of(*self.shape, self.workers_of(mask)))
        return got

    def view_code(self, view: View | None) -> tuple[int, int]:
        return (-1, 0) if view is None else (view.generation, self.mask(view.failed))

    # ---- rows ------------------------------------------------------------------------------------

    def row(self, node: Node, seen: frozenset[Worker], watching: View | None) -> Row:
        if node == DEAD:
            return DEAD_ROW
        tail = (self.mask(seen), *self.view_code(watching))
        if isinstance(node, Run):
            return (RUN, *self.view_code(node.view), 0, 0, 0, -1, 0, 0, *tail)
        if isinstance(node, Meet):
            return (MEET, *self.view_code(node.view), 0, 0, 0, -1, 0, int(node.meeting.arrived), *tail)
        assert isinstance(node, Round) and node.shape == self.shape, node
        assert node.winner is None or node.winner.generation == node.generation, node  # `forget` relies on it
        return (ROUND, node.generation, self.mask(node.failed), self.mask(node.dead), int(node.propose),
                PHASES.index(node.phase), *self.view_code(node.winner), 0, *tail)

    def node(self, i: int, row: Row) -> tuple[Node, View | None]:
        """Worker i's step state and the view its detector watches (`me` is the row's place)."""
        kind, gen, failed, dead, propose, phase, win_gen, win_failed, arrived, _, watch_gen, watch_failed = row
        watching = self.view(watch_gen, watch_failed) if watch_gen >= 0 else None
        if kind == RUN:
            return Run(self.view(gen, failed)), watching
        if kind == MEET:
            view = self.view(gen, failed)
            return Meet(view, Meeting(arrived_key(gen), len(view.members), bool(arrived))), watching
        assert kind == ROUND, row
        winner = self.view(win_gen, win_failed) if win_gen >= 0 else None
        return Round(self.workers[i], self.shape, gen, self.workers_of(failed), self.workers_of(dead),
                     bool(propose), PHASES[phase], winner), watching

    # ---- the store -------------------------------------------------------------------------------

    def store_items(self, code: StoreCode) -> dict[str, bytes]:
        """A fresh dict of the store `code` (the caller may write to it)."""
        got = self._stores.get(code)
        if got is None:
            got = self._stores[code] = dict(self._item(entry) for entry in code)
        return dict(got)

    def _item(self, entry: tuple[int, int, int, int]) -> tuple[str, bytes]:
        what, g, value, failed = entry
        if what == VIEW_KEY:
            return Keys.view(g), self.view(value, failed).to_json().encode()
        if what == OUTCOME_KEY:
            return Keys.outcome(g), (SEALED if value else SUPERSEDED).encode()
        return (Keys.ack(g) if what == ACK_KEY else arrived_key(g)), str(value).encode()

    def store_code(self, items: dict[str, bytes]) -> StoreCode:
        return tuple(sorted(self._entry(k, v) for k, v in items.items()))

    def _entry(self, key: str, value: bytes) -> tuple[int, int, int, int]:
        what_g = self._keys.get(key)
        if what_g is None:
            parts = key.split("/")
            if parts[-1] == "arrived":
                what_g = (ARRIVED_KEY, int(parts[0][3:]))
            else:
                what_g = ({"view": VIEW_KEY, "ack": ACK_KEY, "outcome": OUTCOME_KEY}[parts[2]], int(parts[1]))
            self._keys[key] = what_g
        what, g = what_g
        if what == VIEW_KEY:
            got = self._texts.get(value)
            if got is None:
                got = self._texts[value] = self.view_code(View.from_json(value))
            return (what, g, *got)
        if what == OUTCOME_KEY:
            return (what, g, int(value == SEALED.encode()), 0)
        return (what, g, int(value), 0)


# ---- symmetry ------------------------------------------------------------------------------------


def rename_mask(mask: int, perm: tuple[int, ...]) -> int:
    """`mask` with worker i renamed perm[i]."""
    out = 0
    while mask:
        low = mask & -mask
        out |= 1 << perm[low.bit_length() - 1]
        mask ^= low
    return out


class _Renaming:
    """One renaming with its results memoised (the search renames the same rows and stores over and over)."""

    def __init__(self, perm: tuple[int, ...]) -> None:
        self.perm = perm
        self.masks = [rename_mask(m, perm) for m in range(1 << len(perm))]
        self.rows: dict[Row, Row] = {}
        self.stores: dict[StoreCode, StoreCode] = {}

    def row(self, r: Row) -> Row:
        got = self.rows.get(r)
        if got is None:
            t = self.masks
            got = self.rows[r] = (r[0], r[1], t[r[2]], t[r[3]], r[4], r[5], r[6], t[r[7]], r[8], t[r[9]], r[10],
                                  t[r[11]])
        return got

    def store(self, store: StoreCode) -> StoreCode:
        got = self.stores.get(store)
        if got is None:
            t = self.masks
            got = self.stores[store] = tuple(sorted((e[0], e[1], e[2], t[e[3]]) for e in store))
        return got


_RENAMINGS: dict[tuple[int, ...], _Renaming] = {}


def _renaming(perm: tuple[int, ...]) -> _Renaming:
    got = _RENAMINGS.get(perm)
    if got is None:
        got = _RENAMINGS[perm] = _Renaming(perm)
    return got


def rename(state: EncodedState, perm: tuple[int, ...]) -> EncodedState:
    """The state with every worker i renamed perm[i] (rows move, worker sets are renamed)."""
    store, rows = state
    renaming = _renaming(perm)
    moved: list[Row] = [DEAD_ROW] * len(rows)
    for i, row in enumerate(rows):
        moved[perm[i]] = renaming.row(row)
    return renaming.store(store), tuple(moved)


def named(state: EncodedState) -> int:
    """The workers named in some worker set of the state."""
    store, rows = state
    mask = 0
    for e in store:
        mask |= e[3]
    for r in rows:
        mask |= r[2] | r[3] | r[7] | r[9] | r[11]
    return mask


def canonical(state: EncodedState) -> EncodedState:
    """The least image of `state` under the renamings of the workers it names (see the module docstring)."""
    store, rows = state
    n = len(rows)
    mask = named(state)
    if not mask:
        return store, tuple(sorted(rows))
    names = [i for i in range(n) if mask >> i & 1]
    unnamed = [i for i in range(n) if not mask >> i & 1]
    best: EncodedState | None = None
    for order in itertools.permutations(names):
        perm = list(range(n))  # the unnamed keep their numbers: no worker set holds them
        for new, old in enumerate(order):
            perm[old] = new
        renaming = _renaming(tuple(perm))
        # Unnamed rows name only the named workers, so their renaming does not depend on their own places.
        candidate = (renaming.store(store),
                     (*(renaming.row(rows[i]) for i in order), *sorted(renaming.row(rows[i]) for i in unnamed)))
        if best is None or candidate < best:
            best = candidate
    assert best is not None
    return best


# ---- the search ----------------------------------------------------------------------------------


@dataclass
class Model:
    codec: Codec
    expected_failed: int  # failed in the final view, before counting deaths (a mask; empty in every scenario)
    max_generation: int
    max_deaths: int = 2
    symmetry: bool = True
    partial_order: bool = True
    forgetting: bool = True
    explored: int = 0
    seconds: float = 0.0
    visited: set[EncodedState] = field(default_factory=set)
    ends: set[EncodedState] = field(default_factory=set)  # the quiescent states
    _steps: dict[tuple[int, Row, StoreCode, int], Step] = field(default_factory=dict)

    @property
    def workers(self) -> tuple[Worker, ...]:
        return self.codec.workers

    @property
    def quiescent(self) -> int:
        return len(self.ends)

    def run(self, initial: EncodedState) -> Model:
        start = time.perf_counter()
        symmetric: Callable[[EncodedState], EncodedState] = canonical if self.symmetry else _same
        unread: Callable[[EncodedState], EncodedState] = forget if self.forgetting else _same

        def reduce(s: EncodedState) -> EncodedState:
            return symmetric(unread(s))
        first = reduce(initial)
        stack = [first]
        self.visited.add(first)
        while stack:
            state = stack.pop()
            self.explored += 1
            moves, ample = self.moves(state)
            if not moves:
                self.ends.add(state)
                self.check_quiescent(state)
            for nxt in moves if ample else [*moves, *self.deaths(state)]:
                nxt = reduce(nxt)
                if nxt not in self.visited:
                    self.visited.add(nxt)
                    stack.append(nxt)
        self.seconds = time.perf_counter() - start
        return self

    # ---- transitions ----------------------------------------------------------------------------

    def moves(self, s: EncodedState) -> tuple[list[EncodedState], bool]:
        """Every worker's next step that changes something, and whether they are one local step alone.

        Noticing deaths: a detector's knowledge is read by its own worker's steps only, and only
        by those that ask it (`Detector.consulted`), so when it notices a death matters only
        relative to those: noticing is folded into the asking step (every subset of the unnoticed
        deaths), which spares the search the orders that nobody can tell apart. This relies on
        noticing never disabling a step (a step that moves having noticed less also moves having
        noticed more), which is checked here at every state.

        Partial order: a step is local when it writes nothing, reads only keys that are present
        (written once, so they stay) and does not ask the detector; see the module docstring for
        why exploring it alone loses nothing.
        """
        store, rows = s
        dead = 0
        for i, row in enumerate(rows):
            if row[0] == DEAD_KIND:
                dead |= 1 << i
        settled = dead.bit_count() == self.max_deaths  # no more deaths: a detector that noticed them all is done
        twins = self._twins(s)
        out: list[EncodedState] = []
        for i, row in enumerate(rows):
            if row[0] == DEAD_KIND or twins >> i & 1:
                continue
            seen = row[9]
            got, consulted, quiet = self.step(i, row, store, seen)
            if got is not None:
                if quiet and (not consulted or (settled and not dead & ~seen)) and self.partial_order:
                    return [(got[1], _put(rows, i, got[0]))], True
                out.append((got[1], _put(rows, i, got[0])))
            if not consulted:
                continue
            for noticed in _subsets(dead & ~seen):
                if noticed:
                    more = self.step(i, row, store, seen | noticed)[0]
                    if more is not None:
                        out.append((more[1], _put(rows, i, more[0])))
                    elif got is not None:
                        raise Violation("model", f"{self.workers[i]} noticing {self.codec.workers_of(noticed)} "
                                                 f"disables its step from {self.codec.node(i, row)[0]}")
        return out, False

    def deaths(self, s: EncodedState) -> Iterator[EncodedState]:
        store, rows = s
        if sum(r[0] == DEAD_KIND for r in rows) < self.max_deaths:
            twins = self._twins(s)
            for i, row in enumerate(rows):
                if row[0] != DEAD_KIND and not twins >> i & 1:
                    yield store, _put(rows, i, DEAD_ROW)

    def _twins(self, s: EncodedState) -> int:
        """Workers whose moves are renamings of another's (a canonical state's equal unnamed rows): skipped."""
        if not self.symmetry:
            return 0
        rows = s[1]
        unnamed = ~named(s)
        return sum(1 << i for i in range(1, len(rows))
                   if unnamed >> i & unnamed >> (i - 1) & 1 and rows[i] == rows[i - 1])

    def step(self, i: int, row: Row, store_code: StoreCode, seen: int) -> Step:
        """Worker i's step from `row` against `store_code` having noticed `seen` (memoised), see `Step`."""
        key = (i, row, store_code, seen)
        got = self._steps.get(key)
        if got is None:
            got = self._steps[key] = self._step(i, row, store_code, seen)
        return got

    def _step(self, i: int, row: Row, store_code: StoreCode, seen_mask: int) -> Step:
        c = self.codec
        node, watching = c.node(i, row)
        seen = c.workers_of(seen_mask)
        store, det, me = Store(c.store_items(store_code)), Detector(seen, watching), self.workers[i]
        if isinstance(node, Round):
            try:
                after: Node = step(store, det, node)
            except Evicted as e:
                raise Violation("evicted", str(e)) from None
            if after == node:
                return None, det.consulted, False
            assert isinstance(after, Round)
            if after.generation > self.max_generation:
                raise Violation("unbounded", f"{me} reached generation {after.generation}")
            if after.phase == DONE:
                assert after.winner is not None
                g = after.winner.generation
                if store.d.get(Keys.outcome(g)) != SEALED.encode():
                    raise Violation("disagreement", f"{me} returned generation {g}, which is not sealed")
                after = Meet(after.winner, Meeting(arrived_key(g), len(after.winner.members)))
        elif isinstance(node, Meet):
            # Arriving, or finding everyone arrived, does not read the signal: ask the detector only if it matters.
            got = meet_step(store, node.meeting, False)
            if got == MET:
                store.unstable = False  # everyone arrived: the counter only grows, so it stays met
            elif got == node.meeting:
                got = meet_step(store, node.meeting, det.broken(store))
            if got == node.meeting:
                return None, det.consulted, False
            after = Run(node.view) if got == MET else begin(node.view, me, det) if got == ABORTED else \
                Meet(node.view, got)
        else:
            assert isinstance(node, Run)
            if not det.broken(store):
                return None, det.consulted, False
            after = begin(node.view, me, det)  # `FaultSession.recover`
        moved = c.row(after, seen, det.watching), (c.store_code(store.d) if store.written else store_code)
        return moved, det.consulted, not (store.written or store.unstable)

    # ---- properties -------------------------------------------------------------------------------

    def check_quiescent(self, s: EncodedState) -> None:
        _, rows = s
        dead = sum(1 << i for i, r in enumerate(rows) if r[0] == DEAD_KIND)
        if all(r[0] == DEAD_KIND or (r[0] == ROUND and not r[4]) for r in rows):
            return  # every worker that ran died: no one can admit a replacement (the job restarts, `fault.restart`)
        stuck = {str(self.workers[i]): self.codec.node(i, r)[0] for i, r in enumerate(rows)
                 if r[0] not in (DEAD_KIND, RUN)}
        dead_names = sorted(map(str, self.codec.workers_of(dead)))
        if stuck:
            raise Violation("deadlock", f"waiting forever with {dead_names} dead: {stuck}")
        views = {(r[1], r[2]) for r in rows if r[0] == RUN}
        if len(views) != 1:
            raise Violation("disagreement", f"survivors run different generations: {sorted(views)}")
        ((generation, failed),) = views
        if failed != self.expected_failed | dead:
            raise Violation("disagreement", f"generation {generation} has failed set "
                                            f"{sorted(map(str, self.codec.workers_of(failed)))}, dead are {dead_names}")


def forget(state: EncodedState) -> EncodedState:
    """The state less the keys that no live worker will read again (see "Forgetting" in the module docstring)."""
    store, rows = state
    floor = min((r[1] + (r[0] == RUN) for r in rows if r[0] != DEAD_KIND), default=1 << 30)
    decided = {e[1] for e in store if e[0] == OUTCOME_KEY}
    kept = tuple(e for e in store if e[1] >= floor and not (e[0] == ACK_KEY and e[1] in decided))
    return state if len(kept) == len(store) else (kept, rows)


def _same(state: EncodedState) -> EncodedState:
    return state


def _put(t: tuple, i: int, value: object) -> tuple:
    return (*t[:i], value, *t[i + 1:])


def _subsets(mask: int) -> Iterator[int]:
    """Every subset of `mask` (the empty one first)."""
    sub = 0
    while True:
        yield sub
        if sub == mask:
            return
        sub = (sub - mask) & mask


def successors(model: Model, s: EncodedState) -> set[EncodedState]:
    """Every state one step or one death after `s` (no reduction)."""
    reductions = model.symmetry, model.partial_order
    model.symmetry = model.partial_order = False
    try:
        return {*model.moves(s)[0], *model.deaths(s)}
    finally:
        model.symmetry, model.partial_order = reductions


def equivariant(model: Model, s: EncodedState, perm: tuple[int, ...]) -> bool:
    """Whether renaming commutes with the steps at `s`: the renamed state's successors are the successors renamed."""
    return successors(model, rename(s, perm)) == {rename(t, perm) for t in successors(model, s)}


# ---- scenarios ------------------------------------------------------------------------------------

SHAPES = {3: (3, 1), 4: (2, 2), 5: (5, 1), 6: (3, 2)}


def _sealed(codec: Codec, view: View) -> StoreCode:
    return codec.store_code({Keys.view(view.generation): view.to_json().encode(),
                             Keys.outcome(view.generation): SEALED.encode()})


def recovery(n: int) -> tuple[Model, EncodedState]:
    """Every worker runs generation 0; deaths break it."""
    codec = Codec(SHAPES[n])
    view = View.initial(*codec.shape)
    rows = tuple(codec.row(Run(view), frozenset(), view) for _ in codec.workers)
    return Model(codec, 0, max_generation=2 * n + 2), (_sealed(codec, view), rows)


def first_agreement(n: int) -> tuple[Model, EncodedState]:
    """`join_job`: every worker proposes generation 0 (a worker that dies first never joins)."""
    codec = Codec(SHAPES[n])
    topology = Topology.of(*codec.shape)
    rows = tuple(codec.row(begin(View(-1, topology), w, Detector(frozenset(), None)), frozenset(), None)
                 for w in codec.workers)
    return Model(codec, 0, max_generation=2 * n + 2), ((), rows)


def admission(n: int) -> tuple[Model, EncodedState]:
    """Generation 0 lacks the last worker; its replacement is admitted at a boundary (and anyone may die)."""
    codec = Codec(SHAPES[n])
    joiner = codec.workers[-1]
    view = View(0, Topology.of(*codec.shape, [joiner]))
    rows = tuple(codec.row(begin(view, w, Detector(frozenset(), view), propose=False), frozenset(), None)
                 if w == joiner else
                 codec.row(begin(view, w, Detector(frozenset(), view), joiners=[joiner]), frozenset(), view)
                 for w in codec.workers)
    return Model(codec, 0, max_generation=2 * n + 2), (_sealed(codec, view), rows)


SCENARIOS = {"recovery": recovery, "first-agreement": first_agreement, "admission": admission}


def search(scenario: str, members: int, deaths: int, *, reduced: bool = True, symmetry: bool | None = None,
           partial_order: bool | None = None, forgetting: bool | None = None) -> Model:
    """The whole search of one scenario; raises `Violation` at the first property that fails.

    `reduced` turns every reduction on or off; the others turn one on or off on top of it."""
    model, initial = SCENARIOS[scenario](members)
    model.max_deaths = deaths
    model.symmetry = reduced if symmetry is None else symmetry
    model.partial_order = reduced if partial_order is None else partial_order
    model.forgetting = reduced if forgetting is None else forgetting
    return model.run(initial)
