"""Fault-tolerance groundwork on CPU/gloo: time from a worker's death to a working new generation, and
replica-recovery time against the stage's size.

Reproduce (about 2 minutes on a 2-core machine, plus about 2 minutes per Table 3 row):

    python bench/bench_fault.py            # 4 and 8 processes, both detection paths, 3 state sizes
    python bench/bench_fault.py --quick    # 4 processes, smallest sizes, 2 rows of Table 3
    python bench/bench_fault.py --table 3 --quick   # only Table 3 (recovery vs checkpoint-restart)
    python bench/bench_fault.py --table 4           # only Table 4 (several hosts: host lost, partition; root)

Table 1. Survivors spin all-reduces over the world group; the bench kills one worker per round
(SIGKILL, reaped by the launcher, which leaves a death notice: "notice"), or stops it (SIGSTOP: no
process exit, only its silent heartbeat gives it away, then the launcher fences it: "heartbeat").
Per round and survivor, seconds from the kill to: the first error or abort seen (`broken`), one
generation sealed by every survivor (`agreed`), process groups rebuilt (`regroup`, its own time),
and the first all-reduce completed on the new generation (`working`). Medians over survivors and
rounds. The heartbeat path waits out `detection_time` (default 3 s) by design.

Table 2. A live replica sends a stage (one float32 parameter + Adam state = 3x its size) to a
replacement over gloo on loopback: seconds and GB/s, median of 3 transfers.

Table 3. Training end to end (`ResilientTrainer`, pp = 4, dp = 2, 8 processes, CPU/gloo, the
chaos-test model of `tests/support/resilient_procs.py`, an asynchronous checkpoint after every iteration):
a seeded worker SIGKILLs itself at a seeded instruction, and the same job runs twice with the same
death. `ours`: seconds from the death to the re-run iteration completed on every survivor
(detection by the launcher's death notice, agreement, regroup, plan switch, rollback and the
re-run). `restart`: the job with `CheckpointPolicy(on_failure="restart")`, i.e. a real
checkpoint-restart: every survivor asks for a restart, the launcher stops all of them and starts 8
fresh processes, which restore the latest complete checkpoint and re-run the iterations since it;
seconds from the death to the same point of training (the iteration in flight at the death, or
the one after the restored checkpoint if later) completed on every worker. `lost`: the iterations
the restart threw away (highest commit minus the restored checkpoint); ours loses none (only the
iteration in flight is re-run). `lossy s`: the same death under `policy="lossy"`: seconds to the
interrupted iteration finished on every survivor without the lost micro-batches (no re-run; `skipped`:
the samples it dropped, of 16). `relaunch`: the part of `restart` until the last fresh process was
up with torch imported (teardown, process start, imports), before it joins, restores and re-runs.
`--table 3` runs it alone.

Table 4. Several hosts on one machine (`tests/support/netns_hosts.py`: three network namespaces on a bridge,
needs root and `ip`), pp = 2, dp = 3, host h running pipeline h under its own launcher, the store on
host 0, the chaos-test model. The job stands still at the start of iteration 2 while the harness
(a) cuts host 2 off and kills all its processes (`host lost`: no death notice, no connection reset:
seen by heartbeats only), (b) only cuts it off (`partition`), or (c) does (a) and worker 1:1, on host
1, dies right after the survivors agreed on the first recovery (`+ 2nd death`: recovery starts
again). Seconds from the harness's stamp to the re-run iteration completed on every survivor
(`recovered`), the detection time it includes by design, and `over` = recovered - detection (the
target is < 2 s); for (b), `fenced`: seconds until the cut-off host's launcher had exited (its
workers fence themselves after the detection time, the launcher after twice that); `rounds`: the
recoveries a survivor recorded (a death during recovery restarts it inside the same record), `failed`:
the final failed set (1:1 in it shows that the second death happened).
`--table 4` runs it alone; `--detection-time` sets the heartbeat timeout.

Each worker is a process of this file (`worker` / `transfer` sub-commands), started by the
launcher of `schedcomp.runtime.fault.launch`; Table 3's workers are `tests/support/resilient_procs.py resilient`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

HERE = os.path.abspath(__file__)


# ---- worker processes ---------------------------------------------------------------------------------


def worker(detection: str) -> None:
    import torch
    import torch.distributed as dist

    from schedcomp.runtime.fault import Graveyard, agree, join_job, regroup, wait_work
    from schedcomp.runtime.fault.membership import FailureDetector, GenerationAborted, Heartbeat
    from schedcomp.runtime.fault.store import WorkerEnv

    torch.set_num_threads(1)
    detection_time = float(detection)
    env = WorkerEnv.from_env()
    store = env.store.connect()
    Heartbeat(env.store, env.worker, env.incarnation, interval=detection_time / 6).start()
    detector = FailureDetector(env.store, env.worker, detection_time=detection_time).start()
    view = join_job(store, env.pp, env.dp, env.worker, detector)
    groups, graveyard = regroup(store, view, env.worker, timeout=30.0), Graveyard()
    store.add("ready", 1)
    rounds = 0
    while True:
        try:
            # everyone leaves after the same all-reduce: it carries whether anyone saw the stop key
            token = torch.tensor([float(store.check(["stop"]))])
            wait_work(dist.all_reduce(token, group=groups.world, async_op=True), detector.signal)
            if token.item() > 0:
                break
            continue
        except (GenerationAborted, RuntimeError) as e:
            broken = time.time()
            detector.report(None, e)
        groups.close(graveyard)
        view = agree(store, view, env.worker, detector, timeout=60.0)
        agreed = time.time()
        groups = regroup(store, view, env.worker, timeout=30.0)
        regrouped = time.time()
        wait_work(dist.all_reduce(torch.zeros(1), group=groups.world, async_op=True), detector.signal)
        working = time.time()
        killed = float(store.get(f"killed/{rounds}"))
        store.set(f"result/{rounds}/{env.worker}", json.dumps({
            "broken": broken - killed, "agreed": agreed - killed, "regroup": regrouped - agreed,
            "working": working - killed, "generation": view.generation}))
        store.add(f"done/{rounds}", 1)
        rounds += 1
    detector.stop()


def transfer(megabytes: str, repeats: str) -> None:
    import torch
    from torch import nn

    from schedcomp.runtime.fault import View, recv_stage_state, regroup, send_stage_state
    from schedcomp.runtime.fault.store import WorkerEnv

    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    store = env.store.connect()
    groups = regroup(store, View.initial(env.pp, env.dp), env.worker, timeout=60.0)
    module = nn.ParameterList([nn.Parameter(torch.randn(int(float(megabytes) * 2**20 / 4)))])
    optimizer = torch.optim.Adam(module.parameters())
    module[0].grad = torch.ones_like(module[0])
    optimizer.step()  # Adam now holds two more tensors of the parameter's size
    times = []
    for _ in range(int(repeats)):
        start = time.perf_counter()
        if env.worker.pipeline == 0:
            nbytes = send_stage_state(module, optimizer, groups.world, [1])
        else:
            nbytes = recv_stage_state(module, optimizer, groups.world, src=0).nbytes
        times.append(time.perf_counter() - start)
    if env.worker.pipeline == 1:
        store.set("transfer", json.dumps({"bytes": nbytes, "seconds": statistics.median(times)}))


# ---- the parent -----------------------------------------------------------------------------------------


def _until(launcher, predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the workers did not get there in time")
        if not launcher.step() and not predicate():
            raise RuntimeError("every worker exited: see their errors above")
        time.sleep(0.01)


def recovery(pp: int, dp: int, mode: str, rounds: int, detection_time: float) -> list[dict]:
    from schedcomp.runtime.fault.launch import Launcher

    launcher = Launcher([sys.executable, HERE, "worker", str(detection_time)], pp, dp, poll=0.01)
    store = launcher.store
    results = []
    try:
        launcher.start()
        n = pp * dp
        _until(launcher, lambda: store.add("ready", 0) >= n)
        # one victim per round, in different pipelines and stages
        victims = [launcher.slots[(r * (pp + 1)) % n] for r in range(rounds)]
        for r, slot in enumerate(victims):
            store.set(f"killed/{r}", repr(time.time()))
            os.kill(slot.proc.pid, signal.SIGKILL if mode == "notice" else signal.SIGSTOP)
            survivors = n - r - 1
            _until(launcher, lambda r=r, s=survivors: store.add(f"done/{r}", 0) >= s)
            live = [s.worker for s in launcher.slots if s not in victims[: r + 1]]
            results += [json.loads(store.get(f"result/{r}/{w}")) for w in live]
        store.set("stop", "1")
        _until(launcher, lambda: not any(s.proc for s in launcher.slots if s not in victims))
    finally:
        for slot in launcher.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.kill()  # a stopped victim not fenced yet
        launcher.terminate()
    return results


def state_transfer(megabytes: float, repeats: int = 3) -> dict:
    from schedcomp.runtime.fault.launch import Launcher

    launcher = Launcher([sys.executable, HERE, "transfer", str(megabytes), str(repeats)], pp=1, dp=2, poll=0.01)
    try:
        launcher.start()
        _until(launcher, lambda: launcher.store.check(["transfer"]))
        return json.loads(launcher.store.get("transfer"))
    finally:
        launcher.terminate()


def training(plans: str, victims: str, on_failure: str, iterations: int = 5, policy: str = "rollback"
             ) -> dict[str, dict]:
    """Launch the chaos job with a checkpoint every iteration; returns each last-run worker's JSON result."""
    import subprocess
    import tempfile

    procs = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "support", "resilient_procs.py")
    with tempfile.TemporaryDirectory(prefix="schedcomp-ckpt-") as ckpt:
        run = subprocess.run([sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", "4", "--dp", "2",
                              "--max-restarts", "1", "--", sys.executable, procs, "restart", str(iterations), plans,
                              ckpt, victims, on_failure], capture_output=True, text=True, timeout=400,
                             env={**os.environ, "CHAOS_POLICY": policy})
    results = {r["worker"]: r for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    if run.returncode != 0 or not results:
        raise RuntimeError(f"the job failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return results


def table_training(seeds: list[int]) -> None:
    import random
    import tempfile

    from schedcomp.cache import precompile

    print("\nTable 3: training, pp=4 dp=2 (8 processes), checkpoint every iteration: death -> re-run iteration "
          "completed everywhere, ours vs checkpoint-restart")
    print(f"{'seed':>4} {'victim':>10} {'ours s':>7} {'lossy s':>7} {'skipped':>7} {'restart s':>9} "
          f"{'relaunch s':>10} {'ours/restart':>12} {'lossy/restart':>13} {'lost':>4}")
    with tempfile.TemporaryDirectory(prefix="schedcomp-bench-") as plans:
        precompile(4, 2, 4, 1, directory=plans, time_limit=1.0)
        for seed in seeds:
            rng = random.Random(seed)
            victim, iteration, index = f"{rng.randrange(2)}:{rng.randrange(4)}", rng.randrange(1, 4), rng.randrange(26)
            spec = f"{victim}@{iteration}.{index}"
            ours = training(plans, spec, "replan")
            killed = next(r["killed_at"] for r in ours.values() if r["killed_at"] is not None)
            rerun = min(rec["rerun"] for r in ours.values() for rec in r["recoveries"])
            recovered = max(r["completed_at"][str(rerun)] for r in ours.values()) - killed
            lossy = training(plans, spec, "replan", policy="lossy")
            killed = next(r["killed_at"] for r in lossy.values() if r["killed_at"] is not None)
            (finished,) = {rec["rerun"] for r in lossy.values() for rec in r["recoveries"] if rec["method"] == "lossy"}
            lossy_s = max(r["completed_at"][str(finished)] for r in lossy.values()) - killed
            skipped = next(iter(lossy.values()))["skipped_samples"].get(str(finished), 0)
            again = training(plans, spec, "restart")
            assert all(r["run"] == 1 for r in again.values()), "the job was not restarted"
            killed = next(r["killed_at"] for r in again.values() if r["killed_at"] is not None)
            restored = next(iter(again.values()))["restored_from"]
            target = max(iteration, restored + 1 if restored is not None else 0)
            restarted = max(r["completed_at"][str(target)] for r in again.values()) - killed
            relaunch = max(r["started_at"] for r in again.values()) - killed
            lost = next(iter(again.values()))["iterations_lost"]
            print(f"{seed:>4} {spec:>10} {recovered:>7.3f} {lossy_s:>7.3f} {skipped:>7} {restarted:>9.3f} "
                  f"{relaunch:>10.3f} {recovered / restarted:>12.3f} {lossy_s / restarted:>13.3f} {lost:>4}",
                  flush=True)


def table_hosts(detection: float) -> None:
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "support"))
    from hosts_job import HostJob
    from netns_hosts import Hosts, unavailable

    from schedcomp.cache import precompile

    print(f"\nTable 4: several hosts (network namespaces), pp=2 dp=3, detection {detection:g} s: "
          "seconds from the damage to the re-run iteration completed on every survivor")
    why = unavailable()
    if why is not None:
        print(f"skipped: {why}")
        return
    print(f"{'what':>14} {'recovered':>9} {'detection':>9} {'over':>6} {'fenced':>7} {'rounds':>6} failed")
    gate, lost = 2, 2
    with tempfile.TemporaryDirectory(prefix="schedcomp-bench-") as plans:
        precompile(2, 3, 2, 3, directory=plans, time_limit=1.0)
        for what, victims, kill in (("host lost", "", True), ("partition", "", False),
                                    ("+ 2nd death", "1:1@rec", True)):
            hosts = Hosts(3)
            job = HostJob(hosts, 2, 3, 4, plans, detection=detection, gates=[gate], victims=victims)
            try:
                job.wait_count(f"at_gate/{gate}", 6)
                hosts.cut(lost)
                if kill:
                    hosts.kill_all(lost)
                job.ask("stamp", "killed_at")
                job.ask("set", f"gate/{gate}")
                fenced = ""
                if not kill:
                    job.finish(lost, timeout=300)
                    fenced = f"{time.time():.6f}"
                results = {}
                for h in (0, 1):
                    code, got, err = job.finish(h, timeout=300)
                    if code != 0:
                        raise RuntimeError(f"host {h}'s launcher exited {code}:\n{err[-3000:]}")
                    results.update(got)
            finally:
                job.close()
                hosts.close()
            killed = next(r["killed_at"] for r in results.values())
            rerun = max(rec["rerun"] for r in results.values() for rec in r["recoveries"])
            recovered = max(r["completed_at"][str(rerun)] for r in results.values()) - killed
            fenced = f"{float(fenced) - killed:>7.2f}" if fenced else f"{'-':>7}"
            rounds = max(len(r["recoveries"]) for r in results.values())  # recoveries each survivor went through
            failed = ",".join(next(iter(results.values()))["failed"])
            print(f"{what:>14} {recovered:>9.2f} {detection:>9.2f} {recovered - detection:>6.2f} {fenced} {rounds:>6} "
                  f"{failed}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--detection-time", type=float, default=3.0)
    p.add_argument("--table", type=int, choices=(1, 2, 3, 4), help="run only this table")
    args = p.parse_args()
    if args.table == 3:
        table_training([0, 1] if args.quick else [0, 1, 2])
        return
    if args.table == 4:
        table_hosts(args.detection_time)
        return
    shapes = [(2, 2)] if args.quick else [(2, 2), (4, 2)]
    print("Table 1: seconds from a worker's death (median over survivors and rounds)")
    print(f"{'procs':>5} {'detection':>9} {'rounds':>6} {'broken':>7} {'agreed':>7} {'regroup':>8} {'working':>8}")
    for pp, dp in shapes:
        for mode in ("notice", "heartbeat"):
            rounds = dp * pp // 2 - 1 if not args.quick else 1
            rs = recovery(pp, dp, mode, max(1, min(rounds, 3)), args.detection_time)
            med = {k: statistics.median(r[k] for r in rs) for k in ("broken", "agreed", "regroup", "working")}
            print(f"{pp * dp:>5} {mode:>9} {max(1, min(rounds, 3)):>6} {med['broken']:>7.3f} {med['agreed']:>7.3f} "
                  f"{med['regroup']:>8.3f} {med['working']:>8.3f}", flush=True)
    print("\nTable 2: replica recovery over gloo (loopback), median of 3 transfers")
    print(f"{'state MB':>8} {'seconds':>8} {'GB/s':>6}")
    for mb in ([1, 16] if args.quick else [1, 16, 128]):
        t = state_transfer(mb)
        print(f"{t['bytes'] / 2**20:>8.0f} {t['seconds']:>8.3f} {t['bytes'] / t['seconds'] / 1e9:>6.2f}", flush=True)
    table_training([0, 1] if args.quick else [0, 1, 2])
    table_hosts(args.detection_time)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("worker", "transfer"):
        {"worker": worker, "transfer": transfer}[sys.argv[1]](*sys.argv[2:])
    else:
        main()
