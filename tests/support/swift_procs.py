"""Worker processes of logging-based recovery jobs (`fault.swift`) for the tests and `bench/bench_logging.py`.

Run as `python tests/support/swift_procs.py ITERATIONS CACHE_DIR CKPT_DIR VICTIMS EVERY [WHERE] [BUDGET] [HIDDEN]
[NOISY] [HELPERS] [HELPER_DIES] [ROWS]`
under `python -m schedcomp.runtime.fault.launch --respawn 1 --max-restarts 1`; victims (`resilient_procs.
parse_victims`) die in run 0, first incarnation only. Each worker prints one JSON line: its report
and its stage's final state. WHERE = "memory" or a directory, or "none" for plain checkpoint-restart;
HIDDEN: the chaos model's width (default 8; the benchmark's larger model); NOISY = "1": the model with
dropout of `stream_models` (seed `stream_models.SEED`) instead of the chaos model; HELPERS: at most
that many idle survivors help replay a lost stage (`LoggingPolicy.helpers`, default 0); HELPER_DIES: this
worker (e.g. "0:0") SIGKILLs itself in run 0 if it helps a replay, before its first gradient sum; ROWS:
rows per micro-batch (default 2; the benchmark's heavier replay).
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import time

from fault_procs import child_deadline, emit
from resilient_procs import chaos_batch, chaos_stage, restarting_worker


def worker(iterations: str, cache_dir: str, ckpt_dir: str, victims: str, every: str, where: str = "memory",
           budget: str = str(1 << 30), hidden: str = "8", noisy: str = "0",
           helpers: str = "0", helper_dies: str = "none", rows: str = "2") -> None:
    import functools

    import resilient_procs
    import torch.nn.functional as F
    from momentum import Momentum  # imports torch: only once the child's deadline is armed
    from stream_models import SEED, noisy_stage

    from schedcomp.runtime.fault.boundary_log import LoggingPolicy
    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.resilient import ResilientTrainer

    started = time.time()
    resilient_procs.H, resilient_procs.ROWS = int(hidden), int(rows)  # read by chaos_stage and chaos_batch
    env, root, cache, at, session, kill = restarting_worker(cache_dir, victims)

    def before(iteration: int, index: int, ins) -> None:
        if kill is None or (iteration, index) < at[env.worker]:
            return
        trainer.last_resort.close()  # its checkpoint in flight completes first: what recovery finds is not a race
        root.compare_set("killed_at", "", repr(time.time()))
        kill(iteration, index, ins)

    if str(env.worker) == helper_dies and env.run == 0 and env.incarnation == 0:
        die_helping()
    logging = None if where == "none" else LoggingPolicy(where, budget_bytes=int(budget), helpers=int(helpers))
    build = noisy_stage if noisy == "1" else chaos_stage
    trainer = ResilientTrainer(cache, functools.partial(build, pp=env.pp), F.mse_loss, Momentum,
                               lambda i: chaos_batch(i, env.dp * cache.microbatches), session=session, before=before,
                               checkpoint=CheckpointPolicy(ckpt_dir, every=int(every)), logging=logging, seed=SEED)
    report = trainer.run(int(iterations))
    emit({"worker": str(env.worker), "incarnation": env.incarnation, "run": report.run,
          "iterations": report.iterations, "restored_from": report.restored_from,
          "iterations_lost": report.iterations_lost, "restart_reason": report.restart_reason,
          "resumed_at": report.resumed_at, "replayed": report.replayed, "replay_seconds": report.replay_seconds,
          "helped": report.helped, "replay_share": report.replay_share, "replayed_with": report.replayed_with,
          "log_bytes": {str(i): n for i, n in report.log_bytes.items()}, "log_peak": report.log_peak,
          # a wide model's state would be megabytes of JSON in one write to a pipe: the benchmark needs none
          "state": {k: v.tolist() for k, v in trainer.state().items()} if int(hidden) <= 64 else {},
          "ledger": {str(i): v for i, v in report.ledger.items()},
          "recoveries": [r.__dict__ for r in report.recoveries],
          "completed_at": {str(i): t for i, t in report.completed_at.items()}, "started_at": started,
          "killed_at": float(root.get("killed_at")) if root.check(["killed_at"]) else None})
    trainer.close()


def die_helping() -> None:
    """Make this worker's help with a parallel replay end in a SIGKILL, just before its first gradient sum."""
    import os

    from schedcomp.runtime.fault import swift_parallel

    replay = swift_parallel.replay

    def dying(*args, **kwargs) -> None:
        def reduce(stage) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        replay(*args[:-1], reduce, **kwargs)

    swift_parallel.replay = dying  # only `help_replay` calls it from there: a replacement's replay is not touched


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(child_deadline(), exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    worker(*sys.argv[1:])
