"""Several hosts without several machines: one job across three network namespaces (`netns_hosts`).

pp = 2, dp = 3: host h runs both stages of pipeline h under its own launcher, host 0 serves the
store. The workers train the chaos-test model (`resilient_procs.py`) and stop at the start of
iteration GATE until the harness has done its damage:
- a whole host lost: host 2 is cut off and every one of its processes killed (launcher included:
  no death notice; cut first, so not even a connection reset reaches the others). The survivors
  see it by heartbeats only, and end equal to the fault-free reference trained in this process.
- a partition: host 2 is cut off while its processes live on. Its workers fence themselves (exit
  75 with the reason on stderr) and so does its launcher; the majority goes on. Then the cut heals
  while the majority still trains, and a worker of host 2 that comes back from before the cut
  finds itself in the failed set (`Evicted`): nothing rejoins silently, nothing corrupts the
  survivors, who again end equal to the reference.
"""

from __future__ import annotations

import pytest
from hosts_job import HostJob
from netns_hosts import Hosts, unavailable
from resilient_procs import assert_matches_reference, chaos_reference

from schedcomp.cache import precompile

PP, DP, MICROBATCHES, ITERATIONS = 2, 3, 2, 6
GATE, HEALED = 2, 4  # the damage is done at the start of GATE; the partition heals before HEALED starts
DETECTION = 6.0  # seconds: the heartbeat timeout, and how long a cut-off worker waits before it fences itself
LOST = 2  # the host that is lost or cut off (pipeline 2)

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("plans")
    precompile(PP, DP, MICROBATCHES, PP, directory=directory, time_limit=1.0)  # up to a whole pipeline lost
    return str(directory)


@pytest.fixture(scope="module")
def reference() -> list[dict]:
    return chaos_reference(PP, DP * MICROBATCHES, ITERATIONS)


@pytest.fixture
def hosts():
    why = unavailable()  # checked here, not at collection: `make test-fast` never makes a namespace
    if why is not None:
        pytest.skip(f"network namespaces unavailable: {why}")
    made = Hosts(DP)
    yield made
    made.close()  # kills whatever is left in the namespaces, even after a failure


@pytest.fixture
def job(hosts, cache_dir):
    jobs: list[HostJob] = []

    def make(**kwargs) -> HostJob:
        jobs.append(HostJob(hosts, PP, DP, ITERATIONS, cache_dir, detection=DETECTION, **kwargs))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


SURVIVORS = {f"{d}:{s}" for d in range(DP) if d != LOST for s in range(PP)}
LOST_WORKERS = sorted(f"{LOST}:{s}" for s in range(PP))


def survivors_finish(job: HostJob, reference: list[dict]) -> dict[str, dict]:
    results = {}
    for h in range(DP):
        if h == LOST:
            continue
        code, got, err = job.finish(h, timeout=300)
        assert code == 0, err[-6000:]
        results.update(got)
    assert_matches_reference(results, reference, SURVIVORS, ITERATIONS, DP * MICROBATCHES)
    for r in results.values():
        assert r["failed"] == LOST_WORKERS, r["failed"]  # nobody came back
        # the lost workers are declared together, or one heartbeat check apart (a second round)
        reruns = [rec["rerun"] for rec in r["recoveries"]]
        assert reruns[0] == GATE and len(reruns) <= 2 and all(i >= GATE for i in reruns), r["recoveries"]
    return results


def test_a_whole_host_lost_is_seen_by_heartbeats_and_the_rest_train_on(hosts, job, reference) -> None:
    j = job(gates=[GATE])
    j.wait_count(f"at_gate/{GATE}", PP * DP)
    hosts.cut(LOST)  # first, so that no FIN or RST of the dying processes reaches the others
    assert hosts.kill_all(LOST) >= 1 + PP  # its launcher and its workers
    j.ask("stamp", "killed_at")
    j.ask("set", f"gate/{GATE}")
    survivors_finish(j, reference)
    assert hosts.pids(LOST) == []


def test_a_cut_off_host_fences_itself_and_stays_out_after_the_cut_heals(hosts, job, reference) -> None:
    j = job(gates=[GATE, HEALED])
    j.wait_count(f"at_gate/{GATE}", PP * DP)
    hosts.cut(LOST)
    j.ask("stamp", "killed_at")
    j.ask("set", f"gate/{GATE}")
    # the minority: every worker and the launcher stop by themselves (the test's own timeout is the bound)
    code, results, err = j.finish(LOST, timeout=120)
    assert code == 75 and results == {}, err[-6000:]
    for w in LOST_WORKERS:
        assert f"worker {w}: no answer from the job's store" in err, err[-6000:]
    assert "this host is cut off from the job: stopping its workers" in err, err[-6000:]
    assert hosts.pids(LOST) == []
    # the majority went on without it: the survivors reach the next gate, then the cut heals
    j.wait_count(f"at_gate/{HEALED}", PP * (DP - 1))
    hosts.heal(LOST)
    stale = j.stale(LOST, LOST_WORKERS[0], generation=0)  # it ran generation 0 when the cut came
    assert stale["evicted"] is not None and stale["joined"] is None, stale
    assert f"worker {LOST_WORKERS[0]} was declared failed" in stale["evicted"]
    j.ask("set", f"gate/{HEALED}")
    survivors_finish(j, reference)
