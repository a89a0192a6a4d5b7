"""The protocol model's states: their encoding as ints, and the renaming and forgetting that merge them.

Encoding (the hot path). A state is `(store, rows)`: the store as a sorted tuple of int tuples
(`gen/G/view` as its generation and failed set, the counters as numbers, the outcome as 1 for
sealed), and one int tuple per worker (`ROW` names the fields) holding its step state, what its
detector noticed and the view it watches. Worker sets are bitmasks over `Codec.workers`. Each
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
in the state (only the dead and the joiner: nothing else is ever put in a worker set),
with the unnamed workers sorted by their rows (they refer to no one by name, so sorting them is
the same under every such permutation): one form per orbit. Of two unnamed workers with equal
rows only one steps or dies (the other's successors are renamings of its). Tests check (1)
directly on the real steps (`equivariant`, every permutation), and that the reduced search finds
exactly the orbits of the plain one.

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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from schedcomp.runtime.fault.membership import View
from schedcomp.runtime.fault.protocol import ACK, ADOPT, DONE, PROPOSE_NEXT, RETIRE, SEAL, WAIT, Meeting, Round
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


def arrived_key(generation: int) -> str:
    """The counter of the meeting before generation `generation`'s groups are built."""
    return f"gen{generation}/arrived"


@dataclass(frozen=True)
class Meet:
    view: View
    meeting: Meeting


@dataclass(frozen=True)
class Run:
    view: View


DEAD = "dead"
Node = Round | Meet | Run | str


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


def forget(state: EncodedState) -> EncodedState:
    """The state less the keys that no live worker will read again (see "Forgetting" in the module docstring)."""
    store, rows = state
    floor = min((r[1] + (r[0] == RUN) for r in rows if r[0] != DEAD_KIND), default=1 << 30)
    decided = {e[1] for e in store if e[0] == OUTCOME_KEY}
    kept = tuple(e for e in store if e[1] >= floor and not (e[0] == ACK_KEY and e[1] in decided))
    return state if len(kept) == len(store) else (kept, rows)
