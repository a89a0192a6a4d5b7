"""Worker processes of resilient jobs (`ResilientTrainer`) for the chaos tests and `bench/bench_fault.py`.

Run as `python tests/support/resilient_procs.py resilient ITERATIONS CACHE_DIR VICTIMS [HOLD]` under
`python -m schedcomp.runtime.fault.launch`; each worker prints one JSON line with its report and
its stage's final state. `chaos_reference` trains the same model fault-free in one process.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

from fault_procs import child_deadline, emit, setup_logging

HERE = Path(__file__).resolve()

H, ROWS = 8, 2  # hidden size, rows per micro-batch


def chaos_stage(stage: int, pp: int):
    import torch
    from torch import nn

    torch.manual_seed(100 + stage)
    layers = [nn.Linear(H, H), nn.Tanh()] if stage < pp - 1 else [nn.Linear(H, H)]
    return nn.Sequential(*layers).double()


def chaos_sequential(layers: int):
    """The model of a job whose plans move layers (`runtime.moves`): `layers` Linear + Tanh blocks in one
    `nn.Sequential`, which the trainer cuts by each plan's partition."""
    import torch
    from torch import nn

    torch.manual_seed(77)
    return nn.Sequential(*(nn.Sequential(nn.Linear(H, H), nn.Tanh()) for _ in range(layers))).double()


def adam(params):
    import torch

    return torch.optim.Adam(params, lr=0.01)


def moves_reference(layers: int, chunks: int, iterations: int) -> list[dict]:
    """`chaos_sequential` trained fault-free in one process with `adam`: each layer's state."""
    import torch.nn.functional as F

    model = chaos_sequential(layers)
    optimizer = adam(model.parameters())
    for i in range(iterations):
        x, y = chaos_batch(i, chunks)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [{k: v.tolist() for k, v in layer.state_dict().items()} for layer in model]


def chaos_batch(iteration: int, chunks: int):
    """Iteration i's global batch: the same samples whenever it is asked for again."""
    import torch

    g = torch.Generator().manual_seed(10_000 + iteration)
    return (torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64),
            torch.randn(chunks * ROWS, H, generator=g, dtype=torch.float64))


def chaos_reference(pp: int, chunks: int, iterations: int, schedule: str | None = None,
                    max_norm: float | None = None) -> list[dict]:
    """The fault-free model, trained in one process on the same global batches (with `schedule`, a
    `training_models.SCHEDULES` LR schedule per stage; with `max_norm`, `clip_grad_norm_` on the whole model)."""
    import torch
    import torch.nn.functional as F
    from momentum import ScheduledMomentum  # imports torch: only once the child's deadline is armed
    from training_models import SCHEDULES

    stages = [chaos_stage(s, pp) for s in range(pp)]
    optimizers = [ScheduledMomentum(m.parameters()) for m in stages]
    schedulers = [SCHEDULES[schedule](o) for o in optimizers] if schedule else []
    for i in range(iterations):
        x, y = chaos_batch(i, chunks)
        for m in stages:
            x = m(x)
        F.mse_loss(x, y).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for m in stages for p in m.parameters()], max_norm)
        for o in optimizers:
            o.step()
            o.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    return [{k: v.tolist() for k, v in m.state_dict().items()} for m in stages]


def assert_matches_reference(results: dict[str, dict], reference: list[dict], expected: set[str], iterations: int,
                             chunks: int, tolerance: float = 1e-10) -> None:
    """Every worker of `expected` reported; each replica's stage (every chunk it holds, with virtual
    stages: `reference` then has one entry per virtual stage) equals the fault-free `reference`
    (float64, `tolerance`); its ledger shows every micro-batch entered each iteration's update
    exactly once; and all of them ended in the same generation."""
    assert set(results) == expected, sorted(results)
    for r in results.values():
        assert r["iterations"] == iterations
        assert_state_matches(r, reference, tolerance)
        first = r["resumed_at"] or 0
        assert sorted(map(int, r["ledger"])) == list(range(first, iterations)), r["worker"]
        for i, counts in r["ledger"].items():
            assert counts == [1.0] * chunks, (r["worker"], i, counts)
    assert len({r["generation"] for r in results.values()}) == 1


def assert_state_matches(result: dict, reference: list[dict], tolerance: float = 1e-10) -> None:
    """A worker's stage (every chunk it holds, by virtual stage, with virtual stages) equals the
    fault-free `reference` (one entry per (virtual) stage), float64, within `tolerance`."""
    held = result.get("states") or {result["worker"].split(":")[1]: result["state"]}
    for stage, state in held.items():
        for name, value in reference[int(stage)].items():
            diff = max(abs(a - b) for a, b in zip(flat(state[name]), flat(value), strict=True))
            assert diff <= tolerance, (result["worker"], stage, name, diff)


def flat(x) -> list[float]:
    """The numbers of a nested list (a tensor's `tolist()`), in order."""
    return [v for item in x for v in flat(item)] if isinstance(x, list) else [x]


def lossy_reference(pp: int, chunks: int, iterations: int, held: dict[int, dict[int, set[int]]]) -> list[dict]:
    """The model the lossy policy trains: stage s's update in iteration i is the mean gradient over the
    global-batch chunks in `held[i][s]` (all chunks for iterations not in `held`), one process."""
    import torch
    import torch.nn.functional as F
    from momentum import Momentum  # imports torch: only once the child's deadline is armed

    stages = [chaos_stage(s, pp) for s in range(pp)]
    optimizers = [Momentum(m.parameters()) for m in stages]
    for i in range(iterations):
        x, y = chaos_batch(i, chunks)
        rows = x.shape[0] // chunks
        keep = held.get(i, {})
        sums = [[torch.zeros_like(p) for p in m.parameters()] for m in stages]
        for c in range(chunks):
            out = x[c * rows:(c + 1) * rows]
            for m in stages:
                out = m(out)
            F.mse_loss(out, y[c * rows:(c + 1) * rows]).backward()
            for s, m in enumerate(stages):
                for acc, p in zip(sums[s], m.parameters(), strict=True):
                    if c in keep.get(s, range(chunks)):
                        acc += p.grad
                    p.grad = None
        for s, (m, o) in enumerate(zip(stages, optimizers, strict=True)):
            n = len(keep.get(s, range(chunks)))
            for acc, p in zip(sums[s], m.parameters(), strict=True):
                p.grad = acc / n if n else None  # a stage left with no micro-batch does not step
            o.step()
            o.zero_grad()
    return [{k: v.tolist() for k, v in m.state_dict().items()} for m in stages]


def held_layers(trainer, iterations: int) -> dict[str, float]:
    """The layers a `PipelineTrainer` holds (its own pipeline's span: a re-formed pipeline's worker holds more), by
    model index, each its largest difference from `moves_reference` (computed here: a whole state per layer
    would make the result line too long to write at once)."""
    first = trainer.held_layers.start
    chunks = trainer.dp * trainer.plan.microbatches
    want = moves_reference(len(trainer.model), chunks, iterations)
    return {str(first + k): max(_largest_difference(v.tolist(), want[first + k][name])
                                for name, v in layer.state_dict().items())
            for k, layer in enumerate(trainer.stage.module)}


def _largest_difference(a, b) -> float:
    return max(abs(x - y) for x, y in zip(flat(a), flat(b), strict=True))


def parse_victims(spec: str) -> tuple[dict, dict]:
    """`d:s@it.idx,...` (die before instruction idx of iteration it), `d:s@rec` (die while recovering)
    and `d:s@end` (die once training is over, after the final meeting; in `recovering` as "end")."""
    from schedcomp.topology import Worker

    at, recovering = {}, {}
    for item in filter(None, spec.split(",")):
        who, _, where = item.partition("@")
        if where in ("rec", "end"):
            recovering[Worker.parse(who)] = where
        else:
            it, _, idx = where.partition(".")
            at[Worker.parse(who)] = (int(it), int(idx))
    return at, recovering


def scenario_resilient(iterations: str, cache_dir: str, victims: str, hold: str = "-1") -> None:
    """One worker of a resilient job (launched by `fault.launch`): train, print the stage and ledger.

    `victims`: see `parse_victims`. `hold`: at the start of that iteration, while some worker is
    failed, wait until its replacement has announced itself (so that it is admitted in time).
    Environment: CHAOS_DETECTION, the detection time (default 15 s); CHAOS_GATES, iterations
    (comma-separated) at whose start every worker counts itself in `at_gate/G` and waits for the
    key `gate/G` (the harness cuts or kills hosts while the job stands still there); CHAOS_SETTLE=1:
    a victim, at its point, first waits until every worker at another place of the pipelines has
    committed that iteration (so that they stepped it when it dies: a half-applied step).
    """
    import functools

    import torch
    import torch.nn.functional as F
    from momentum import Momentum  # imports torch: only once the child's deadline is armed

    from schedcomp.cache import PlanCache
    from schedcomp.runtime.fault.agreement import pending_joins
    from schedcomp.runtime.fault.inject import kill_at
    from schedcomp.runtime.fault.session import FaultSession
    from schedcomp.runtime.fault.store import Keys, WorkerEnv, get_int
    from schedcomp.runtime.resilient import ResilientTrainer

    setup_logging()
    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    if str(env.worker) == os.environ.get("CHAOS_ABSENT") and env.incarnation == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # dies before joining: the job starts without it
    cache = PlanCache.load(cache_dir)
    chunks = env.dp * cache.microbatches
    at, recovering = parse_victims(victims)
    # CHAOS_IMPROVE=W: plans from `ImprovingPlans` (a miss is repaired, then compiled in the background);
    # at the start of iteration W each worker waits for its compile, so the switch comes at a known point
    improve_at = int(os.environ.get("CHAOS_IMPROVE", "-1"))
    plans = cache
    if improve_at >= 0:
        from schedcomp.improving import ImprovingPlans

        plans = ImprovingPlans(cache, time_limit=1.0)

    def die_while_recovering(rerun: int) -> None:
        if recovering.get(env.worker) == "rec" and env.incarnation == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    # generous detection: under a loaded CI box heartbeats must not time out; deaths of local
    # workers are seen at once through the launcher's death notices anyway. CHAOS_GROUP_TIMEOUT: how
    # long a gloo operation waits on a peer; a host cut off mid-operation leaves that wait blocked
    # until then, and leaving the job (`FaultSession.close`) waits it out.
    session = FaultSession(env, detection_time=float(os.environ.get("CHAOS_DETECTION", "15")),
                           group_timeout=float(os.environ.get("CHAOS_GROUP_TIMEOUT", "30")),
                           agree_timeout=90.0, backend=os.environ.get("CHAOS_BACKEND", "gloo"))  # tests/gpu: "nccl"
    kill = kill_at(at, env.worker, env.incarnation)
    gates = {int(g) for g in os.environ.get("CHAOS_GATES", "").split(",") if g}
    settle = os.environ.get("CHAOS_SETTLE") == "1"

    def before(iteration: int, index: int, ins) -> None:
        if iteration in gates and index == 0:
            session.store.add(f"at_gate/{iteration}", 1)
            deadline = time.monotonic() + child_deadline()
            while not session.store.check([f"gate/{iteration}"]) and time.monotonic() < deadline:
                time.sleep(0.01)
        if iteration == int(hold) and index == 0 and session.view.failed:
            deadline = time.monotonic() + 60
            while not pending_joins(session.store, session.view) and time.monotonic() < deadline:
                time.sleep(0.01)
        if iteration == improve_at and index == 0 and session.view.failed:
            # every survivor waits here, in the store, until all have compiled: none waits inside a gloo
            # operation on a neighbour still compiling (that wait is bounded by the group timeout)
            deadline = time.monotonic() + child_deadline()
            while plans.pending(session.view.topology) and time.monotonic() < deadline:
                time.sleep(0.01)
            session.store.add("compiled", 1)
            while session.store.add("compiled", 0) < len(session.view.members) and time.monotonic() < deadline:
                time.sleep(0.01)
        if kill is not None:
            if settle and (iteration, index) >= at[env.worker]:
                others = [w for w in session.view.members if w.stage != env.worker.stage]
                deadline = time.monotonic() + 60
                while (any(get_int(session.store, Keys.commit(w)) < iteration for w in others)
                       and time.monotonic() < deadline):
                    time.sleep(0.005)
            if (iteration, index) >= at[env.worker] and not session.store.check(["killed_at"]):
                session.store.set("killed_at", repr(time.time()))  # for the benchmark's recovery times
            kill(iteration, index, ins)

    # CHAOS_SCHEDULE (a `training_models.SCHEDULES` name), CHAOS_MAX_NORM: the training-loop options
    schedule, max_norm = os.environ.get("CHAOS_SCHEDULE"), os.environ.get("CHAOS_MAX_NORM")
    options = {}
    if schedule or max_norm:
        from momentum import ScheduledMomentum
        from training_models import SCHEDULES

        Momentum = ScheduledMomentum
        options = {"lr_scheduler": SCHEDULES[schedule] if schedule else None,
                   "max_grad_norm": float(max_norm) if max_norm else None}
    # with virtual stages the model has pp x chunks stages, each worker builds its chunks; CHAOS_MOVES=L: an
    # L-layer nn.Sequential trained with Adam, cut by each plan's partition (layers move at a switch)
    layers = int(os.environ.get("CHAOS_MOVES", "0"))
    if layers:
        build, Momentum = chaos_sequential(layers), adam
    else:
        build = functools.partial(chaos_stage, pp=env.pp * cache.chunks)
    if os.environ.get("CHAOS_CHECKPOINT"):  # a directory: checkpoint every iteration there
        from schedcomp.runtime.fault.restart import CheckpointPolicy

        options["checkpoint"] = CheckpointPolicy(os.environ["CHAOS_CHECKPOINT"], every=1)
    trainer = ResilientTrainer(plans, build, F.mse_loss, Momentum,
                               lambda i: chaos_batch(i, chunks), session=session, before=before,
                               after_recovery=die_while_recovering, policy=os.environ.get("CHAOS_POLICY", "rollback"),
                               **options)
    report = trainer.run(int(iterations))
    if recovering.get(env.worker) == "end":
        os.kill(os.getpid(), signal.SIGKILL)
    emit({"worker": str(env.worker), "incarnation": env.incarnation, "iterations": report.iterations,
          "skipped": {str(i): v for i, v in report.skipped.items()},
          "skipped_samples": {str(i): v for i, v in report.skipped_samples.items()},
          "generation": report.generation, "failed": list(report.failed),
          "state": {k: v.tolist() for k, v in trainer.state().items()} if not layers else None,
          "states": {str(s): {k: v.tolist() for k, v in state.items()} for s, state in trainer.states().items()}
          if not layers else None,
          "ledger": {str(i): v for i, v in report.ledger.items()},
          "recoveries": [r.__dict__ for r in report.recoveries], "admitted": report.admitted,
          "improved": report.improved, "plan_solver": trainer.trainer.plan.solver if trainer.trainer else None,
          "resumed_at": report.resumed_at, "handed_over": report.handed_over,
          "rejoined": report.rejoined.__dict__ if report.rejoined is not None else None,
          "completed_at": {str(i): t for i, t in report.completed_at.items()},
          "killed_at": float(session.store.get("killed_at")) if session.store.check(["killed_at"]) else None,
          "device": str(trainer.trainer.device) if trainer.trainer is not None else None,
          "lr": trainer.trainer.stage.optimizer.param_groups[0]["lr"] if schedule else None,
          "updates": {str(i): u for i, u in report.updates.items()},
          "layers": held_layers(trainer.trainer, report.iterations) if layers else None,
          "partitions": trainer.trainer.plan.partitions if trainer.trainer is not None else None})
    trainer.close()


def restarting_worker(cache_dir: str, victims: str):
    """What a worker of a job with restarts sets up: its environment, the store shared by every run
    (`root`), the plan cache, the victims' points, its session, and its `kill_at` hook (run 0 only)."""
    import torch

    from schedcomp.cache import PlanCache
    from schedcomp.runtime.fault.inject import kill_at
    from schedcomp.runtime.fault.session import FaultSession
    from schedcomp.runtime.fault.store import StoreAddress, WorkerEnv

    setup_logging()
    torch.set_num_threads(1)
    env = WorkerEnv.from_env()
    root = StoreAddress(env.store.host, env.store.port).connect()  # keys shared by every run
    cache = PlanCache.load(cache_dir)
    at, _ = parse_victims(victims)
    session = FaultSession(env, detection_time=15.0, group_timeout=30.0, agree_timeout=90.0,
                           backend=os.environ.get("CHAOS_BACKEND", "gloo"))  # tests/gpu: "nccl"
    kill = kill_at(at, env.worker, env.incarnation) if env.run == 0 else None
    return env, root, cache, at, session, kill


def scenario_restart(iterations: str, cache_dir: str, ckpt_dir: str, victims: str, on_failure: str = "replan",
                     settle: str = "0") -> None:
    """One worker of a job with checkpoints every iteration (`fault.restart`); victims die in run 0 only.

    `settle` = "1": each victim first waits for its own checkpoint in flight, for the other
    victims of its iteration to reach their point, and for every worker that is no victim to
    commit that iteration, so that what the restart finds (checkpoints, commits) does not depend
    on timing.
    """
    import functools

    import torch.nn.functional as F
    from momentum import Momentum  # imports torch: only once the child's deadline is armed

    from schedcomp.runtime.fault.restart import CheckpointPolicy
    from schedcomp.runtime.fault.store import Keys, get_int
    from schedcomp.runtime.resilient import ResilientTrainer

    started = time.time()  # the process is up and torch imported (the benchmark's relaunch time)
    env, root, cache, at, session, kill = restarting_worker(cache_dir, victims)

    def before(iteration: int, index: int, ins) -> None:
        if kill is None or (iteration, index) < at[env.worker]:
            return
        if settle == "1":
            trainer.last_resort.close()
            ready, peers = f"victims_ready/{iteration}", [w for w, (it, _) in at.items() if it == iteration]
            root.add(ready, 1)
            others = [w for w in session.view.members if w not in at]
            deadline = time.monotonic() + 60

            def settled() -> bool:
                return root.add(ready, 0) >= len(peers) and all(
                    get_int(session.store, Keys.commit(w)) >= iteration for w in others)

            while not settled() and time.monotonic() < deadline:
                time.sleep(0.005)
        if not root.check(["killed_at"]):
            root.set("killed_at", repr(time.time()))
        kill(iteration, index, ins)

    trainer = ResilientTrainer(cache, functools.partial(chaos_stage, pp=env.pp * cache.chunks), F.mse_loss, Momentum,
                               lambda i: chaos_batch(i, env.dp * cache.microbatches), session=session,
                               before=before, checkpoint=CheckpointPolicy(ckpt_dir, every=1, on_failure=on_failure),
                               policy=os.environ.get("CHAOS_POLICY", "rollback"))
    report = trainer.run(int(iterations))
    previous = session.store.get(Keys.previous_run()).decode() if session.store.check([Keys.previous_run()]) else None
    emit({"worker": str(env.worker), "run": report.run, "iterations": report.iterations,
          "restored_from": report.restored_from, "iterations_lost": report.iterations_lost,
          "previous": previous, "generation": report.generation, "failed": list(report.failed),
          "state": {k: v.tolist() for k, v in trainer.state().items()},
          "states": {str(s): {k: v.tolist() for k, v in state.items()} for s, state in trainer.states().items()},
          "ledger": {str(i): v for i, v in report.ledger.items()},
          "recoveries": [r.__dict__ for r in report.recoveries],
          "skipped_samples": {str(i): n for i, n in report.skipped_samples.items()},
          "completed_at": {str(i): t for i, t in report.completed_at.items()}, "started_at": started,
          "killed_at": float(root.get("killed_at")) if root.check(["killed_at"]) else None})
    trainer.close()


SCENARIOS = {"resilient": scenario_resilient, "restart": scenario_restart}

if __name__ == "__main__":
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(child_deadline(), exit=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
