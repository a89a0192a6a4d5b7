"""Survivors detect a dead or hung worker, agree on one generation and regroup over gloo (real processes)."""

from __future__ import annotations

import pytest
from fault_procs import children, result, start, wait_count

from schedcomp.runtime.fault.store import Keys, WorkerEnv, serve_store
from schedcomp.topology import Topology, Worker

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _run(victim: Worker, *, stall: bool, notice: bool) -> list[dict]:
    pp, dp = 2, 2
    server, address = serve_store()
    workers = Topology.of(pp, dp).workers
    with children() as procs:
        for w in workers:
            env = WorkerEnv(address, w, pp, dp, 0).to_env()
            procs.append(start(env, "regroup", str(victim), "1" if stall else "0"))
        wait_count(server, "ready", len(workers))
        server.set("go", "1")
        doomed = procs[workers.index(victim)]
        if notice:  # what the launcher does when it reaps a worker
            doomed.wait(timeout=60)
            server.set(Keys.dead(victim), "0")
            server.add(Keys.events(), 1)
        else:  # fencing, as the launcher does once the survivors agreed that the worker failed
            wait_count(server, "agreed", len(workers) - 1)
            doomed.kill()
        return [result(p) for w, p in zip(workers, procs, strict=True) if w != victim]


def _check(results: list[dict], victim: Worker) -> None:
    values = {w: float(2**i) for i, w in enumerate(Topology.of(2, 2).workers)}
    survivors = [w for w in values if w != victim]
    assert {r["worker"] for r in results} == {str(w) for w in survivors}
    # one generation, one failed set, on every survivor
    assert len({r["generation"] for r in results}) == 1 and results[0]["generation"] >= 1
    assert all(r["failed"] == [str(victim)] for r in results)
    assert sorted(r["rank"] for r in results) == list(range(len(survivors)))
    for r in results:
        assert r["first"]["world_sum"] == sum(values.values())
        assert r["second"]["world_sum"] == sum(values[w] for w in survivors)
        assert r["second"]["backend"] == "gloo"
        assert r["second"]["ring_from"] == (r["rank"] - 1) % len(survivors)
        me = Worker.parse(r["worker"])
        stage_mates = [w for w in survivors if w.stage == me.stage]
        if len(stage_mates) > 1:
            assert r["second"]["stage_sum"] == sum(values[w] for w in stage_mates)
        else:
            assert "stage_sum" not in r["second"]


def test_sigkill_with_death_notice_regroups_survivors() -> None:
    victim = Worker(1, 1)
    _check(_run(victim, stall=False, notice=True), victim)


def test_hung_worker_is_detected_by_heartbeats() -> None:
    victim = Worker(0, 1)  # stopped, not dead: only its silent heartbeat gives it away
    _check(_run(victim, stall=True, notice=False), victim)
