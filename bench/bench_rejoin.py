"""Rejoin time against parameter size, end to end: a replacement process joins a training job.

Reproduce (about 4 minutes on a busy 2-core machine, the 384 MB job most of it):

    python bench/bench_rejoin.py            # stages of 3, 48 and 384 MB of float32 parameters
    python bench/bench_rejoin.py --quick    # 3 and 48 MB (about 1 minute)
    python bench/bench_rejoin.py --sizes 96 # any stage sizes, MB of parameters
    python bench/bench_rejoin.py --quick --preload both  # each size fresh, then with `launch --preload`

`--preload` forks the workers from a process that imported REJOIN_PRELOAD's modules (default
torch,torch._dynamo,schedcomp.runtime).

The job: `ResilientTrainer` (`schedcomp.runtime.resilient`) on CPU/gloo, pp = 2, dp = 2 (4
processes), started by `python -m schedcomp.runtime.fault.launch --pp 2 --dp 2 --respawn 1 -- python
bench/bench_rejoin.py worker ...` (this file is also the worker program). Each stage is an
`nn.Sequential` of 3 square float32 `nn.Linear` layers sized so that one stage holds MB megabytes of
parameters, trained with `torch.optim.Adam` (the state moved is parameters + Adam's two moments, 3x
MB: `state MB`), on 2 micro-batches of 2 rows per pipeline, so that compute stays small next to
moving state. Worker 1:1 SIGKILLs itself before its first instruction of iteration 1
(`fault.inject.kill_at`); the launcher starts its replacement; the survivors recover on the plan
for the failed set (a precompiled plan cache) and go on; at the start of iteration 2 they wait
until the replacement has announced itself (so that every size admits it after the same number
of iterations: without that wait a small model would finish training before a replacement has
imported torch). The replacement is admitted at the boundary the survivors fix, receives stage 1
from its live replica 0:1 and the job switches back to the fault-free plan.

Columns (seconds, all `time.time()` on one host; one run per size):
- `preload`: 1 when the workers are forked from a process that already imported torch and the runtime
  (`launch --preload`, `runtime/fault/zygote.py`), 0 for a fresh interpreter each.
- `death->start`: victim's death (it stamps the time just before SIGKILL) -> its replacement's
  process start (from /proc: fork time, 10 ms resolution); the launcher's reaping and respawn.
- `start->ann`: replacement process start -> announced (`Report.rejoined.announced_at`): Python, torch and
  schedcomp imports, store connect, and a throw-away Adam: the first torch optimizer of a process
  imports torch._dynamo (about 1.5 s), which would otherwise land after admission, inside the
  survivors' stall.
- `ann->adm`: announced -> admitted (its `FaultSession.start` returns: the generation admitting it
  is sealed and its groups are built). Mostly waiting for the agreed boundary, so it grows with
  the iteration time: the first survivor to see the announcement after completing iteration c
  fixes the entry at c + 3 (`agreement.switch_iteration`, lead = 2: no survivor may be more than that
  ahead), so the replacement waits out the iteration in flight and two more, here three whole
  degraded iterations (the survivors held at the start of iteration 2), plus the admission's
  agreement and group construction. `deg it`: a degraded iteration (median, hold excluded).
- `build`: building the stage's module on the replacement; `ResilientTrainer.start` does it
  before announcing, so it is part of `start->ann`, not of the survivors' stall.
- `xfer s`, `GB/s`: `recv_stage_state` as the replacement sees it (wait for the donor, receive
  state MB over gloo on loopback, load it into the module and Adam). Compare Table 2 of
  `bench/bench_fault.py`, the raw transfer alone.
- `1st it`: state loaded -> the replacement's first iteration completed (with the survivors,
  who start it once the donor has sent; it includes the first `StepSnapshot` of the stage).
- `adm->1st`: admitted -> the replacement's first completed iteration: its optimizer and
  groups, `xfer s`, `1st it`, and the rest waiting for the survivors (they leave the agreement, arrive, rebuild
  their groups, switch plans, and the donor serialises its state before sending).
- `total`: replacement process start -> its first completed iteration.
- `stall`, `stall x`: the survivors' stall at the admission boundary: from finishing the
  boundary iteration to finishing the next one (admission, regroup, plan switch, the donor's
  send, the replacement's first iteration), minus a normal iteration (`it s`: median
  of the fault-free iterations after the rejoin in the same run); `stall x` is that interval over
  a normal iteration. The worst survivor.
"""

from __future__ import annotations

import time

BEGAN = time.time()  # before any import that takes time: the replacement's start -> imports

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.abspath(__file__)
PP, DP, MICROBATCHES, ROWS, LAYERS = 2, 2, 2, 2, 3
VICTIM, KILL_ITERATION, HOLD_ITERATION, AFTER = "1:1", 1, 2, 3  # AFTER: normal iterations after the rejoin
SIZES, QUICK_SIZES = [3, 48, 384], [3, 48]


def width_for(megabytes: float) -> int:
    """Width of the square layers that give a stage `megabytes` MB of float32 weights."""
    return round(math.sqrt(megabytes * 2**20 / (4 * LAYERS)))


def process_start() -> float:
    """This process's start (fork) time as `time.time()`, from /proc (resolution: one clock tick)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return BEGAN


# ---- the worker program (one process per worker, under the launcher) -------------------------------


def worker(iterations: str, cache_dir: str, megabytes: str) -> None:
    import faulthandler
    import signal

    faulthandler.dump_traceback_later(600, exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    import torch.nn.functional as F
    from torch import nn

    from schedcomp.cache import PlanCache
    from schedcomp.runtime.fault.agreement import pending_joins
    from schedcomp.runtime.fault.inject import kill_at
    from schedcomp.runtime.fault.session import FaultSession
    from schedcomp.runtime.fault.store import WorkerEnv
    from schedcomp.runtime.resilient import ResilientTrainer
    from schedcomp.topology import Worker

    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    width, chunks = width_for(float(megabytes)), env.dp * MICROBATCHES
    marks: dict[str, float] = {"process": process_start(), "began": BEGAN}
    # Adam's first construction in a process imports torch._dynamo: do it before announcing.
    torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    marks["imported"] = time.time()

    def build_stage(stage: int) -> nn.Module:
        marks["build_begin"] = time.time()
        torch.manual_seed(stage)
        layers: list[nn.Module] = []
        for i in range(LAYERS):
            layers.append(nn.Linear(width, width))
            if i < LAYERS - 1 or stage < env.pp - 1:
                layers.append(nn.Tanh())
        marks["build_end"] = time.time()
        return nn.Sequential(*layers)

    def make_optimizer(params) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-4)

    def batch_for(iteration: int):
        g = torch.Generator().manual_seed(10_000 + iteration)
        return (torch.randn(chunks * ROWS, width, generator=g), torch.randn(chunks * ROWS, width, generator=g))

    # the death notice of the launcher tells survivors at once; heartbeats must not time out
    # while a 384 MB stage steps on a loaded 2-core box
    session = FaultSession(env, detection_time=15.0, group_timeout=60.0, agree_timeout=240.0)
    marks["connected"] = time.time()
    victim = Worker.parse(VICTIM)
    kill = kill_at({victim: (KILL_ITERATION, 0)}, env.worker, env.incarnation)

    def before(iteration: int, index: int, ins) -> None:
        if iteration == HOLD_ITERATION and index == 0 and session.view.failed:
            held, deadline = time.time(), time.monotonic() + 120
            while not pending_joins(session.store, session.view) and time.monotonic() < deadline:
                time.sleep(0.005)
            marks["held"] = time.time() - held  # not a degraded iteration's time
        if kill is not None and (iteration, index) >= (KILL_ITERATION, 0):
            session.store.set("killed_at", repr(time.time()))
            kill(iteration, index, ins)

    trainer = ResilientTrainer(PlanCache.load(cache_dir), build_stage, F.mse_loss, make_optimizer, batch_for,
                               session=session, before=before)
    report = trainer.run(int(iterations))
    killed = float(session.store.get("killed_at")) if session.store.check(["killed_at"]) else None
    line = {"worker": str(env.worker), "incarnation": env.incarnation, "iterations": report.iterations,
            "failed": list(report.failed), "admitted": report.admitted, "resumed_at": report.resumed_at,
            "handed_over": report.handed_over, "recoveries": len(report.recoveries),
            "completed_at": {str(i): t for i, t in report.completed_at.items()},
            "marks": marks, "killed_at": killed,
            "rejoined": report.rejoined.__dict__ if report.rejoined is not None else None}
    os.write(1, (json.dumps(line) + "\n").encode())  # one write: workers share the pipe
    trainer.close()


# ---- the parent ----------------------------------------------------------------------------------------


def run_job(cache_dir: str, megabytes: float, iterations: int, timeout: float = 400.0,
            preload: bool = False) -> dict[str, dict]:
    """Launch the job once; returns each worker's JSON line (the replacement's under its worker name)."""
    cmd = [sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", str(PP), "--dp", str(DP),
           "--respawn", "1", *(["--preload", PRELOAD] if preload else []),
           "--", sys.executable, HERE, "worker", str(iterations), cache_dir, str(megabytes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:  # the launcher stops its workers when it is terminated
            proc.terminate()
            proc.communicate(timeout=30)
    results = {r["worker"]: r for r in map(json.loads, (x for x in out.splitlines() if x.startswith("{")))}
    if proc.returncode != 0 or len(results) != PP * DP or results[VICTIM]["incarnation"] != 1:
        raise RuntimeError(f"the {megabytes} MB job failed (launcher exit {proc.returncode}, "
                           f"{sorted(results)} reported):\n{err[-4000:]}")
    return results


def intervals(completed: dict[str, float], iterations: range) -> list[float]:
    return [completed[str(j)] - completed[str(j - 1)] for j in iterations]


def measure(results: dict[str, dict], iterations: int) -> dict[str, float]:
    """The table's row from the workers' lines (see the module docstring)."""
    new = results[VICTIM]
    m, at, joined = new["marks"], new["resumed_at"], new["rejoined"]
    survivors = [r for w, r in results.items() if w != VICTIM]
    if joined is None:
        raise RuntimeError("the replacement reported no rejoin (Report.rejoined)")
    if not all(r["admitted"] == [at] for r in survivors):
        raise RuntimeError(f"survivors admitted at {[r['admitted'] for r in survivors]}, replacement resumed at {at}")
    if sum(r["handed_over"] for r in survivors) != 1 or any(r["failed"] for r in results.values()):
        raise RuntimeError("the job did not end on the fault-free plan with one hand-over: "
                           f"{[(w, r['handed_over'], r['failed']) for w, r in results.items()]}")
    first = new["completed_at"][str(at)]
    normal = statistics.median(x for r in survivors for x in intervals(r["completed_at"], range(at + 1, iterations)))
    # degraded iterations: after the re-run of the killed one, before the rejoin, less the hold
    slow = [x - (r["marks"].get("held", 0.0) if j == HOLD_ITERATION else 0.0)
            for r in survivors for j in range(KILL_ITERATION + 2, at)
            for x in intervals(r["completed_at"], range(j, j + 1))]
    degraded = statistics.median(slow) if slow else math.nan
    boundary = max(intervals(r["completed_at"], range(at, at + 1))[0] for r in survivors)
    xfer = joined["loaded_at"] - joined["received_at"]
    return {
        "state MB": joined["received_bytes"] / 2**20, "it s": normal, "deg it": degraded,
        "death->start": m["process"] - new["killed_at"], "start->ann": joined["announced_at"] - m["process"],
        "ann->adm": joined["admitted_at"] - joined["announced_at"], "build": m["build_end"] - m["build_begin"],
        "xfer s": xfer, "GB/s": joined["received_bytes"] / xfer / 1e9,
        "1st it": first - joined["loaded_at"],
        "adm->1st": first - joined["admitted_at"],
        "total": first - m["process"], "stall": boundary - normal, "stall x": boundary / normal,
    }


PRELOAD = os.environ.get("REJOIN_PRELOAD", "torch,torch._dynamo,schedcomp.runtime")  # torch.optim imports _dynamo
COLUMNS = ["MB", "preload", "state MB", "it s", "deg it", "death->start", "start->ann", "ann->adm", "build", "xfer s",
           "GB/s", "1st it", "adm->1st", "total", "stall", "stall x"]


def main() -> None:
    from schedcomp.cache import precompile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 and 48 MB only")
    p.add_argument("--sizes", type=float, nargs="+", help="stage sizes in MB of parameters")
    p.add_argument("--preload", choices=("no", "yes", "both"), default="no",
                   help="fork the workers from a process that imported torch (launch --preload); both: "
                        "each size without, then with")
    args = p.parse_args()
    modes = {"no": [False], "yes": [True], "both": [False, True]}[args.preload]
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    # the replacement enters `lead` + 1 = 3 iterations after the hold at the earliest
    iterations = HOLD_ITERATION + 3 + 1 + AFTER
    print(f"Rejoin of worker {VICTIM} (pp={PP}, dp={DP}, CPU/gloo, Adam), seconds; one run per size")
    print(" ".join(f"{c:>{max(len(c), 6)}}" for c in COLUMNS), flush=True)
    with tempfile.TemporaryDirectory(prefix="schedcomp-rejoin-") as folder:
        precompile(PP, DP, MICROBATCHES, 1, directory=folder, time_limit=1.0)
        for mb, preload in ((mb, preload) for mb in sizes for preload in modes):
            row = {"MB": mb, "preload": float(preload),
                   **measure(run_job(folder, mb, iterations, preload=preload), iterations)}
            cells = []
            for c in COLUMNS:
                v = row[c]
                digits = 0 if c in ("MB", "preload", "state MB") else 2 if c == "stall x" else 3
                cells.append(f"{v:>{max(len(c), 6)}.{digits}f}")
            print(" ".join(cells), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:])
    else:
        main()
