"""The demo: compile a plan for a job with a failed worker, show it, train a small GPT on it.

    python -m schedcomp.runtime.demo                      # pp=2, dp=2, worker 1:1 failed, adaptive
    python -m schedcomp.runtime.demo --pp 4 --dp 2 --fail 0:2 --iterations 20 --trace trace.json
    python -m schedcomp.runtime.demo --failed --schedule zb-h1   # no failure: a fault-free family

It prints which schedule it runs (a fault-free family such as zb-h1 only runs with no failed worker).

It compiles the plan (`schedcomp.compiler`), draws it (`schedcomp show`), saves it (in a temporary
folder removed at the end, unless `--plan FILE` or `--trace` keeps it), and launches
one process per live worker with `torchrun --standalone` (CPU and gloo unless every process has a
GPU). Rank 0 prints the loss and throughput of each iteration; the loss of iteration i is printed
once iteration i+1 has started, so reading it never holds the pipeline back. `--trace` writes the
measured timeline, which `schedcomp show PLAN --measured TRACE` draws beside the planned one and
`schedcomp profile TRACE -o costs.json` turns into a cost model.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from schedcomp.cli.common import worker
from schedcomp.errors import SchedcompError
from schedcomp.topology import Worker


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m schedcomp.runtime.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel pipelines (default 2)")
    p.add_argument("--fail", dest="failed", type=worker, action="append", metavar="D:S",
                   help="a failed worker (pipeline:stage); repeat for several (default: the last stage of the "
                   "last pipeline)")
    p.add_argument("--failed", dest="failed", type=worker, action="extend", nargs="*", metavar="D:S",
                   help="the same, several at once; --failed alone: no failure")
    p.add_argument("--schedule", default="adaptive",
                   help="adaptive (default), or with no failure 1f1b, zb-h1, zb-h2, gpipe")
    p.add_argument("--plan", metavar="FILE", help="keep the compiled plan here (default: a temporary file, "
                   "removed at the end; beside --trace when that is given)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per pipeline (default 4)")
    p.add_argument("--rows", type=int, default=4, help="sequences per micro-batch (default 4)")
    p.add_argument("--iterations", type=int, default=12, help="training iterations (default 12)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--width", type=int, default=64, help="model width (default 64)")
    p.add_argument("--trace", metavar="FILE", help="write the measured timeline as a Chrome trace")
    p.add_argument("--worker", metavar="PLAN", help=argparse.SUPPRESS)  # set by the launcher for each process
    return p


def choose_schedule(args: argparse.Namespace) -> tuple[list[Worker], str, str]:
    """The failed workers, the schedule the demo runs and one line saying why (printed before it runs)."""
    failed = [Worker(args.dp - 1, args.pp - 1)] if args.failed is None else args.failed
    if failed:
        where = ", ".join(map(str, failed))
        if args.schedule != "adaptive":  # the fault-free families have no place for a failed worker's work
            default = " (the default failure)" if args.failed is None else ""
            return failed, "adaptive", (f"schedule: adaptive, not {args.schedule}: {args.schedule} is a fault-free "
                                        f"schedule and worker {where} is failed{default}; give --failed alone to "
                                        f"run {args.schedule} with no failure")
        return failed, "adaptive", f"schedule: adaptive, re-routing around failed worker(s) {where}"
    schedule = "zb-h1" if args.schedule == "adaptive" else args.schedule
    why = " (adaptive with no failure is ZB-H1)" if args.schedule == "adaptive" else ""
    return failed, schedule, f"schedule: {schedule}, no failed worker{why}"


def compile_plan(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from schedcomp.compiler import compile

    failed, schedule, why = choose_schedule(args)
    print(why, flush=True)
    return compile(args.pp, args.dp, microbatches=args.microbatches, failed=failed, schedule=schedule, time_limit=5.0)


def launch(args: argparse.Namespace) -> int:
    plan = compile_plan(args)
    if args.plan or args.trace:  # a plan the user will read again (`show PLAN --measured TRACE`) is kept
        keep = Path(args.plan) if args.plan else Path(args.trace).with_suffix(".plan.json")
        return _run(args, plan, keep)
    with tempfile.TemporaryDirectory(prefix="schedcomp-demo-") as folder:  # removed however the run ends
        return _run(args, plan, Path(folder) / "plan.json")


def _run(args: argparse.Namespace, plan, plan_path: Path) -> int:  # type: ignore[no-untyped-def]
    from schedcomp.cli import main as schedcomp_cli

    plan_path.write_text(plan.to_json())
    schedcomp_cli(["show", str(plan_path), "--width", "100"])
    nprocs = len(plan.workers)
    failed = ", ".join(map(str, sorted(plan.topology.failed))) or "none"
    kept = f"; plan: {plan_path}" if args.plan or args.trace else ""
    print(f"\ntraining on {nprocs} processes (pp={args.pp}, dp={args.dp}, failed: {failed}, schedule: "
          f"{plan.family}){kept}\n", flush=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
               "-m", "schedcomp.runtime.demo", "--worker", str(plan_path), *_forwarded(args)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    status = subprocess.run(command, env=env).returncode
    if status == 0 and args.trace:
        print(f"\nmeasured timeline: {args.trace}\n  schedcomp show {plan_path} --measured {args.trace}\n"
              f"  schedcomp profile {args.trace} -o costs.json")
    return status


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--rows", str(args.rows), "--iterations", str(args.iterations), "--layers", str(args.layers),
           "--width", str(args.width)]
    return out + (["--trace", str(Path(args.trace).resolve())] if args.trace else [])


def train(args: argparse.Namespace) -> int:
    """One process of the job (run by torchrun)."""
    import torch

    from schedcomp.ir import Plan
    from schedcomp.runtime import PipelineTrainer
    from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, synthetic_batch

    torch.set_num_threads(1)
    plan = Plan.from_json(Path(args.worker).read_text())
    config = GPTConfig(n_layer=args.layers, n_embd=args.width, n_head=4)
    trainer = PipelineTrainer(plan, gpt(config, seed=0), lm_loss, lambda p: torch.optim.AdamW(p, lr=3e-3),
                              profile=bool(args.trace))
    rows = plan.topology.dp * plan.microbatches * args.rows
    tokens = rows * config.context
    talk = trainer.rank == 0
    if talk:
        print(f"GPT: {args.layers} blocks, width {args.width}, vocab {config.vocab}, context {config.context}; "
              f"{rows} sequences ({tokens} tokens) per iteration", flush=True)
    pending, last = None, time.perf_counter()
    for i in range(args.iterations):
        loss = trainer.step(synthetic_batch(config, rows, seed=i))
        now = time.perf_counter()
        period, last = now - last, now
        if talk and pending is not None:
            _report(*pending)
        pending = (i, loss, period, tokens)
    if talk and pending is not None:
        _report(*pending)
    if args.trace:
        trainer.save_trace(args.trace)
    trainer.close()
    return 0


def _report(iteration: int, loss: object, seconds: float, tokens: int) -> None:
    rate = tokens / seconds
    print(f"iteration {iteration:3d}  loss {float(loss):.4f}  {seconds * 1e3:7.1f} ms  {rate:9.0f} tokens/s",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="schedcomp: %(message)s")
    try:
        return train(args) if args.worker else launch(args)
    except SchedcompError as exc:
        print(f"schedcomp: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
