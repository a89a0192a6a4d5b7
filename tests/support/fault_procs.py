"""Worker processes for the fault-tolerance tests, and the parent-side helpers that start and reap them.

Run as `python tests/support/fault_procs.py SCENARIO [ARGS...]` with the launcher's environment
(`WorkerEnv.to_env()`); each scenario prints one JSON line with what it observed, which the
test asserts on. Every child has its own deadline (`faulthandler`), and the parent kills every
child it started when the test ends, so a hang fails a test instead of blocking the suite.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve()
CHILD_DEADLINE = 100.0  # seconds; a child that runs longer dumps its stacks and exits
# Set by `run_job` for the processes of its job: when the job's own timeout runs out (epoch seconds).
JOB_DEADLINE = "SCHEDCOMP_TEST_JOB_DEADLINE"
DUMP_MARGIN = 5.0  # a child dumps its stacks this long before its job's timeout, while the launcher still reads them


def child_deadline() -> float:
    """Seconds this child may run before it dumps its stacks and exits: until just before its job's
    timeout (`run_job`), so that the test's one budget decides, or CHILD_DEADLINE for a child that
    is not part of such a job. (A deadline shorter than the job's killed workers that were merely
    slow: on a machine at load 25-30 a replacement took a minute to import torch.)"""
    at = os.environ.get(JOB_DEADLINE)
    return CHILD_DEADLINE if at is None else max(1.0, float(at) - DUMP_MARGIN - time.time())


# ---- parent side -------------------------------------------------------------------------------


@contextmanager
def children() -> Iterator[list[subprocess.Popen]]:
    """A list to put started processes in; every one still running at the end is killed."""
    procs: list[subprocess.Popen] = []
    failed = True
    try:
        yield procs
        failed = False
    finally:
        running = [p for p in procs if p.poll() is None]
        if failed and running:  # ask for their stacks first: where a child hangs is what a failure needs
            for p in running:
                p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        for p in running:
            p.kill()
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                continue
            if failed:  # pytest shows this with the failure
                print(f"--- child {i} exited {p.returncode}\n{out}\n{err[-3000:]}")


def start(env_vars: dict[str, str], scenario: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, **env_vars, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(HERE), scenario, *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_count(store, key: str, count: int, timeout: float = 90.0) -> None:
    """Wait until the counter `key` reaches `count` (a worker bumps it when it gets somewhere)."""
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{key} stayed at {store.add(key, 0)} of {count}")
        time.sleep(0.01)


PRELOAD = ["--preload", "torch,schedcomp.runtime"]  # workers forked with torch imported: ~2 s of CPU less each


def run_job(pp: int, dp: int, launcher_args: Sequence[str], worker_args: Sequence[str],
            timeout: float, preload: bool = True) -> tuple[dict[str, dict], str]:
    """Run a job under `python -m schedcomp.runtime.fault.launch`; returns each worker's JSON line
    (by worker: a later line, a replacement's or a later run's, wins) and the job's stderr.

    Workers are forked from a process that imported torch (`--preload`, see `fault.zygote`) unless
    `preload` is False (a fresh interpreter each, as without the option).
    Fails the test when the launcher exits non-zero or the job outlives `timeout` (then with the
    stacks the workers dump just before it, `child_deadline`).
    """
    cmd = [sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", str(pp), "--dp", str(dp),
           *launcher_args, *(PRELOAD if preload else []), "--", sys.executable, *worker_args]
    env = {**os.environ, JOB_DEADLINE: f"{time.time() + timeout:.3f}"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"the job did not finish in {timeout} s:\n{err[-12000:]}") from None
    assert proc.returncode == 0, err[-6000:]
    results = {r["worker"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    return results, err


def result(proc: subprocess.Popen, timeout: float = 100.0) -> dict:
    """The JSON line a child printed (fails with its stderr when it printed none)."""
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"child exited {proc.returncode} without a result:\n{out}\n{err[-4000:]}")
    return json.loads(lines[-1])


# ---- child side --------------------------------------------------------------------------------


def emit(obj: dict) -> None:
    """Print one JSON line with a single write: children sharing a pipe must not interleave."""
    os.write(1, (json.dumps(obj) + "\n").encode())


def setup_logging() -> None:
    import logging

    worker = os.environ.get("SCHEDCOMP_WORKER")
    logging.basicConfig(level=os.environ.get("FAULT_LOG", "WARNING"),
                        format=f"%(asctime)s {worker} %(name)s %(message)s")


# A heartbeat timeout that holds on a loaded 2-core CI box running two jobs at once (`make test`): at 2 s a
# worker once found the store silent for 2.4-3.7 s there and fenced itself. Deaths are seen at once
# through death notices anyway; only a hung worker waits this out.
DETECTION = 6.0


def _setup(detection_time: float = DETECTION):
    import torch

    from schedcomp.runtime.fault.membership import FailureDetector, Heartbeat
    from schedcomp.runtime.fault.store import WorkerEnv

    setup_logging()
    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    store = env.store.connect()
    beat = Heartbeat(env.store, env.worker, env.incarnation, interval=0.1).start()
    detector = FailureDetector(env.store, env.worker, detection_time=detection_time, poll=0.02).start()
    return env, store, beat, detector


def _check_groups(groups, values: Sequence[float]) -> dict:
    """Collectives and p2p on a generation's groups; returns what each saw."""
    import torch
    import torch.distributed as dist

    view, me = groups.view, groups.generation.me
    x = torch.tensor([values[view.topology.rank(me)]], dtype=torch.float64)
    dist.all_reduce(x, group=groups.world)
    out = {"world_sum": x.item(), "backend": str(dist.get_backend(groups.world))}
    if groups.stage is not None:
        y = torch.tensor([values[view.topology.rank(me)]], dtype=torch.float64)
        dist.all_reduce(y, group=groups.stage)
        out["stage_sum"] = y.item()
    # a ring over the generation's ranks, with generation ranks as dst/src and batched
    n, r = groups.generation.size, groups.rank
    if n > 1:
        send = torch.tensor([float(r)])
        recv = torch.zeros(1)
        ops = [dist.P2POp(dist.isend, send, (r + 1) % n, group=groups.world),
               dist.P2POp(dist.irecv, recv, (r - 1) % n, group=groups.world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        out["ring_from"] = recv.item()
    return out


def scenario_regroup(victim: str, stall: str) -> None:
    """Survivors of a SIGKILL (or a SIGSTOP when `stall`) regroup and all-reduce correctly."""
    import torch
    import torch.distributed as dist

    from schedcomp.runtime.fault.agreement import agree, join_job
    from schedcomp.runtime.fault.groups import Graveyard, regroup
    from schedcomp.runtime.fault.membership import GenerationAborted, wait_work
    from schedcomp.topology import Worker

    env, store, _beat, detector = _setup()
    me, doomed = env.worker, Worker.parse(victim)
    view = join_job(store, env.pp, env.dp, me, detector)
    groups = regroup(store, view, me, timeout=20.0)
    values = [float(2**i) for i in range(env.pp * env.dp)]  # sums identify who took part
    first = _check_groups(groups, values)
    store.add("ready", 1)
    store.wait(["go"])
    if me == doomed:
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP if stall == "1" else signal.SIGKILL)
        time.sleep(60)  # only reached if resumed: a stalled worker never gets here in the test
    x = torch.ones(1)
    try:
        while True:  # training stand-in: collectives until the generation breaks
            wait_work(dist.all_reduce(x, group=groups.world, async_op=True), detector.signal)
    except (GenerationAborted, RuntimeError) as e:
        detector.report(None, e)
    broken = time.time()
    graveyard = Graveyard()
    groups.close(graveyard)  # a stalled peer may still hold an all-reduce of this generation open
    view = agree(store, view, me, detector, timeout=30.0)
    agreed = time.time()
    store.add("agreed", 1)
    groups = regroup(store, view, me)
    second = _check_groups(groups, values)
    regrouped = time.time()
    killed = float(store.get("killed_at"))
    emit({"worker": str(me), "generation": view.generation, "failed": sorted(map(str, view.failed)),
          "first": first, "second": second, "rank": groups.rank,
          "broken_after": broken - killed, "agreed_after": agreed - killed, "regroup_seconds": regrouped - agreed})
    groups.close()
    # The graveyard still holds generation 0, whose all-reduce a stalled peer keeps open, and the waiter
    # thread of that all-reduce is blocked inside gloo until the group timeout: an interpreter exit now
    # destroys the group under it ("terminate called without an active exception", exit -6, seen once
    # under load). `FaultSession.close` waits them out; this bare scenario leaves at once, as the donor does.
    os._exit(0)


def scenario_die_before_groups(victim: str, arrive: str) -> None:
    """A member dies after generation 0 is sealed, before its groups exist (`arrive` = "1": after the
    store meeting, so the others are inside gloo's group construction when it dies). The others
    must give up on that generation at once and regroup without it, with a group timeout far
    longer than the test's."""
    from schedcomp.runtime.fault.agreement import agree, join_job
    from schedcomp.runtime.fault.groups import Abort, Graveyard, regroup
    from schedcomp.runtime.fault.membership import GenerationAborted
    from schedcomp.runtime.fault.protocol import meet
    from schedcomp.topology import Worker

    env, store, _beat, detector = _setup(detection_time=30.0)  # only the death notice can tell
    me, doomed = env.worker, Worker.parse(victim)
    view = join_job(store, env.pp, env.dp, me, detector)
    if me == doomed:
        if arrive == "1":
            store.add(f"gen{view.generation}/arrived", 1)
        os.kill(os.getpid(), signal.SIGKILL)
    graveyard, aborted = Graveyard(), None

    def enter(view):
        meet(store, f"gen{view.generation}/arrived", len(view.members), detector.signal)
        return regroup(store, view, me, timeout=600.0, abort=Abort(env.store.connect, detector.signal),
                       graveyard=graveyard)

    try:
        enter(view)
    except GenerationAborted as e:
        aborted = str(e)
    view = agree(store, view, me, detector, timeout=60.0)
    groups = enter(view)
    values = [float(2**i) for i in range(env.pp * env.dp)]
    emit({"worker": str(me), "aborted": aborted, "generation": view.generation,
          "failed": sorted(map(str, view.failed)), "second": _check_groups(groups, values), "rank": groups.rank})
    groups.close()


def scenario_stalled_recipient() -> None:
    """Replica transfer to a recipient that hangs (SIGSTOP) before receiving: the donor, waiting
    abortably, gives up once heartbeats declare the recipient failed (group timeout: 600 s)."""
    import torch
    from torch import nn

    from schedcomp.runtime.fault.agreement import join_job
    from schedcomp.runtime.fault.groups import Abort, regroup
    from schedcomp.runtime.fault.membership import GenerationAborted, wait_abortable
    from schedcomp.runtime.fault.transfer import send_stage_state
    from schedcomp.topology import Worker

    env, store, _beat, detector = _setup()
    me = env.worker
    view = join_job(store, env.pp, env.dp, me, detector)
    groups = regroup(store, view, me, timeout=600.0, abort=Abort(env.store.connect, detector.signal))
    if me != Worker(0, 0):
        store.add("ready", 1)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(600)
    store.wait(["ready"])
    module = nn.Linear(4096, 4096, dtype=torch.float64)  # 128 MiB: more than the sockets buffer
    try:
        send_stage_state(module, None, groups.world, [groups.rank_of(Worker(1, 0))],
                         wait=lambda work: wait_abortable(work, detector.signal))
        aborted = None
    except GenerationAborted as e:
        aborted = str(e)
    emit({"worker": str(me), "aborted": aborted, "failed": sorted(map(str, detector.failed()))})
    os._exit(0)  # a waiter thread is still blocked in gloo on the stopped peer


def demo_stage(seed: int):
    """A stage with every kind of state: float64 and bf16 parameters, int and bool buffers, Adam state."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double()
    module[2].to(torch.bfloat16)
    module.register_buffer("mask", torch.rand(4) > 0.5)
    return module, torch.optim.Adam(module.parameters(), lr=0.01, betas=(0.8, 0.9))


def train_demo(module, optimizer, steps: int) -> None:
    import torch

    for i in range(steps):
        x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        out = module[2](module[1](module[0](x)).to(torch.bfloat16))
        optimizer.zero_grad()
        out.float().square().mean().backward()
        optimizer.step()


def state_digest(module, optimizer) -> str:
    import hashlib

    import torch

    from schedcomp.runtime.fault.transfer import encode_header, flatten, stage_state, to_bytes

    skeleton, tensors = flatten(stage_state(module, optimizer))
    return hashlib.sha256(encode_header(skeleton, tensors) + to_bytes(tensors, torch.device("cpu")).numpy().tobytes()
                          ).hexdigest()


def scenario_transfer() -> None:
    """Replica recovery: worker 0:0 trains, then sends its stage state to a fresh replacement 1:0."""
    import torch

    from schedcomp.runtime.fault.groups import regroup
    from schedcomp.runtime.fault.membership import View
    from schedcomp.runtime.fault.store import WorkerEnv
    from schedcomp.runtime.fault.transfer import recv_stage_state, send_stage_state
    from schedcomp.topology import Worker

    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    store = env.store.connect()
    view = View(3, View.initial(env.pp, env.dp).topology)
    groups = regroup(store, view, env.worker, timeout=30.0)
    donor = env.worker.pipeline == 0
    module, optimizer = demo_stage(seed=1 if donor else 2)  # the replacement starts from other values
    if donor:
        train_demo(module, optimizer, steps=3)
    before = state_digest(module, optimizer)
    started = time.perf_counter()
    if donor:
        nbytes = send_stage_state(module, optimizer, groups.world, [groups.rank_of(Worker(1, 0))], info={"it": 3})
    else:
        got = recv_stage_state(module, optimizer, groups.world, src=groups.rank_of(Worker(0, 0)))
        nbytes = got.nbytes if got.info == {"it": 3} else -1
    seconds = time.perf_counter() - started
    after = state_digest(module, optimizer)
    train_demo(module, optimizer, steps=2)  # both go on training identically
    emit({"worker": str(env.worker), "before": before, "after": after, "bytes": nbytes,
          "seconds": seconds, "trained": state_digest(module, optimizer)})
    groups.close()


def scenario_train(iterations: str, victim: str, kill_at: str, hold_at: str) -> None:
    """A toy resilient training loop on `FaultSession`, as the executor will run it.

    Each stage's "model" is one linear layer; iteration i's gradient is (i + 1) everywhere, so the
    fault-free result is known whoever takes part. Worker `victim` SIGKILLs itself at the start of
    iteration `kill_at`; the launcher starts a replacement, which the survivors admit after
    waiting for it at iteration `hold_at`, and which receives its stage's state from a replica.
    """
    import torch
    import torch.distributed as dist
    from torch import nn

    from schedcomp.runtime.fault.agreement import pending_joins
    from schedcomp.runtime.fault.membership import GenerationAborted, wait_work
    from schedcomp.runtime.fault.session import FaultSession
    from schedcomp.runtime.fault.store import WorkerEnv
    from schedcomp.runtime.fault.transfer import recv_stage_state, send_stage_state
    from schedcomp.topology import Worker

    setup_logging()
    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    me, n_iterations, doomed = env.worker, int(iterations), Worker.parse(victim)
    session = FaultSession(env, detection_time=DETECTION, group_timeout=20.0, agree_timeout=120.0)
    session.start()
    torch.manual_seed(me.stage)
    model = nn.Linear(4, 1, bias=False).double()
    it, events = 0, []

    def hand_over(resume_at: int) -> None:
        """After any change of generation: the donor of each stage gives its state to the replacements."""
        for joiner in session.joiners():
            if joiner.stage == me.stage and session.donor_for(me.stage) == me:
                send_stage_state(model, None, session.groups.world, [session.groups.rank_of(joiner)],
                                 info={"iteration": resume_at})

    if env.rejoining:
        started = time.perf_counter()
        donor = session.groups.rank_of(session.donor_for(me.stage))
        got = recv_stage_state(model, None, session.groups.world, src=donor)
        events.append(("received", time.perf_counter() - started))
        it = got.info["iteration"]
        session.commit(it - 1)  # it holds the donor's state after that step: a commit record like the others'
    while it < n_iterations:
        try:
            if me == doomed and env.incarnation == 0 and it == int(kill_at):
                session.store.set("killed_at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            grad = torch.full((1, 4), float(it + 1), dtype=torch.float64)
            if session.groups.stage is not None:  # ALLREDUCE over the stage's live replicas
                wait_work(dist.all_reduce(grad, group=session.groups.stage, async_op=True), session.signal)
                grad /= len(session.view.topology.stage_group(me.stage))
            token = torch.ones(1)  # ties the stages together each iteration, as a pipeline's transfers do
            wait_work(dist.all_reduce(token, group=session.groups.world, async_op=True), session.signal)
            before = model.weight.detach().clone()  # the step snapshot
            with torch.no_grad():
                model.weight -= 0.01 * grad
            session.commit(it)
            it += 1
            if it == int(hold_at) and session.view.failed:  # give the replacement time to start
                deadline = time.monotonic() + 60
                while not pending_joins(session.store, session.view) and time.monotonic() < deadline:
                    time.sleep(0.01)
            switch = session.boundary(it - 1)
            if switch is not None:
                session.admit(switch)
                hand_over(it)
                events.append(("admitted", it))
        except (GenerationAborted, RuntimeError) as e:
            broken = time.time()
            session.report(e)
            session.recover()
            decision = session.rollback()
            if me in decision.undo:
                with torch.no_grad():
                    model.weight.copy_(before)
            hand_over(decision.rerun)
            events.append(("recovered", it, decision.rerun, time.time() - broken,
                           broken - float(session.store.get("killed_at"))))
            it = decision.rerun
    emit({"worker": str(me), "incarnation": env.incarnation, "weight": model.weight.flatten().tolist(),
          "generation": session.view.generation, "failed": sorted(map(str, session.view.failed)), "events": events})
    session.close()


SCENARIOS = {"regroup": scenario_regroup, "transfer": scenario_transfer, "train": scenario_train,
             "die_before_groups": scenario_die_before_groups, "stalled_recipient": scenario_stalled_recipient}

if __name__ == "__main__":
    faulthandler.dump_traceback_later(child_deadline(), exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
