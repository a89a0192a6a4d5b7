"""Agreement on one generation per failure, over a real TCPStore on loopback (workers are threads here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from schedcomp.runtime.fault.agreement import (
    AgreementTimeout,
    CommitLog,
    Evicted,
    admit,
    agree,
    agreed_switch,
    announce_join,
    counted_failed,
    join_job,
    latest_view,
    pending_joins,
    propose_switch,
)
from schedcomp.runtime.fault.better import agreed_better, offer_better
from schedcomp.runtime.fault.membership import FailureDetector, Heartbeat, View
from schedcomp.runtime.fault.store import Keys, StoreAddress, WorkerEnv, backoff, serve_store
from schedcomp.topology import Topology, Worker

pytestmark = pytest.mark.timeout(60)

DETECT = 1.0  # seconds without a heartbeat before a worker is declared failed


class Job:
    """A store and, per worker, a heartbeat and a detector (each with its own store clients)."""

    def __init__(self, pp: int, dp: int) -> None:
        self.server, self.address = serve_store()
        self.pp, self.dp = pp, dp
        self.beats: dict[Worker, Heartbeat] = {}
        self.detectors: dict[Worker, FailureDetector] = {}

    def start(self, w: Worker, incarnation: int = 0) -> None:
        self.beats[w] = Heartbeat(self.address, w, incarnation, interval=0.05).start()
        # fence=False: these workers share the test's process, which a fence would end (os._exit) whenever
        # a loaded machine delays a poll past DETECT; fencing has its own tests (test_fault_fence).
        self.detectors[w] = FailureDetector(self.address, w, detection_time=DETECT, poll=0.01,
                                            startup_time=2 * DETECT, fence=False).start()

    def start_all(self, workers: list[Worker]) -> None:
        for w in workers:
            self.start(w)

    def kill(self, w: Worker, notice: bool = True) -> None:
        """The worker stops; with `notice`, its launcher reports the death (as `launch` does)."""
        self.beats[w].stop()
        self.detectors[w].stop()
        if notice:
            self.server.set(Keys.dead(w), str(self.beats[w].incarnation))
            self.server.add(Keys.events(), 1)

    def close(self) -> None:
        for b in self.beats.values():
            b.stop()
        for d in self.detectors.values():
            d.stop()


@pytest.fixture
def job():
    jobs: list[Job] = []

    def make(pp: int, dp: int) -> Job:
        jobs.append(Job(pp, dp))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


def in_parallel(workers: list[Worker], fn: Callable[[Worker], object], timeout: float = 30.0) -> dict[Worker, object]:
    """Run fn(worker) for every worker at once, each on its own store client; results or exceptions."""
    with ThreadPoolExecutor(len(workers)) as pool:
        futures = {w: pool.submit(fn, w) for w in workers}
        out = {}
        for w, f in futures.items():
            try:
                out[w] = f.result(timeout=timeout)
            except Exception as e:
                out[w] = e
        return out


def _generation_zero(j: Job) -> tuple[list[Worker], View]:
    """Start every worker of `j` and agree on generation 0: the workers and the view."""
    workers = list(Topology.of(j.pp, j.dp).workers)
    j.start_all(workers)
    return workers, in_parallel(workers, lambda w: join_job(j.address.connect(), j.pp, j.dp, w,
                                                            j.detectors[w]))[workers[0]]


class _Announcing:
    """A replacement's store client that calls `then()` right after it announces `lost` (stages a race)."""

    def __init__(self, j: Job, lost: Worker, then: Callable[[], object]) -> None:
        self.inner, self.lost, self.then = j.address.connect(), lost, then

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def set(self, key: str, value: str) -> None:
        self.inner.set(key, value)
        if key == Keys.join(self.lost):
            self.then()


def test_view_round_trips_and_ranks_follow_plan_order() -> None:
    view = View(3, Topology.of(2, 3, [(1, 0)]))
    assert View.from_json(view.to_json()) == view
    assert view.members == (Worker(0, 0), Worker(0, 1), Worker(1, 1), Worker(2, 0), Worker(2, 1))
    assert [view.rank(w) for w in view.members] == list(range(5))
    assert view.next([Worker(1, 0), Worker(2, 1)]).generation == 4
    env = WorkerEnv(StoreAddress("127.0.0.1", 1234), Worker(1, 0), 2, 3, 2)
    assert WorkerEnv.from_env(env.to_env()) == env and env.rejoining


def test_everyone_agrees_on_generation_zero(job) -> None:
    j = job(2, 2)
    workers = list(Topology.of(2, 2).workers)
    j.start_all(workers)
    views = in_parallel(workers, lambda w: join_job(j.address.connect(), 2, 2, w, j.detectors[w]))
    assert set(views.values()) == {View(0, Topology.of(2, 2))}


def test_a_worker_that_never_starts_is_left_out(job) -> None:
    j = job(2, 2)
    absent = Worker(1, 0)
    present = [w for w in Topology.of(2, 2).workers if w != absent]
    j.start_all(present)
    views = in_parallel(present, lambda w: join_job(j.address.connect(), 2, 2, w, j.detectors[w]))
    assert len(set(views.values())) == 1
    view = views[present[0]]
    assert isinstance(view, View) and view.failed == {absent} and view.generation >= 1


def test_second_failure_during_agreement_moves_everyone_to_one_later_generation(job) -> None:
    j = job(2, 3)
    workers = list(Topology.of(2, 3).workers)
    j.start_all(workers)
    views = in_parallel(workers, lambda w: join_job(j.address.connect(), 2, 3, w, j.detectors[w]))
    v0 = views[workers[0]]
    first, second = Worker(0, 1), Worker(2, 0)
    j.kill(first)
    survivors = [w for w in workers if w not in (first, second)]
    second_done = threading.Event()

    def survivor(w: Worker) -> View:
        return agree(j.address.connect(), v0, w, j.detectors[w], timeout=20)

    def dies_while_agreeing(w: Worker) -> None:
        # It takes part in the first proposal (so that one cannot be sealed without it), then goes silent.
        store = j.address.connect()
        while not store.check([Keys.view(v0.generation + 1)]):
            j.detectors[w].signal.wait(0.005)
        j.kill(w, notice=False)  # hung, not reaped: only its heartbeat gives it away
        second_done.set()

    out = in_parallel([*survivors, second], lambda w: dies_while_agreeing(w) if w == second else survivor(w))
    assert second_done.is_set()
    views = {out[w] for w in survivors}
    assert len(views) == 1, out
    (view,) = views
    assert view.failed == {first, second}
    assert view.generation >= 2  # the first proposal still counted `second` as a member


def test_concurrent_failure_reports_still_give_one_view(job) -> None:
    j = job(4, 2)
    workers, v0 = _generation_zero(j)
    dead = [Worker(0, 3), Worker(1, 1)]
    for w in dead:
        j.kill(w)
    survivors = [w for w in workers if w not in dead]
    out = in_parallel(survivors, lambda w: agree(j.address.connect(), v0, w, j.detectors[w], timeout=20))
    assert len(set(out.values())) == 1, out
    assert out[survivors[0]].failed == set(dead)


def test_falsely_suspected_worker_is_evicted(job) -> None:
    j = job(2, 2)
    workers, v0 = _generation_zero(j)
    suspect = Worker(1, 1)
    j.detectors[Worker(0, 0)].declare_failed(suspect, "an operation with it timed out")
    others = [w for w in workers if w != suspect]
    # The survivors agree without it; only then does the suspect try, and learns it was evicted.
    out = in_parallel(others, lambda w: agree(j.address.connect(), v0, w, j.detectors[w], timeout=20))
    assert {v.failed for v in out.values()} == {frozenset({suspect})}
    with pytest.raises(Evicted):
        agree(j.address.connect(), v0, suspect, j.detectors[suspect], timeout=5)


def test_agreement_times_out_when_the_store_never_answers(job) -> None:
    j = job(1, 2)
    me = Worker(0, 0)
    j.start(me)
    with pytest.raises(AgreementTimeout):  # a replacement waiting for a generation nobody proposes
        agree(j.address.connect(), View.initial(1, 2), me, j.detectors[me], propose=False, timeout=0.3)


def _lose_one(j: Job) -> tuple[list[Worker], Worker, View]:
    """A pp = 2, dp = 2 job that lost worker 0:1: its workers, the lost one, and the survivors' generation."""
    workers, v0 = _generation_zero(j)
    lost = Worker(0, 1)
    j.kill(lost)
    survivors = [w for w in workers if w != lost]
    v1 = in_parallel(survivors, lambda w: agree(j.address.connect(), v0, w, j.detectors[w], timeout=20))[survivors[0]]
    return workers, lost, v1


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
def test_replacement_is_admitted_at_the_agreed_switch(job) -> None:
    j = job(2, 2)
    workers, lost, v1 = _lose_one(j)
    assert v1.failed == {lost}
    store = j.address.connect()
    assert pending_joins(store, v1) == frozenset()

    j.start(lost, incarnation=1)  # the launcher started a replacement
    announce_join(store, lost, 1)
    assert pending_joins(store, v1) == {lost}
    assert latest_view(store) == v1
    # Two survivors reach different boundaries; the first proposal wins for everyone.
    first = propose_switch(store, v1, iteration=7, joiners=[lost])
    second = propose_switch(j.address.connect(), v1, iteration=9, joiners=[lost])
    assert first == second == agreed_switch(store, v1) and first.iteration == 7

    def member(w: Worker) -> View:
        if w == lost:
            return agree(j.address.connect(), v1, w, j.detectors[w], propose=False, timeout=20)
        return agree(j.address.connect(), v1, w, j.detectors[w], joiners=first.joiners, timeout=20)

    out = in_parallel(workers, member)
    assert set(out.values()) == {View(v1.generation + 1, Topology.of(2, 2))}, out


def test_a_replacement_admitted_as_soon_as_it_announces_itself_is_not_left_waiting(job) -> None:
    # The survivors may propose the view that admits a replacement before the replacement reads the
    # newest view (a lost stage: they have nothing else to do). Read after announcing, the replacement
    # took that view as known, waited for the next generation, and the admitting one waited for its
    # acknowledgement: both until the agreement timeout (seen in CI, test_fault_swift).
    j = job(2, 2)
    workers, lost, v1 = _lose_one(j)
    j.start(lost, incarnation=1)
    survivors_store = j.address.connect()

    def member(w: Worker) -> View:
        if w == lost:
            eager = _Announcing(j, lost, lambda: survivors_store.compare_set(
                Keys.view(v1.generation + 1), "", v1.next(frozenset()).to_json()))  # the survivors propose at once
            return admit(eager, w, 1, counted_failed(j.address.connect(), w, timeout=20), j.detectors[w],
                         timeout=20)[0]
        store = j.address.connect()
        while lost not in pending_joins(store, v1):  # survivors admit only a replacement that announced itself
            time.sleep(0.01)
        return agree(store, v1, w, j.detectors[w], joiners=[lost], timeout=20)

    out = in_parallel(workers, member)
    assert set(out.values()) == {View(v1.generation + 1, Topology.of(2, 2))}, out


@pytest.mark.slow  # a second of waiting, then two agreements: make test-fast leaves it to make test
def test_a_replacement_never_acknowledges_a_view_that_still_counts_its_predecessor(job) -> None:
    # A survivor that only saw a broken connection proposes the next view with no one failed, and
    # the survivors may all acknowledge it before the death notice reaches their detectors. A
    # replacement started within a fraction of a second (a preloaded zygote) that knew only the
    # view before and acknowledged that one in its predecessor's place sealed it: everyone went on
    # in a view that took the replacement for its predecessor, and it was never handed a state
    # (seen in CI, test_fault_swift dp = 1: a restart where replay was due).
    j = job(2, 2)
    workers, v0 = _generation_zero(j)
    lost = Worker(0, 1)
    survivors = [w for w in workers if w != lost]
    j.kill(lost, notice=False)  # its notice comes below: the survivors' detectors read it only then
    store = j.address.connect()
    stale = v0.next(frozenset())  # what the survivor that saw only a broken connection proposed
    announced = threading.Event()

    def member(w: Worker) -> View:
        if w == lost:  # as `FaultSession.start`: no heartbeat, no incarnation before counted failed
            known = counted_failed(j.address.connect(), w, timeout=20)
            j.start(w, incarnation=1)
            return admit(_Announcing(j, lost, announced.set), w, 1, known, j.detectors[w], timeout=20)[0]
        announced.wait(1.0)  # the replacement may announce itself first (it did before the fix)
        s = j.address.connect()
        if w == survivors[0]:
            s.compare_set(Keys.view(stale.generation), "", stale.to_json())
        while not s.check([Keys.view(stale.generation)]):
            time.sleep(0.01)
        view = agree(s, v0, w, j.detectors[w], timeout=20)
        while lost in view.failed and lost not in pending_joins(s, view):
            time.sleep(0.01)
        return agree(s, view, w, j.detectors[w], joiners=[lost], timeout=20) if lost in view.failed else view

    def notice() -> None:  # the launcher's death notice, read once the survivors acknowledged the stale view
        while store.add(Keys.ack(stale.generation), 0) < len(survivors) and \
                not store.check([Keys.view(stale.generation + 1)]):
            time.sleep(0.01)
        store.set(Keys.dead(lost), "0")
        store.add(Keys.events(), 1)

    notifier = threading.Thread(target=notice, daemon=True)
    notifier.start()
    out = in_parallel(workers, member)
    # The stale view (generation 1) is superseded by one that counts the predecessor failed
    # (generation 2), and the next one admits the replacement.
    assert set(out.values()) == {View(stale.generation + 2, Topology.of(2, 2))}, out


def test_polls_back_off_doubling_up_to_their_most_and_stay_there() -> None:
    delays = backoff(0.002, 0.02)
    assert [next(delays) for _ in range(7)] == [0.002, 0.004, 0.008, 0.016, 0.02, 0.02, 0.02]


def test_commit_log_reads_back_each_workers_last_step(job) -> None:
    j = job(2, 1)
    log = CommitLog(j.address.connect())
    a, b = Worker(0, 0), Worker(0, 1)
    log.record(a, 4)
    assert log.read([a, b]) == {a: 4, b: -1}


def test_a_better_plan_is_switched_to_at_one_boundary_once_every_member_holds_it() -> None:
    _server, address = serve_store()  # (kept: the store lives as long as its server object)
    view = View(3, Topology.of(2, 2, [Worker(1, 1)]))  # three members
    a, b, c = (address.connect() for _ in range(3))
    assert offer_better(a, view, "digest-x") and offer_better(b, view, "digest-x")
    assert agreed_better(a, view, completed=7, lead=2) is None  # c does not hold it yet
    assert offer_better(c, view, "digest-x")
    assert agreed_better(b, view, completed=8, lead=2) == 11  # the first to see all fixes it (8 + lead + 1)
    assert agreed_better(a, view, completed=9, lead=2) == 11 and agreed_better(c, view, completed=10, lead=2) == 11
    later = View(4, view.topology)  # a new generation starts over: its keys are its own
    assert agreed_better(a, later, completed=12, lead=2) is None


def test_members_holding_different_better_plans_never_switch() -> None:
    _server, address = serve_store()  # (kept: the store lives as long as its server object)
    view = View(1, Topology.of(2, 2, [Worker(0, 0)]))
    a, b, c = (address.connect() for _ in range(3))
    assert offer_better(a, view, "one") and offer_better(b, view, "one")
    assert not offer_better(c, view, "two")
    for store in (a, b, c):
        assert agreed_better(store, view, completed=5, lead=2) is None


def test_nobody_switches_while_a_member_has_no_better_plan() -> None:
    """A member whose compile failed or did no better never offers: the others wait for it forever."""
    _server, address = serve_store()  # (kept: the store lives as long as its server object)
    view = View(2, Topology.of(2, 2, [Worker(1, 0)]))
    a, b = address.connect(), address.connect()
    assert offer_better(a, view, "x") and offer_better(b, view, "x")
    assert all(agreed_better(a, view, completed=i, lead=2) is None for i in range(5, 40))


def test_a_worker_past_the_agreed_boundary_breaks_the_generation_rather_than_run_another_plan() -> None:
    from schedcomp.compiler import compile
    from schedcomp.runtime.fault.better import BetterPlan
    from schedcomp.runtime.fault.membership import GenerationAborted

    _server, address = serve_store()  # (kept: the store lives as long as its server object)
    topology = Topology.of(2, 2, [Worker(1, 0)])
    view, plan = View(2, topology), compile(2, 2, 4, failed=[Worker(1, 0)], schedule="adaptive")
    workers = [BetterPlan(lambda t: plan, address.connect(), lead=2) for _ in view.members]
    assert workers[0].due(view, completed=3) is None and workers[1].due(view, completed=3) is None
    assert workers[2].due(view, completed=4) is None  # the last to offer fixes 4 + 2 + 1 = 7
    assert workers[0].due(view, completed=6) is plan  # due from iteration 7
    assert workers[0].due(view, completed=7) is None  # once
    with pytest.raises(GenerationAborted, match="due from iteration 7, but this worker is at 9"):
        workers[1].due(view, completed=8)  # (cannot happen with lead 2; if it did, no one must hang)
