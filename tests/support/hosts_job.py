"""A resilient job spread over the network namespaces of `netns_hosts`, for tests and `bench/bench_fault.py`.

`HostJob` starts one launcher per host (`python -m schedcomp.runtime.fault.launch`), host 0
serving the store, host h running every stage of pipeline h; the workers are
`resilient_procs.py resilient` (the chaos-test model), which stop at the iterations in `gates`
until the harness opens them. The harness lives outside the namespaces, so it reaches the store
through a controller process on host 0 (`python tests/support/hosts_job.py control`), which answers one
command per line on its stdin:

    count KEY N      wait until the counter KEY reaches N (90 s at most); answers its value
    stamp KEY        set KEY to the time now (time.time(), the same clock in every namespace)
    set KEY          set KEY to "1"

`python tests/support/hosts_job.py stale WORKER GENERATION` (run on a healed host, with the launcher's
environment for that worker) plays a worker that outlived a cut: it tries to agree on the
generation after GENERATION, again after each newer one as a session would, and prints whether
it was evicted or joined.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from fault_procs import PRELOAD
from netns_hosts import Hosts

HERE = Path(__file__).resolve()
PROCS = HERE.parent / "resilient_procs.py"
PORT = 29400


class HostJob:
    """pp x dp workers on `hosts` (pipeline h on host h, the store on host 0) and a controller."""

    def __init__(self, hosts: Hosts, pp: int, dp: int, iterations: int, cache_dir: str, *, detection: float,
                 gates: Sequence[int] = (), victims: str = "", store_timeout: float | None = None) -> None:
        self.hosts, self.pp, self.dp = hosts, pp, dp
        self.store = f"{hosts.addresses[0]}:{PORT}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CHAOS_DETECTION": str(detection),
               # the operations a cut leaves hanging (and leaving the job) wait this long, not the default 30 s
               "CHAOS_GROUP_TIMEOUT": str(2 * detection),
               "CHAOS_GATES": ",".join(map(str, gates))}
        self.env = env
        worker = [sys.executable, str(PROCS), "resilient", str(iterations), cache_dir, victims]
        timeout = ["--store-timeout", str(store_timeout or 2 * detection)]
        self.launchers = []
        for h in range(dp):
            where = ["--serve-store", self.store] if h == 0 else ["--store", self.store]
            argv = [sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", str(pp), "--dp", str(dp),
                    "--pipelines", str(h), *where, "--bind", hosts.addresses[h], *timeout, *PRELOAD, "--", *worker]
            self.launchers.append(hosts.popen(h, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
        self.control = hosts.popen(0, [sys.executable, str(HERE), "control", self.store], env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def ask(self, *command: object) -> str:
        """One controller command (see the module docstring); returns its answer."""
        assert self.control.stdin is not None and self.control.stdout is not None
        self.control.stdin.write(" ".join(map(str, command)) + "\n")
        self.control.stdin.flush()
        answer = self.control.stdout.readline().strip()
        if not answer:
            err = self.control.stderr.read() if self.control.stderr else ""
            raise AssertionError(f"the controller died:\n{err[-3000:]}")
        return answer

    def wait_count(self, key: str, n: int) -> None:
        got = int(self.ask("count", key, n))
        assert got >= n, f"{key} stayed at {got} of {n}"

    def finish(self, host: int, timeout: float) -> tuple[int, dict[str, dict], str]:
        """Wait for host `host`'s launcher: its exit status, its workers' JSON lines by worker, its stderr."""
        proc = self.launchers[host]
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"host {host}'s launcher did not finish in {timeout} s:\n{err[-6000:]}") from None
        results = {r["worker"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
        return proc.returncode, results, err

    def stale(self, host: int, worker: str, generation: int, timeout: float = 90.0) -> dict:
        """Run a worker that outlived a cut on `host` (see the module docstring); its JSON answer."""
        env = {**self.env, "SCHEDCOMP_STORE": self.store, "SCHEDCOMP_WORKER": worker,
               "SCHEDCOMP_SHAPE": f"{self.pp},{self.dp}", "SCHEDCOMP_INCARNATION": "0",
               "SCHEDCOMP_BIND": self.hosts.addresses[host]}
        done = subprocess.run(["ip", "netns", "exec", self.hosts.names[host], sys.executable, str(HERE), "stale",
                               worker, str(generation)], env=env, capture_output=True, text=True, timeout=timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert lines, f"the stale worker printed nothing (exit {done.returncode}):\n{done.stderr[-3000:]}"
        return json.loads(lines[-1])

    def close(self) -> None:
        for p in [*self.launchers, self.control]:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                p.communicate(timeout=10)


# ---- child side (inside a namespace) ------------------------------------------------------------------


def control(address: str) -> None:
    import time

    from schedcomp.runtime.fault.store import StoreAddress

    store = StoreAddress.parse(address).connect(timeout=120.0)
    for line in sys.stdin:
        command, key, *rest = line.split()
        if command == "count":
            deadline = time.monotonic() + 90
            while store.add(key, 0) < int(rest[0]) and time.monotonic() < deadline:
                time.sleep(0.01)
            answer = str(store.add(key, 0))
        elif command == "stamp":
            store.set(key, repr(time.time()))
            answer = "ok"
        else:
            store.set(key, "1")
            answer = "ok"
        print(answer, flush=True)


def stale(worker: str, generation: str) -> None:
    """A worker of generation `generation` that comes back: agree on the next one, as `recover` would."""
    from schedcomp.runtime.fault.agreement import Evicted, agree, latest_view
    from schedcomp.runtime.fault.membership import FailureDetector, Heartbeat, View
    from schedcomp.runtime.fault.store import WorkerEnv
    from schedcomp.topology import Topology

    env = WorkerEnv.from_env()
    store = env.store.connect()
    beat = Heartbeat(env.store, env.worker, env.incarnation).start()
    detector = FailureDetector(env.store, env.worker, detection_time=5.0).start()
    view = View(int(generation), Topology.of(env.pp, env.dp))
    latest = latest_view(store)
    outcome: dict = {"evicted": None, "joined": None, "passed": []}
    # As `FaultSession.recover` would: agree on the generation after the one it knows; a newer
    # one proposed since trips its detector, so it agrees again, until it is out or current.
    while outcome["evicted"] is None and outcome["joined"] is None:
        try:
            view = agree(store, view, env.worker, detector, timeout=30.0)
        except Evicted as e:
            outcome["evicted"] = str(e)
            break
        outcome["passed"].append(view.generation)
        if latest_view(store).generation == view.generation:
            outcome["joined"] = view.generation
    detector.stop()
    beat.stop()
    print(json.dumps({"worker": worker, "latest": latest.generation if latest else None, **outcome}), flush=True)


if __name__ == "__main__":
    {"control": control, "stale": stale}[sys.argv[1]](*sys.argv[2:])
