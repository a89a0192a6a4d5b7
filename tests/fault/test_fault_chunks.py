"""Resilient jobs with virtual stages: every chunk a worker holds is snapshotted, moved and checkpointed.

In one process: the keying (the step snapshot of several chunks, the state a donor sends as the
receiver decodes it, the per-chunk checkpoints: each restores exactly and never into another
chunk), the refusals, and `ResilientTrainer` on a one-worker job holding both chunks (a rollback
that undoes both chunks' steps; per-chunk checkpoints).

End to end, pp = 2, dp = 2 jobs with two chunks per worker (interleaved 1F1B, ZB-V; 4 processes,
CPU, gloo) under the launcher: a worker is SIGKILLed mid-iteration and respawned (the survivors
roll back and re-run on the re-routed chunked plan, the replacement receives both its chunks from
the live worker at its place, the job switches back to the family's fault-free plan), or both
workers of a place die (checkpoint-restart of every chunk). Every worker's chunks end equal to the
fault-free model trained in one process on the same batches (float64, 1e-10).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn

import pytest
import torch
import torch.nn.functional as F
from chaos_job import precompile_family
from fault_procs import run_job, state_digest
from momentum import Momentum
from resilient_procs import HERE, assert_matches_reference, assert_state_matches, chaos_reference
from scripted_session import ME, ScriptedSession, mse_reference
from torch import nn

from schedcomp import compile
from schedcomp.cache import PlanCache, precompile
from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.runtime.fault.boundary_log import LoggingPolicy
from schedcomp.runtime.fault.checkpoint import MANIFEST, checkpoint_dir, latest_complete
from schedcomp.runtime.fault.chunks import held_snapshot, held_state, load_held_state
from schedcomp.runtime.fault.restart import CheckpointPolicy, LastResort
from schedcomp.runtime.fault.rollback import Rollback
from schedcomp.runtime.fault.store import StoreAddress, WorkerEnv, serve_store
from schedcomp.runtime.fault.transfer import decode_header, encode_header, flatten, from_bytes, to_bytes, unflatten
from schedcomp.runtime.resilient import ResilientTrainer
from schedcomp.topology import Topology, Worker

PP, DP, MICROBATCHES, CHUNKS, ITERATIONS = 2, 2, 4, 2, 7
WIDTH = 3  # of the one-process job's model
FAMILIES = ("interleaved-1f1b", "zb-v")  # two chunks per worker, placed in a loop and in a V

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")]


def _held(seeds: dict[int, int]) -> dict[int, tuple]:
    """Chunks by virtual stage, each a module and optimizer of the same layout, trained apart."""
    held = {}
    for s, seed in seeds.items():
        torch.manual_seed(seed)
        module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).double()
        optimizer = Momentum(module.parameters())
        _train(module, optimizer, steps=seed % 3 + 1)
        held[s] = (module, optimizer)
    return held


def _train(module: nn.Module, optimizer: Momentum, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(8, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        module(x).square().mean().backward()
        optimizer.step()


def _digests(held: dict[int, tuple]) -> dict[int, str]:
    return {s: state_digest(m, o) for s, (m, o) in held.items()}


# ---- the keying, in one process ---------------------------------------------------------------------


def test_one_snapshot_undoes_the_step_of_every_chunk_exactly() -> None:
    held = _held({1: 1, 3: 2})  # place 1 of pp = 2 with loop placement: virtual stages 1 and 3
    before = _digests(held)
    snapshot = held_snapshot(held)
    snapshot.take(4)
    for module, optimizer in held.values():
        _train(module, optimizer, steps=1)
    assert all(_digests(held)[s] != before[s] for s in held)
    assert snapshot.restore() == 4
    assert _digests(held) == before


def test_the_state_sent_to_a_replacement_lands_in_the_same_chunks_only() -> None:
    donor, replacement = _held({0: 1, 3: 2}), _held({0: 5, 3: 6})  # place 0 of a V: virtual stages 0 and 3
    skeleton, tensors = flatten(held_state(donor))  # what `send_held_state` sends, decoded as `recv_tree` does
    got_skeleton, specs, _ = decode_header(encode_header(skeleton, tensors))
    state = unflatten(got_skeleton, from_bytes(to_bytes(tensors, torch.device("cpu")), specs))
    assert set(state) == {0, 3}
    load_held_state(replacement, state)
    assert _digests(replacement) == _digests(donor)  # bit-exact, each chunk from its own
    # the layouts are the same, so only the keys keep a chunk from landing in another worker's chunk
    other_place = _held({1: 7, 2: 8})
    with pytest.raises(RecoveryError, match=r"the state holds chunks \[0, 3\], this worker \[1, 2\]"):
        load_held_state(other_place, state)


def test_checkpoints_are_written_and_restored_per_chunk(tmp_path: Path) -> None:
    _server, address = serve_store()
    session = _session(address)
    held = _held({1: 1, 3: 2})
    saved = _digests(held)
    writer = LastResort(CheckpointPolicy(tmp_path), session)
    writer.after_step(0, held)
    writer.close()
    assert sorted(p.name for p in (tmp_path / "iter00000000").iterdir()) == ["stage1", "stage3"]
    # the other place's chunks, so that every virtual stage of the model has iteration 0
    other = LastResort(CheckpointPolicy(tmp_path), _session(address, Worker(0, 0)))
    other.after_step(0, _held({0: 3, 2: 4}))
    other.close()
    fresh = _held({1: 5, 3: 6})
    resumed = LastResort(CheckpointPolicy(tmp_path), session).resume(fresh, stages=PP * CHUNKS)
    assert resumed.restored_from == 0
    assert _digests(fresh) == saved
    # Swap the two chunks' directories: same layout, but each manifest names its virtual stage.
    a, b = checkpoint_dir(tmp_path, 0, 1), checkpoint_dir(tmp_path, 0, 3)
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    assert (a / MANIFEST).is_file()
    with pytest.raises(RecoveryError, match="has stage 3, expected 1"):
        LastResort(CheckpointPolicy(tmp_path), _session(address, run=2)).resume(_held({1: 7, 3: 8}), stages=4)


def _session(address: StoreAddress, worker: Worker | None = None, run: int = 1) -> SimpleNamespace:
    """What `LastResort` reads of a session: `worker` (default 0:1) of a pp = 2, dp = 1 job in run `run`."""
    worker = worker or Worker(0, 1)
    env = WorkerEnv(address, worker, PP, 1, 0, run=run)
    view = SimpleNamespace(topology=Topology.of(PP))
    return SimpleNamespace(env=env, me=worker, store=env.store.connect(), view=view)


@pytest.mark.parametrize(("option", "advice"), [
    ("lossy", "hold 2 chunks: use policy='rollback' (the default) with virtual stages"),
    ("logging", "hold 2 chunks: drop logging= (rollback, and checkpoint-restart when a place loses every worker)"),
    ("max_grad_norm", "run one stage per worker for now: compile a family without virtual stages"),
], ids=["lossy", "logging", "max_grad_norm"])
def test_what_works_one_stage_per_worker_is_refused_with_chunks_in_one_line(tmp_path: Path, option: str,
                                                                           advice: str) -> None:
    cache = precompile(PP, DP, MICROBATCHES, 0, chunks=CHUNKS, placement="v")
    options = {"lossy": {"policy": "lossy"}, "max_grad_norm": {"max_grad_norm": 1.0},
               "logging": {"logging": LoggingPolicy(tmp_path / "log"), "checkpoint": CheckpointPolicy(tmp_path)}}
    with pytest.raises(RuntimeSetupError) as refused:  # at construction: before joining the job
        ResilientTrainer(cache, _model(), F.mse_loss, Momentum, _batch, session=object(), **options[option])
    assert "\n" not in str(refused.value) and advice in str(refused.value)


# ---- the trainer in one process: one worker holding both chunks of a pp = 1 job ---------------------


class UndoingSession(ScriptedSession):
    """Each recovery undoes this worker's last step and re-runs that iteration (as when a peer had not
    stepped it yet)."""

    def rollback(self) -> Rollback:
        return Rollback(self.commits[ME], frozenset({ME}))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 1)).double()


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    rows = 4 * MICROBATCHES
    return (torch.randn(rows, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(rows, 1, generator=g, dtype=torch.float64))


def _refuse_to_leave(code: int) -> NoReturn:
    raise AssertionError(f"the job asked to leave the process with status {code}")  # not `os._exit` under pytest


@pytest.mark.parametrize("family", FAMILIES)
def test_one_worker_undoes_the_step_of_both_its_chunks_and_checkpoints_each(tmp_path: Path, family: str) -> None:
    plan = compile(1, 1, MICROBATCHES, schedule=family)
    failed: list[int] = []

    def before(iteration: int, index: int, _ins) -> None:
        if (iteration, index) == (2, 0) and not failed:  # after STEP of 1, which the recovery undoes
            failed.append(iteration)
            raise RuntimeError("Connection closed by peer")

    net = _model()  # split into its two chunks; they keep its layers
    # a plan source that is a function: the chunks are known from its first plan only, and built then
    trainer = ResilientTrainer(lambda _topology: plan, net, F.mse_loss, Momentum, _batch, session=UndoingSession(),
                               before=before, checkpoint=CheckpointPolicy(tmp_path))
    trainer.last_resort.leave = _refuse_to_leave
    try:
        trainer.run(ITERATIONS)
    finally:
        trainer.close()
    assert trainer.report is not None and failed == [2]
    assert [(r.rerun, r.undone) for r in trainer.report.recoveries] == [(1, True)]
    assert trainer.report.ledger == {i: [1.0] * MICROBATCHES for i in range(ITERATIONS)}  # one W per chunk, once
    assert sorted(trainer.states()) == [0, 1]
    for name, value in mse_reference(_model(), _batch, ITERATIONS).items():
        assert torch.allclose(net.state_dict()[name], value, rtol=0, atol=1e-10), name
    assert latest_complete(tmp_path, 2) == ITERATIONS - 1
    assert sorted(p.name for p in checkpoint_dir(tmp_path, 0, 0).parent.iterdir()) == ["stage0", "stage1"]


# ---- end to end -----------------------------------------------------------------------------------


def precompile_chunked(directory: Path, family: str) -> str:
    """The job's plan cache (every failure set of one worker, re-routed around it), whose fault-free
    plan is `family`'s own."""
    return precompile_family(directory, PP, DP, MICROBATCHES, 1, family)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "victim", "settle"), [
    # 1:1 dies halfway through its stream: no worker can step iteration 1 without it (each place's
    # all-reduce or backward waits for it), so nobody undoes anything.
    ("interleaved-1f1b", Worker(1, 1), False),
    # 1:0 (place 0: chunks 0 and 3, the V's ends) dies right before its all-reduce, once place 1
    # has stepped iteration 1 (CHAOS_SETTLE): a half-applied step, which place 1 undoes from the
    # snapshot of both its chunks (an LR schedule's state with them) before re-running it.
    ("zb-v", Worker(1, 0), True),
], ids=["interleaved-1f1b", "zb-v"])
def test_a_worker_holding_two_chunks_dies_mid_iteration_and_its_replacement_rejoins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, victim: Worker, settle: bool) -> None:
    cache_dir = precompile_chunked(tmp_path, family)
    plan = PlanCache.load(cache_dir).lookup([])
    assert plan.family == family and plan.topology.chunks == CHUNKS
    stream = plan.streams[victim]
    index = [str(ins) for ins in stream].index("ALLREDUCE") if settle else len(stream) // 2
    schedule = "step" if settle else None  # StepLR on every chunk's optimizer: undone and handed over too
    if settle:
        monkeypatch.setenv("CHAOS_SETTLE", "1")
        monkeypatch.setenv("CHAOS_SCHEDULE", schedule)
    # The survivors wait at iteration 2 until the replacement has announced itself; replacements enter
    # three iterations after the boundary that finds them (`agreement.switch_iteration`): at 4 or 5.
    worker_args = [str(HERE), "resilient", str(ITERATIONS), cache_dir, f"{victim}@1.{index}", "2"]
    results, _ = run_job(PP, DP, ["--respawn", "1"], worker_args, timeout=150.0)
    everyone = {str(w) for w in Topology.of(PP, DP).workers}
    reference = chaos_reference(PP * CHUNKS, DP * MICROBATCHES, ITERATIONS, schedule)
    if schedule:
        assert reference != chaos_reference(PP * CHUNKS, DP * MICROBATCHES, ITERATIONS)  # the schedule counts
    assert_matches_reference(results, reference, everyone, ITERATIONS, DP * MICROBATCHES)
    joined = results[str(victim)]
    assert joined["incarnation"] == 1 and joined["resumed_at"] in (4, 5)
    assert joined["rejoined"]["received_bytes"] > 0
    for w, r in results.items():
        worker = Worker.parse(w)
        assert set(r["states"]) == {str(s) for s in plan.topology.chunks_of(worker.stage)}  # each chunk it holds
        assert r["failed"] == []  # back on the fault-free plan
        assert r["lr"] == (0.05 * 0.5 ** (ITERATIONS // 2) if schedule else None)  # StepLR: halved every 2 steps
        if worker != victim:
            undone = settle and worker.stage != victim.stage
            assert [(rec["failed"], rec["rerun"], rec["undone"]) for rec in r["recoveries"]] == [
                ([str(victim)], 1, undone)], w
            assert r["admitted"] == [joined["resumed_at"]]


@pytest.mark.slow
def test_losing_every_worker_of_a_place_restarts_every_chunk_from_its_checkpoint(tmp_path: Path) -> None:
    # ZB-V: place 0 holds chunks 0 and 3, the V's two ends. Both its workers die right before their
    # STEP of iteration 2, once place 1 stepped and checkpointed it (`settle`): chunks 1 and 2 have a
    # checkpoint of 2, chunks 0 and 3 only of 1, so the restarted run restores every chunk from 1.
    cache_dir, ckpt = precompile_chunked(tmp_path / "plans", "zb-v"), tmp_path / "ckpt"
    plan = PlanCache.load(cache_dir).lookup([])
    spec = ",".join(f"{w}@2.{len(plan.streams[w]) - 1}" for w in (Worker(0, 0), Worker(1, 0)))
    iterations = 5
    results, err = run_job(PP, DP, ["--max-restarts", "1"],
                           [str(HERE), "restart", str(iterations), cache_dir, str(ckpt), spec, "replan", "1"], 150.0)
    assert set(results) == {str(w) for w in Topology.of(PP, DP).workers}, err[-6000:]
    reference = chaos_reference(PP * CHUNKS, DP * MICROBATCHES, iterations)
    for w, r in results.items():
        assert (r["run"], r["restored_from"], r["iterations_lost"]) == (1, 1, 1), w
        assert sorted(map(int, r["ledger"])) == [2, 3, 4]
        assert set(r["states"]) == {str(s) for s in plan.topology.chunks_of(Worker.parse(w).stage)}
        assert_state_matches(r, reference)
    assert latest_complete(ckpt, PP * CHUNKS) == iterations - 1  # every chunk kept checkpointing
