"""The last resort: checkpoints while training, and a restart of the whole job when a stage is lost.

The end-to-end test launches the chaos job (pp = 4, dp = 2, 8 processes, CPU/gloo) with a
checkpoint every iteration; one worker dies (rollback and re-plan), then both replicas of stage 0
die at the same point: re-planning cannot go on, the launcher restarts every worker from the
latest complete checkpoint, and the job ends with exactly the fault-free model. The other tests
check the pieces in one process.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fault_procs import demo_stage, run_job, state_digest, train_demo
from resilient_procs import HERE, chaos_reference

from schedcomp.cache import PlanCache, precompile
from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.checkpoint import (
    MANIFEST,
    AsyncCheckpointer,
    checkpoint_dir,
    latest_complete,
    restore,
)
from schedcomp.runtime.fault.launch import Launcher
from schedcomp.runtime.fault.restart import (
    EXIT_RESTART,
    CheckpointPolicy,
    LastResort,
    RestartRequest,
    restart_requested,
)
from schedcomp.runtime.fault.store import Keys, StoreAddress, WorkerEnv, run_store, serve_store
from schedcomp.runtime.fault.transfer import StepSnapshot
from schedcomp.topology import Topology, Worker

PP, DP, MICROBATCHES, ITERATIONS = 4, 2, 4, 5
TOLERANCE = 1e-10

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")]


# ---- end to end -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_losing_a_whole_stage_restarts_the_job_from_its_checkpoint(tmp_path: Path) -> None:
    plans, ckpt = tmp_path / "plans", tmp_path / "ckpt"
    precompile(PP, DP, MICROBATCHES, 2, directory=plans, time_limit=1.0)
    cache = PlanCache.load(plans)
    # 1:1 dies right before its STEP of iteration 2, once stages 1-3 stepped it (`settle`): its
    # replica steps and checkpoints iteration 2 too. If stage 0 had not stepped 2 yet, the survivors
    # undo those steps and re-run 2 (their checkpoints of 2 stay: the re-run gives the same state);
    # otherwise they go on with 3. Then both replicas of stage 0 die right before their STEP of
    # iteration 3, once every other worker stepped it: stage 0's newest complete checkpoint is 2,
    # the others' is 3, and the highest commit is 3, so the restart resumes at 3 and loses exactly
    # one iteration, whichever way the first failure went.
    first = Worker(1, 1)
    degraded = cache.lookup([first])
    spec = ",".join([f"{first}@2.{len(cache.lookup([]).streams[first]) - 1}"]
                    + [f"{w}@3.{len(degraded.streams[w]) - 1}" for w in (Worker(0, 0), Worker(1, 0))])
    results, err = run_job(PP, DP, ["--max-restarts", "1"],
                           [str(HERE), "restart", str(ITERATIONS), str(plans), str(ckpt), spec, "replan", "1"], 240)
    assert "Traceback" not in err, err[-6000:]  # the survivors of run 0 left with one line each
    assert set(results) == {str(w) for w in Topology.of(PP, DP).workers}, err[-6000:]  # every worker, run 1

    reference = chaos_reference(PP, DP * MICROBATCHES, ITERATIONS)
    for r in results.values():
        stage = Worker.parse(r["worker"]).stage
        assert r["run"] == 1 and r["iterations"] == ITERATIONS
        previous = RestartRequest.from_json(r["previous"])
        assert previous.run == 0 and previous.reached == 3 and "stage 0" in previous.reason
        assert r["restored_from"] == 2 and r["iterations_lost"] == 1
        assert sorted(map(int, r["ledger"])) == [3, 4]  # run 1 trained the iterations after the checkpoint
        for name, value in reference[stage].items():
            diff = (torch.tensor(r["state"][name]) - torch.tensor(value)).abs().max().item()
            assert diff <= TOLERANCE, (r["worker"], name, diff)
    assert latest_complete(ckpt, PP) == ITERATIONS - 1  # and it kept checkpointing


# ---- the pieces -------------------------------------------------------------------------------------------


def test_each_run_sees_only_its_own_keys() -> None:
    server, address = serve_store()
    env = WorkerEnv(address, Worker(0, 1), 2, 1, 0, run=2)
    assert WorkerEnv.from_env(env.to_env()) == env  # the run travels through the environment
    env.store.connect().set(Keys.commit(env.worker), "7")
    assert server.check([f"run2/{Keys.commit(env.worker)}"])
    assert not server.check([Keys.commit(env.worker)])  # run 0 (bare names) never sees it
    assert run_store(server, 2).get(Keys.commit(env.worker)) == b"7"
    run0 = WorkerEnv(address, Worker(0, 1), 2, 1, 0)
    run0.store.connect().set("x", "1")
    assert server.check(["x"]) and str(run0.store) == str(env.store) == str(address)


_RESTARTING_WORKER = textwrap.dedent("""
    import sys, time
    from schedcomp.runtime.fault.restart import EXIT_RESTART, RestartRequest, request_restart
    from schedcomp.runtime.fault.store import Keys, WorkerEnv
    from schedcomp.topology import Worker
    env = WorkerEnv.from_env()
    store = env.store.connect()
    store.add("started", 1)
    if env.run == 0:
        if env.worker == Worker(0, 1):
            while store.add("started", 0) < 2:  # both are up: the launcher must stop the other one
                time.sleep(0.01)
            request_restart(store, RestartRequest("stage 1 lost", 6, env.run))
            sys.exit(EXIT_RESTART)
        store.wait(["never"])  # a survivor that does not leave by itself: the launcher stops it
    assert store.check([Keys.previous_run()])
""")


@pytest.mark.slow
def test_launcher_restarts_every_worker_in_a_fresh_namespace() -> None:
    launcher = Launcher([sys.executable, "-c", _RESTARTING_WORKER], pp=2, dp=1, respawn=1, max_restarts=2,
                        restart_grace=0.5, poll=0.01)
    assert launcher.run() == 0
    assert launcher.run_number == 1 and launcher.restarts_left == 1
    assert [s.incarnation for s in launcher.slots] == [0, 0]  # nobody was replaced: both restarted
    root = launcher.root
    assert root.add("started", 0) == 2 and root.add("run1/started", 0) == 2
    assert not root.check(["dead/0:1"])  # a worker leaving for a restart leaves no death notice
    previous = RestartRequest.from_json(root.get(f"run1/{Keys.previous_run()}"))
    assert previous == RestartRequest("stage 1 lost", 6, 0)
    assert restart_requested(launcher.store) is None  # run 1 asked for nothing


@pytest.mark.slow
def test_launcher_without_restarts_left_ends_the_job() -> None:
    survivor_leaves = 'store.wait([Keys.restart()]); sys.exit(1)'  # after the request: no replacement either
    launcher = Launcher([sys.executable, "-c", _RESTARTING_WORKER.replace('store.wait(["never"])', survivor_leaves)],
                        pp=2, dp=1, respawn=1, max_restarts=0, poll=0.01)
    assert launcher.run() == 1
    assert launcher.run_number == 0 and [s.incarnation for s in launcher.slots] == [0, 0]
    assert not launcher.store.check(["dead/0:0"]) and launcher.store.check([Keys.restart()])


def _session(address: StoreAddress, worker: Worker, pp: int = 2, dp: int = 1, run: int = 1) -> SimpleNamespace:
    env = WorkerEnv(address, worker, pp, dp, 0, run=run)
    view = SimpleNamespace(topology=Topology.of(pp, dp))
    return SimpleNamespace(env=env, me=worker, store=env.store.connect(), view=view)


def test_no_checkpoint_yet_starts_from_scratch_and_loses_every_iteration(tmp_path: Path) -> None:
    _server, address = serve_store()
    session = _session(address, Worker(0, 0))
    session.store.set(Keys.previous_run(), RestartRequest("stage 1 lost", 4, 0).to_json())
    module, optimizer = demo_stage(seed=0)
    before = state_digest(module, optimizer)
    resumed = LastResort(CheckpointPolicy(tmp_path), session).resume({0: (module, optimizer)}, stages=2)
    assert (resumed.restored_from, resumed.iterations_lost, resumed.start) == (None, 5, 0)
    assert state_digest(module, optimizer) == before


def test_every_worker_of_a_run_restores_the_same_checkpoint(tmp_path: Path) -> None:
    _server, address = serve_store()
    stages = [demo_stage(seed=s) for s in range(2)]
    for it in range(2):
        for s, (m, o) in enumerate(stages):
            train_demo(m, o, steps=1)
            AsyncCheckpointer(tmp_path, s, every=1).save(it, m, o).result()
    saved = [state_digest(m, o) for m, o in stages]
    first = _session(address, Worker(0, 0))
    first.store.set(Keys.previous_run(), RestartRequest("stage 1 lost", 3, 0).to_json())
    m0, o0 = demo_stage(seed=7)
    assert LastResort(CheckpointPolicy(tmp_path), first).resume({0: (m0, o0)}, stages=2).restored_from == 1
    assert state_digest(m0, o0) == saved[0]
    # A newer checkpoint completes meanwhile (an old worker on a slow host): this run keeps iteration 1.
    for s, (m, o) in enumerate(stages):
        AsyncCheckpointer(tmp_path, s, every=1).save(2, m, o).result()
    m1, o1 = demo_stage(seed=8)
    resumed = LastResort(CheckpointPolicy(tmp_path), _session(address, Worker(0, 1))).resume({1: (m1, o1)}, stages=2)
    assert (resumed.restored_from, resumed.iterations_lost, resumed.start) == (1, 2, 2)


class _Left(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _leave(code: int):
    raise _Left(code)


def test_giving_up_requests_a_restart_only_with_checkpoints(tmp_path: Path) -> None:
    _server, address = serve_store()
    session = _session(address, Worker(0, 1), run=0)
    session.store.set(Keys.commit(Worker(0, 0)), "4")  # a dead worker's record counts too
    session.store.set(Keys.commit(Worker(0, 1)), "3")
    with pytest.raises(_Left) as plain:
        LastResort(None, session, leave=_leave).give_up(RecoveryError("every worker of stage 0 has failed"))
    assert plain.value.code == 1 and restart_requested(session.store) is None
    with pytest.raises(_Left) as asked:
        LastResort(CheckpointPolicy(tmp_path), session, leave=_leave).give_up(
            RecoveryError("every worker of stage 0 has failed"))
    assert asked.value.code == EXIT_RESTART
    assert restart_requested(session.store) == RestartRequest("every worker of stage 0 has failed", 4, 0)


def test_checkpoint_policy_refuses_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(RecoveryError, match="at least 1"):
        CheckpointPolicy(tmp_path, every=0)
    with pytest.raises(RecoveryError, match="on_failure"):
        CheckpointPolicy(tmp_path, on_failure="pray")
    assert CheckpointPolicy(str(tmp_path)).directory == tmp_path


def test_a_checkpoint_of_an_undone_step_equals_the_redone_step_and_is_never_rewritten(tmp_path: Path) -> None:
    # Rollback: snapshot, step i, checkpoint i, undo (restore the snapshot), re-run step i on the
    # same gradients. The checkpoint written before the undo holds the re-done state exactly.
    module, optimizer = demo_stage(seed=0)
    train_demo(module, optimizer, steps=1)
    snapshot = StepSnapshot(module, optimizer)
    snapshot.take(1)
    train_demo(module, optimizer, steps=1)
    ckpt = AsyncCheckpointer(tmp_path, stage=0, every=1)
    ckpt.save(1, module, optimizer).result()
    written = (checkpoint_dir(tmp_path, 1, 0) / MANIFEST).stat().st_mtime_ns
    snapshot.restore()
    train_demo(module, optimizer, steps=1)  # the re-run
    redone = state_digest(module, optimizer)
    ckpt.save(1, module, optimizer).result()
    assert (checkpoint_dir(tmp_path, 1, 0) / MANIFEST).stat().st_mtime_ns == written  # not rewritten
    fresh, fresh_opt = demo_stage(seed=3)
    restore(tmp_path, 1, 0, fresh, fresh_opt)
    assert state_digest(fresh, fresh_opt) == redone
