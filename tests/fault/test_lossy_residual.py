"""Lossy forward's residuals (`runtime/fault/residual.py`), checked by executing them.

A token-level model of the runtime's semantics runs a plan's streams in a random interleaving
(sends post messages, a compute op waits for its own receive, ALLREDUCE is a collective over the
stage's workers after which each member steps at its own pace), stops at a random moment, kills
random workers, drops every message in flight (the broken generation's groups), computes the
residuals and runs them on the survivors. It must finish without deadlock, with every kept
micro-batch's F/B/W run exactly once per stage across before and after the failure, every kept
message consumed exactly once, nothing of a lost micro-batch run after the failure, and every
stage all-reducing among exactly its live replicas that had not stepped.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from schedcomp.compiler import compile
from schedcomp.errors import RecoveryError
from schedcomp.ir import InstrKind, Instruction, Plan
from schedcomp.runtime.fault.residual import Residual, lost_microbatches, residuals, skipped_chunks
from schedcomp.topology import Worker

RECV_OF = {InstrKind.SEND_ACT: InstrKind.RECV_ACT, InstrKind.SEND_GRAD: InstrKind.RECV_GRAD}
READS = {InstrKind.F: InstrKind.RECV_ACT, InstrKind.B: InstrKind.RECV_GRAD, InstrKind.BW: InstrKind.RECV_GRAD}


def _mb(ins: Instruction) -> tuple[int, int]:
    assert ins.op is not None
    return (ins.op.pipeline, ins.op.microbatch)


@dataclass
class Machine:
    """The streams being run, the messages in flight and what has been done."""

    streams: dict[Worker, tuple[Instruction, ...]]
    needs: frozenset[tuple]  # (worker, recv kind, microbatch): compute ops that read a received tensor
    pos: dict[Worker, int] = field(default_factory=dict)
    posted_recv: set[tuple] = field(default_factory=set)  # (receiver, kind, microbatch)
    arrived: Counter = field(default_factory=Counter)  # messages sent, not consumed: (receiver, recv kind, mb)
    computed: list[tuple] = field(default_factory=list)  # (worker, op kind, microbatch)
    consumed: list[tuple] = field(default_factory=list)
    reduced: set[Worker] = field(default_factory=set)  # passed its all-reduce, may still have to step
    reductions: list[tuple[int, frozenset[Worker]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pos = dict.fromkeys(self.streams, 0)

    def runnable(self, w: Worker) -> bool:
        if self.pos[w] >= len(self.streams[w]):
            return False
        ins = self.streams[w][self.pos[w]]
        if ins.kind in READS and (w, READS[ins.kind], _mb(ins)) in self.needs:
            key = (w, READS[ins.kind], _mb(ins))
            return key in self.posted_recv and self.arrived[key] > 0
        if ins.kind is InstrKind.ALLREDUCE:
            if w in self.reduced:
                return True
            group = [v for v in self.streams if v.stage == w.stage]
            return all(self.pos[v] < len(self.streams[v]) and self.streams[v][self.pos[v]].kind is InstrKind.ALLREDUCE
                       and v not in self.reduced for v in group)
        return True

    def advance(self, w: Worker) -> None:
        ins = self.streams[w][self.pos[w]]
        if ins.kind in RECV_OF:
            assert ins.peer is not None
            key = (ins.peer, RECV_OF[ins.kind], _mb(ins))
            self.arrived[key] += 1
            assert self.arrived[key] == 1, f"{key} sent twice"
        elif ins.kind in (InstrKind.RECV_ACT, InstrKind.RECV_GRAD):
            self.posted_recv.add((w, ins.kind, _mb(ins)))
        elif ins.kind in READS or ins.kind is InstrKind.W:
            if ins.kind in READS and (w, READS[ins.kind], _mb(ins)) in self.needs:
                key = (w, READS[ins.kind], _mb(ins))
                self.posted_recv.discard(key)
                self.arrived[key] -= 1
                self.consumed.append(key)
            assert ins.op is not None
            self.computed.append((w, ins.op.kind, _mb(ins)))
        elif ins.kind is InstrKind.ALLREDUCE and w not in self.reduced:
            group = frozenset(v for v in self.streams if v.stage == w.stage)
            self.reduced |= group  # the collective completed: each member goes on at its own pace
            self.reductions.append((w.stage, group))
            return  # this member has not passed it yet
        elif ins.kind is InstrKind.ALLREDUCE:
            self.pos[w] += 1  # and STEP right after: it has no wait a failure could interrupt
            if self.pos[w] < len(self.streams[w]) and self.streams[w][self.pos[w]].kind is InstrKind.STEP:
                self.pos[w] += 1
            return
        self.pos[w] += 1

    def run(self, rng: random.Random, steps: int | None = None) -> bool:
        """Advance random runnable workers `steps` times (None: to the end); False on deadlock."""
        n = 0
        while steps is None or n < steps:
            ready = [w for w in self.streams if self.runnable(w)]
            if not ready:
                return all(self.pos[w] >= len(s) for w, s in self.streams.items())
            self.advance(rng.choice(ready))
            n += 1
        return True


def _fail_and_finish(plan: Plan, rng: random.Random, cut: int, failed: list[Worker]) -> None:
    before = Machine(dict(plan.streams), _needs(plan))
    assert before.run(rng, cut)
    progress = {w: before.pos[w] for w in plan.workers if w not in failed}
    try:
        plans = residuals(plan, progress, failed)
    except RecoveryError:
        pytest.fail("a reachable state was refused")
    lost = lost_microbatches(plan, failed)
    after = _residual_machine(plans, _needs(plan))
    assert after.run(rng), "the residual deadlocked"
    assert not +after.arrived, f"sent and never consumed: {sorted(+after.arrived)}"
    # exactly once, per kept micro-batch and stage, across before and after (survivors only)
    kept_before = [c for c in before.computed if c[0] not in failed and c[2] not in lost]
    done = kept_before + after.computed
    expected = [(w, op.kind, (op.pipeline, op.microbatch)) for w in plan.workers if w not in failed
                for op in plan.compute_ops(w) if (op.pipeline, op.microbatch) not in lost]
    assert sorted(done) == sorted(expected)
    assert not any(c[2] in lost for c in after.computed)
    consumed = [c for c in before.consumed if c[0] not in failed and c[2] not in lost] + after.consumed
    assert len(consumed) == len(set(consumed))
    # each stage: replicas that stepped keep it; if none did, all live ones all-reduce again together;
    # if some did, the others take a stepped one's state (their old all-reduce cannot be redone)
    for s in range(plan.topology.pp):
        live = frozenset(w for w in plan.workers if w.stage == s and w not in failed)
        stepped = frozenset(w for w in live if progress[w] == len(plan.streams[w]))
        new = [g for stage, g in after.reductions if stage == s]
        if not stepped:
            assert new == [live] and all(plans[w].donor is None for w in live)
        else:
            assert not new
            assert all(plans[w].donor in stepped for w in live - stepped)
            assert all(plans[w].stepped for w in stepped)


def _needs(plan: Plan) -> frozenset[tuple]:
    return frozenset((w, i.kind, _mb(i)) for w, stream in plan.streams.items() for i in stream
                     if i.kind in (InstrKind.RECV_ACT, InstrKind.RECV_GRAD))


def _residual_machine(plans: dict[Worker, Residual], needs: frozenset[tuple]) -> Machine:
    """The residuals as streams: re-posted receives and re-sends first, then the rest."""
    streams = {w: (*r.repost, *r.resend, *r.rest) for w, r in plans.items()}
    return Machine(streams, needs)


CASES = [("1f1b", 4, 2, 4, ()), ("zb-h1", 4, 2, 4, ()), ("zb-h2", 3, 3, 6, ()),
         ("adaptive", 4, 2, 4, ((1, 2),)), ("adaptive", 3, 3, 3, ((0, 1),))]


@pytest.mark.parametrize(("family", "pp", "dp", "m", "already"), CASES)
def test_residuals_finish_every_kept_microbatch_exactly_once(family, pp, dp, m, already) -> None:
    plan = compile(pp, dp, m, schedule=family, failed=list(already))
    total = sum(len(s) for s in plan.streams.values())
    rng = random.Random(f"{family}{pp}{dp}")
    for _ in range(40):
        cut = rng.randrange(total + 1)
        live = list(plan.workers)
        failed = rng.sample(live, rng.choice([1, 1, 2]))
        if any(all(w in failed for w in plan.workers if w.stage == s) for s in range(pp)):
            continue  # a stage with no replica left: lossy cannot finish (restart from a checkpoint)
        _fail_and_finish(plan, rng, cut, failed)


def test_nothing_in_flight_nothing_to_resend() -> None:
    plan = compile(4, 2, 4, schedule="1f1b")
    victim = Worker(1, 2)
    progress = {w: 0 for w in plan.workers if w != victim}
    plans = residuals(plan, progress, [victim])
    lost = lost_microbatches(plan, [victim])
    assert lost == {(1, m) for m in range(4)}  # 1F1B runs every micro-batch on its home pipeline
    assert skipped_chunks(lost, 4) == (4, 5, 6, 7)
    for w, r in plans.items():
        assert not r.resend and not r.repost and r.donor is None
        assert r.rest == tuple(i for i in plan.streams[w] if i.op is None or _mb(i) not in lost)
    finished = {w: len(plan.streams[w]) for w in progress}
    assert all(not r.rest and not r.resend and not r.repost for r in residuals(plan, finished, [victim]).values())


def test_a_replica_behind_a_stepped_one_takes_its_state() -> None:
    plan = compile(2, 2, 2, schedule="1f1b")
    a, b, victim = Worker(0, 1), Worker(1, 1), Worker(1, 0)
    reduce_at = next(i for i, ins in enumerate(plan.streams[b]) if ins.kind is InstrKind.ALLREDUCE)
    progress = {Worker(0, 0): 0, a: len(plan.streams[a]), b: reduce_at}
    plans = residuals(plan, progress, [victim])
    assert plans[b].donor == a and plans[a].recipients == (b,) and plans[a].stepped and not plans[b].stepped
    assert all(i.kind not in (InstrKind.ALLREDUCE, InstrKind.STEP) for i in plans[b].rest)
    with pytest.raises(RecoveryError, match="rollback"):
        residuals(plan, {**progress, b: reduce_at - 1}, [victim])


def test_bad_progress_records_are_refused() -> None:
    plan = compile(2, 2, 2, schedule="1f1b")
    with pytest.raises(RecoveryError, match="no progress record"):
        residuals(plan, {Worker(0, 0): 0}, [Worker(1, 1)])
    progress = {w: 0 for w in plan.workers}
    progress[Worker(0, 1)] = 10_000
    with pytest.raises(RecoveryError, match="different plan"):
        residuals(plan, progress, [])
