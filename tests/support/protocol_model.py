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

States are encoded as tuples of ints, merged up to renaming the workers and less the
store keys nobody reads again (`protocol_states`, whose docstring says why that is sound).

Partial-order reduction, and why it is sound. A step of worker i is local at s when it writes
nothing, reads only views and outcomes that are present (written once, by `compare_set` against
"", so they stay) or a meeting counter that already reached its size (counters only grow), and
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

Measured with `python bench/bench_protocol_model.py` (one process on the shared 2-core machine, load
average about 17; 345 s in all): states explored with every reduction, the quiescent ones among
them, and seconds; no property failed anywhere. Without the reductions (`search(reduced=False)`)
3 members take 313-8,719 states and recovery with 4 members and 2 deaths 89,277 states (3.3 s);
the model before this encoding and these reductions took 224,409 states and 163 s for that case.

| scenario        | members | deaths | states    | quiescent | seconds |
|-----------------|---------|--------|-----------|-----------|---------|
| recovery        | 3       | 1 / 2  | 48 / 136          | 3 / 6   | 0.0 / 0.0   |
| first-agreement | 3       | 1 / 2  | 190 / 376         | 3 / 6   | 0.0 / 0.0   |
| admission       | 3       | 1 / 2  | 370 / 710         | 3 / 7   | 0.0 / 0.0   |
| recovery        | 4       | 1 / 2  | 185 / 1,745       | 4 / 13  | 0.0 / 0.1   |
| first-agreement | 4       | 1 / 2  | 780 / 4,162       | 4 / 13  | 0.0 / 0.2   |
| admission       | 4       | 1 / 2  | 1,781 / 9,584     | 4 / 13  | 0.1 / 0.4   |
| recovery        | 5       | 1 / 2  | 561 / 18,897      | 5 / 24  | 0.0 / 0.7   |
| first-agreement | 5       | 1 / 2  | 2,775 / 48,549    | 5 / 24  | 0.1 / 3.3   |
| admission       | 5       | 1 / 2  | 7,018 / 129,151   | 5 / 24  | 0.3 / 8.9   |
| recovery        | 6       | 1 / 2  | 1,442 / 169,453   | 6 / 40  | 0.0 / 13.0  |
| first-agreement | 6       | 1 / 2  | 8,598 / 509,539   | 6 / 40  | 0.5 / 71.1  |
| admission       | 6       | 1 / 2  | 23,571 / 1,489,403 | 6 / 40 | 1.4 / 240.3 |

Two deliberate bugs are caught through every reduction, in every scenario with 3 and 4 members
(`tests/fault/test_fault_protocol.py`): a group construction that cannot be interrupted (the hang of
issue 11: a deadlock once a member dies after the generation is sealed) and a member that seals
on its acknowledgement count instead of winning the outcome key (a disagreement).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from protocol_states import (
    DEAD_KIND,
    DEAD_ROW,
    ROUND,
    RUN,
    Codec,
    EncodedState,
    Meet,
    Node,
    Row,
    Run,
    StoreCode,
    arrived_key,
    canonical,
    forget,
    named,
    rename,
)

from schedcomp.runtime.fault.membership import View, admits_only
from schedcomp.runtime.fault.protocol import ABORTED, DONE, MET, Evicted, Meeting, Round, begin, meet_step, step
from schedcomp.runtime.fault.store import SEALED, Keys
from schedcomp.topology import Topology, Worker

# (new row and store, or None: it waits), whether it asked the detector, whether it wrote nothing and
# read only what cannot change
Step = tuple[tuple[Row, StoreCode] | None, bool, bool]


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


class Violation(AssertionError):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


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
            enabled = {0: got is not None}
            for noticed in _subsets(dead & ~seen):
                if noticed:
                    more = self.step(i, row, store, seen | noticed)[0]
                    enabled[noticed] = more is not None
                    if more is not None:
                        out.append((more[1], _put(rows, i, more[0])))
            for less, more in itertools.permutations(enabled, 2):
                if less & more == less and enabled[less] and not enabled[more]:
                    raise Violation("model", f"{self.workers[i]} noticing {self.codec.workers_of(more)} rather than "
                                             f"{self.codec.workers_of(less)} disables its step from "
                                             f"{self.codec.node(i, row)[0]}")
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
