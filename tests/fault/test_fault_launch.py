"""The launcher keeps survivors alive, leaves death notices, fences, and starts replacements that rejoin."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from fault_procs import HERE, run_job

from schedcomp.runtime.fault.launch import Launcher, parse_args
from schedcomp.topology import Worker

pytestmark = pytest.mark.timeout(150)


def test_parse_args_splits_options_from_the_worker_command() -> None:
    args, command = parse_args(["--pp", "2", "--dp", "3", "--pipelines", "1", "--respawn", "2", "--",
                                "python", "train.py", "--pp", "9"])
    assert (args.pp, args.dp, args.respawn, args.pipelines) == (2, 3, 2, [1])
    assert args.workers == [Worker(1, 0), Worker(1, 1)]  # the workers this launcher starts
    assert args.max_restarts == 3  # restarts from a checkpoint, when a stage is lost
    assert parse_args(["--pp", "2", "--max-restarts", "0", "--", "x"])[0].max_restarts == 0
    assert command == ["python", "train.py", "--pp", "9"]


@pytest.mark.slow
def test_launcher_reports_deaths_and_replaces_only_the_dead() -> None:
    # Worker 0:1 fails once; the others wait for its replacement, then everyone exits 0.
    script = textwrap.dedent("""
        import sys
        from schedcomp.runtime.fault.store import Keys, WorkerEnv
        from schedcomp.topology import Worker
        env = WorkerEnv.from_env()
        store = env.store.connect()
        if env.worker == Worker(0, 1) and env.incarnation == 0:
            sys.exit(3)
        if env.incarnation == 0:
            store.wait([Keys.join(Worker(0, 1))])  # a survivor: lives on until the replacement shows up
        else:
            store.set(Keys.join(env.worker), str(env.incarnation))
    """)
    launcher = Launcher([sys.executable, "-c", script], pp=2, dp=1, respawn=1, poll=0.01)
    assert launcher.run() == 0
    slots = {s.worker: s for s in launcher.slots}
    assert slots[Worker(0, 1)].incarnation == 1 and slots[Worker(0, 0)].incarnation == 0
    assert launcher.store.get("dead/0:1") == b"0"  # the death notice the survivors' detectors read
    assert all(s.returncode == 0 for s in launcher.slots)


@pytest.mark.slow
def test_training_survives_a_sigkill_and_the_replacement_rejoins_bit_exact() -> None:
    iterations, victim, kill_at, hold_at = 14, Worker(1, 1), 3, 6
    # each worker a fresh interpreter (no --preload): the plain way keeps a test of its own
    results, err = run_job(2, 2, ["--respawn", "1"],
                           [str(HERE), "train", str(iterations), str(victim), str(kill_at), str(hold_at)], 130,
                           preload=False)
    assert set(results) == {"0:0", "0:1", "1:0", "1:1"}, err[-4000:]
    assert results[str(victim)]["incarnation"] == 1
    # every survivor recovered once and re-ran from the same iteration
    reruns = {tuple(e[2:3]) for r in results.values() for e in r["events"] if e[0] == "recovered"}
    assert len(reruns) == 1
    # every replica, the replacement included, ends with the fault-free weights, bit for bit
    for r in results.values():
        torch.manual_seed(int(r["worker"].split(":")[1]))
        expected = torch.nn.Linear(4, 1, bias=False).double().weight.detach().clone()
        for i in range(iterations):
            expected -= 0.01 * torch.full((1, 4), float(i + 1), dtype=torch.float64)
        assert r["weight"] == expected.flatten().tolist(), r
    # everyone ends in the same generation, with nobody failed
    assert len({r["generation"] for r in results.values()}) == 1
    assert all(r["failed"] == [] for r in results.values())
