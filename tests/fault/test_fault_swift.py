"""Logging-based recovery (`fault.swift`, `fault.boundary_log`): a stage that lost every replica is rebuilt by replay.

The end-to-end tests launch pp = 4 jobs (CPU/gloo) with checkpoints every 2 iterations and kill
every replica of one stage at a seeded random point: the job completes with exactly the
fault-free model, the survivors never restart (run 0, nothing restored), and the replacement
replayed the iterations since its stage's checkpoint. Two adjacent lost stages fall back to a
restart from the checkpoints. The other tests check the pieces in one process.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
from fault_procs import run_job
from resilient_procs import HERE, chaos_batch, chaos_reference, chaos_stage
from stream_models import noisy_stage, stream_reference
from torch import nn

from schedcomp.cache import precompile
from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError
from schedcomp.runtime.data import chunk_index, micro_batch
from schedcomp.runtime.fault.boundary_log import BoundaryLog, LoggingPolicy
from schedcomp.runtime.fault.restart import CheckpointPolicy
from schedcomp.runtime.fault.swift import SwiftPolicy, _gap, lost_stages, replay, replay_sources
from schedcomp.runtime.fault.swift_parallel import choose_helpers, replay_seconds, shares
from schedcomp.runtime.resilient import recovery_policy
from schedcomp.runtime.rng import stream_seed
from schedcomp.runtime.stage import Stage
from schedcomp.semantics import ACT, GRAD
from schedcomp.topology import Topology, Worker

TOLERANCE = 1e-10
SWIFT = str(HERE.parent / "swift_procs.py")

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled.*:UserWarning")]


# ---- the policy and the log ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{"budget_bytes": -1}, {"budget_bytes": 1.5}, {"boundaries": "some"},
                                    {"boundaries": [0, -1]}, {"where": ""}])
def test_bad_logging_policy_is_one_clear_error(kwargs: dict) -> None:
    with pytest.raises(RecoveryError):
        LoggingPolicy(**kwargs)


def test_logging_needs_a_checkpoint_and_the_default_policy(tmp_path: Path) -> None:
    logging = LoggingPolicy()
    assert isinstance(recovery_policy("rollback", CheckpointPolicy(tmp_path), logging), SwiftPolicy)
    with pytest.raises(RecoveryError, match="checkpoint"):
        recovery_policy("rollback", None, logging)
    with pytest.raises(RecoveryError, match="no other policy"):
        recovery_policy("lossy", CheckpointPolicy(tmp_path), logging)


def test_selective_logging_says_which_stages_can_be_replayed() -> None:
    policy = LoggingPolicy(boundaries=[1, 0])
    assert policy.boundaries == (0, 1)
    assert [policy.replayable(s, 4) for s in range(4)] == [True, True, False, False]
    assert LoggingPolicy().replayable(2, 4)


def _sent(iteration: int, stage: int, chunks: int = 2) -> dict:
    """What worker (0, stage) sends in one iteration: activations onward, gradients back (8 float64 each)."""
    out = {}
    for m in range(chunks):
        out[(ACT, stage, (0, m))] = (torch.full((8,), float(100 * iteration + m), dtype=torch.float64),)
        if stage > 0:
            out[(GRAD, stage, (0, m))] = (torch.full((8,), -float(100 * iteration + m), dtype=torch.float64),)
    return out


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_the_log_keeps_what_was_sent_per_receiving_stage(tmp_path: Path, where: str) -> None:
    log = BoundaryLog(LoggingPolicy(where if where == "memory" else tmp_path / "log"), Worker(0, 1))
    for it in range(3):
        assert log.add(it, _sent(it, 1)) == 2 * 2 * 64  # 2 chunks x 2 directions x 64 bytes
    assert log.coverage(2, [1, 5]) == {1: [(0, 0), (0, 1)], 5: []}
    rows = log.entries(0, [2])  # the gradients sent back to stage 0 in iteration 2
    assert [(j, p, m) for j, p, m, _ in rows] == [(2, 0, 0), (2, 0, 1)]
    assert torch.equal(rows[1][3][0], torch.full((8,), -201.0, dtype=torch.float64))
    log.prune(2, 1)  # stage 2's checkpoints made iterations 0 and 1 useless for it
    assert log.coverage(2, range(3)) == {0: [], 1: [], 2: [(0, 0), (0, 1)]}
    assert log.coverage(0, [0])[0]  # stage 0's entries stay
    log.discard_from(2)
    assert log.held == 2 * 128 and log.peak == 3 * 256
    if where == "disk":
        assert len(list((tmp_path / "log" / "w0_1").iterdir())) == 2 * 2  # header and bytes of two entries


def test_over_budget_the_oldest_iterations_go_and_leave_a_gap() -> None:
    log = BoundaryLog(LoggingPolicy(budget_bytes=2 * 256), Worker(0, 1))
    for it in range(4):
        log.add(it, _sent(it, 1))
    assert log.held <= 2 * 256
    assert log.coverage(2, range(4)) == {0: [], 1: [], 2: [(0, 0), (0, 1)], 3: [(0, 0), (0, 1)]}
    assert log.gaps == {0: 1, 2: 1}


def test_selective_logging_logs_only_the_listed_boundaries() -> None:
    log = BoundaryLog(LoggingPolicy(boundaries=[1]), Worker(0, 1))
    assert log.add(0, _sent(0, 1)) == 128  # only the activations over boundary 1
    assert log.coverage(0, [0]) == {0: []}


def test_a_gap_in_the_neighbours_logs_is_found() -> None:
    every = [[0, 0], [0, 1]]
    records = {Worker(0, 0): {"1": {"3": every, "4": every}}, Worker(0, 2): {"1": {"3": every, "4": [[0, 1]]}}}
    assert _gap(records, {1: 2}, 5, 3, 1, 2) == "stage 2 holds 1 of the 2 chunks it sent stage 1 in iteration 4"
    records[Worker(0, 2)]["1"]["4"] = every
    assert _gap(records, {1: 2}, 5, 3, 1, 2) is None
    records[Worker(0, 0)].update({"1": {"4": every}, "dropped": {"1": 3}})  # the budget dropped its iteration 3
    assert _gap(records, {1: 2}, 5, 3, 1, 2) == \
        "stage 0 holds 0 of the 2 chunks it sent stage 1 in iteration 3, dropped over the log budget"
    assert lost_stages(Topology.of(3, 2, [Worker(0, 1), Worker(1, 1)])) == [1]


def test_replay_falls_back_when_it_cannot_rebuild_the_stage() -> None:
    every, complete = LoggingPolicy(), {1: [1, 3, 5], 2: [1, 3], 3: [3]}
    assert replay_sources([1], 4, every, complete, 5) == ({1: 3}, None)  # newest before the re-run, not 5
    no_checkpoint = "no checkpoint of a lost stage before the iteration to re-run"
    assert replay_sources([1, 3], 4, every, complete, 3) == ({1: 1, 3: -1}, no_checkpoint)
    assert replay_sources([1, 2], 4, every, complete, 5)[1] == "adjacent stages lost"
    assert replay_sources([2], 4, LoggingPolicy(boundaries=[1]), complete, 5)[1] == \
        "a lost stage's boundaries are not logged"
    assert replay_sources([0], 4, LoggingPolicy(boundaries=[0]), {0: [0]}, 5) == ({0: 0}, None)


# ---- replay against the fault-free model ---------------------------------------------------------------------


class _Noisy(nn.Module):
    """A stage with dropout: its replay is exact only when each micro-batch draws from its own stream."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.drop = inner, nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.inner(x))


def _stages(pp: int, noisy: int) -> list[Stage]:
    import torch.nn.functional as F
    from momentum import Momentum

    out = []
    for s in range(pp):
        module = chaos_stage(s, pp)
        out.append(Stage(s, pp, _Noisy(module) if s == noisy else module, F.mse_loss if s == pp - 1 else None,
                         Momentum))
    return out


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("lost", [0, 1, 3])
def test_replay_from_the_logs_rebuilds_the_fault_free_stage(dp: int, lost: int) -> None:
    pp, microbatches, iterations, source, seed = 4, 2, 5, 1, 77
    chunks = dp * microbatches
    stages = _stages(pp, noisy=lost)
    inputs: dict = {}
    grads: dict = {}
    saved = None
    for j in range(iterations):  # GPipe in one process, chunks backwards: the replay runs them forwards
        x_all, y_all = chaos_batch(j, chunks)
        acts = {}
        for p in range(dp):
            for m in range(microbatches):
                acts[(p, m)] = (micro_batch(x_all, chunk_index(p, m, microbatches), chunks),)
        for stage in stages:
            torch.rand(3)  # the global stream moves on between stages: nothing may depend on it
            for key in sorted(acts, reverse=True):
                p, m = key
                if stage.index == lost:
                    inputs.setdefault(j, {})[key] = tuple(t.clone() for t in acts[key])
                y = micro_batch(y_all, chunk_index(p, m, microbatches), chunks) if stage.is_last else None
                acts[key] = stage.forward(key, tuple(t.clone() for t in acts[key]), y, scale=1.0 / chunks,
                                          seed=stream_seed(seed, j, stage.index, p, m))
        back = {key: () for key in acts}
        for stage in reversed(stages):
            for key in sorted(back):
                if stage.index == lost:
                    grads.setdefault(j, {})[key] = back[key]
                back[key] = stage.backward(key, back[key], split=False)
        for stage in stages:
            stage.step()
        if j == source:
            saved = {k: v.clone() for k, v in stages[lost].module.state_dict().items()}, \
                {i: b.clone() for i, b in stages[lost].optimizer.buffers.items()}
    replacement = _stages(pp, noisy=lost)[lost]
    assert saved is not None
    replacement.module.load_state_dict(saved[0])
    replacement.optimizer.buffers = saved[1]
    replay(replacement, range(source + 1, iterations), inputs, grads, seed, lambda j: chaos_batch(j, chunks), dp,
           microbatches, torch.device("cpu"))
    for name, value in stages[lost].module.state_dict().items():
        assert (replacement.module.state_dict()[name] - value).abs().max().item() <= TOLERANCE, name
    assert not torch.equal(replacement.module.state_dict()["inner.0.weight"],
                           saved[0]["inner.0.weight"])  # it did train


# ---- end to end ------------------------------------------------------------------------------------------------


def _launch(tmp_path: Path, pp: int, dp: int, victims: str, iterations: int, every: int = 2,
            budget: int = 1 << 30, noisy: bool = False, helpers: int = 0,
            helper_dies: str = "none") -> tuple[dict, str]:
    plans, ckpt = tmp_path / "plans", tmp_path / "ckpt"
    precompile(pp, dp, 4, dp - 1, directory=plans, time_limit=1.0)
    return run_job(pp, dp, ["--respawn", "1", "--max-restarts", "1"],
                   [SWIFT, str(iterations), str(plans), str(ckpt), victims, str(every), "memory", str(budget), "8",
                    "1" if noisy else "0", str(helpers), helper_dies], 240)


def _assert_fault_free(results: dict, pp: int, dp: int, iterations: int, noisy: bool = False) -> None:
    """Every worker's stage equals the fault-free model's (`noisy`: the model with dropout, `stream_models`)."""
    assert set(results) == {str(w) for w in Topology.of(pp, dp).workers}
    if noisy:
        reference = [{k: v.tolist() for k, v in state.items()} for state in stream_reference(
            functools.partial(noisy_stage, pp=pp), pp, dp, 4, iterations, lambda i: chaos_batch(i, dp * 4))]
    else:
        reference = chaos_reference(pp, dp * 4, iterations)
    for r in results.values():
        assert r["iterations"] == iterations
        for name, value in reference[Worker.parse(r["worker"]).stage].items():
            diff = (torch.tensor(r["state"][name]) - torch.tensor(value)).abs().max().item()
            assert diff <= TOLERANCE, (r["worker"], name, diff)


def _assert_rebuilt_by_replay(results: dict, lost: int, every: int, err: str, helped: bool = False) -> None:
    """The survivors never restarted nor restored anything; the replacements replayed since the checkpoint
    (`helped`: some survivors replayed with them, checked by `_assert_helped`)."""
    rebuilt = [r for r in results.values() if Worker.parse(r["worker"]).stage == lost]
    for r in results.values():
        assert r["run"] == 0, (r["worker"], r["restart_reason"], err[-8000:])
        if r in rebuilt:
            source, start = r["restored_from"], r["resumed_at"]
            assert r["incarnation"] == 1 and source is not None and (source + 1) % every == 0
            assert r["replayed"] == list(range(source + 1, start))
            assert sorted(map(int, r["ledger"])) == list(range(start, r["iterations"]))
        else:
            assert r["restored_from"] is None and (helped or r["replayed"] == [])
            assert r["recoveries"][-1]["method"] == "swift"
            assert sorted(map(int, r["ledger"])) == list(range(r["iterations"]))  # nothing rolled back to a checkpoint
            assert r["log_peak"] > 0


@pytest.mark.slow
def test_a_lost_stage_of_a_dp1_pipeline_with_dropout_is_rebuilt_by_replay(tmp_path: Path) -> None:
    # dropout in every stage: the replay draws each micro-batch's masks again from its stream
    rng = random.Random(13)
    lost, iteration, index = rng.choice([1, 2]), rng.randrange(3, 5), rng.randrange(0, 16)
    results, err = _launch(tmp_path, 4, 1, f"0:{lost}@{iteration}.{index}", 6, noisy=True)
    assert "Traceback" not in err, err[-6000:]
    _assert_fault_free(results, 4, 1, 6, noisy=True)
    _assert_rebuilt_by_replay(results, lost, 2, err)


@pytest.mark.slow
def test_both_replicas_of_a_stage_lost_in_a_dp2_job_are_rebuilt_by_replay(tmp_path: Path) -> None:
    # pp = 3 keeps it cheap; the replicas die one after the other, the stage is lost before the
    # first replacement can be admitted (no earlier than two boundaries later, `switch_iteration`)
    rng = random.Random(29)
    lost, iteration = 1, rng.randrange(3, 5)
    victims = f"0:{lost}@{iteration}.{rng.randrange(0, 20)},1:{lost}@{iteration + 1}.{rng.randrange(0, 20)}"
    results, err = _launch(tmp_path, 3, 2, victims, 6)
    assert "Traceback" not in err, err[-6000:]
    _assert_fault_free(results, 3, 2, 6)
    _assert_rebuilt_by_replay(results, lost, 2, err)


@pytest.mark.slow
def test_adjacent_lost_stages_fall_back_to_a_restart(tmp_path: Path) -> None:
    # Both reach iteration 3 together (stage 2 steps 2 before stage 1 can). Should stage 1's death
    # be agreed on alone first, the survivors then find stage 2 lost too while waiting for its
    # replacement, or (once it is admitted) find its log missing: a restart either way.
    results, err = _launch(tmp_path, 3, 1, "0:1@3.0,0:2@3.0", 5)
    assert "adjacent stages lost" in err or "cannot replay" in err, err[-6000:]
    _assert_fault_free(results, 3, 1, 5)
    for r in results.values():
        assert r["run"] == 1 and r["restored_from"] is not None, r["worker"]
        assert "lost, cannot replay (" in r["restart_reason"], r["restart_reason"]  # the policy's line, not another


@pytest.mark.slow
def test_a_log_over_its_budget_falls_back_to_a_restart(tmp_path: Path) -> None:
    # Each end stage sends stage 1 512 bytes per iteration (4 chunks of 2 x 8 float64): a 512-byte
    # budget holds one iteration, so killing stage 1 in iteration 6 (checkpoint 3) finds iteration 4 gone.
    results, err = _launch(tmp_path, 3, 1, "0:1@6.0", 7, every=4, budget=512)
    assert "Traceback" not in err, err[-6000:]
    _assert_fault_free(results, 3, 1, 7)
    for r in results.values():
        assert r["run"] == 1 and r["restored_from"] == 3 and r["replayed"] == [], r["worker"]
        assert r["restart_reason"] == "stage(s) 1 lost, cannot replay (stage 0 holds 0 of the 4 chunks it sent " \
                                      "stage 1 in iteration 4, dropped over the log budget)", r["worker"]



def test_replacements_replay_in_parallel_each_its_pipelines() -> None:
    import threading

    pp, dp, microbatches, lost = 3, 2, 2, 1
    chunks = dp * microbatches
    stages = _stages(pp, noisy=-1)
    inputs: dict = {}
    grads: dict = {}
    for j in range(3):  # the fault-free job in one process, logging what stage 1 receives
        x_all, y_all = chaos_batch(j, chunks)
        for p in range(dp):
            for m in range(microbatches):
                key, index = (p, m), chunk_index(p, m, microbatches)
                x = (micro_batch(x_all, index, chunks),)
                for stage in stages:
                    if stage.index == lost:
                        inputs.setdefault(j, {})[key] = x
                    y = micro_batch(y_all, index, chunks) if stage.is_last else None
                    x = stage.forward(key, tuple(t.clone() for t in x), y, scale=1.0 / chunks)
                g = ()
                for stage in reversed(stages):
                    if stage.index == lost:
                        grads.setdefault(j, {})[key] = g
                    g = stage.backward(key, g, split=False)
        for stage in stages:
            stage.step()
    replicas = [_stages(pp, noisy=-1)[lost] for _ in range(dp)]
    barrier, shared = threading.Barrier(dp), [None] * dp

    def reducer(p: int):
        def reduce(stage: Stage) -> None:  # an all-reduce of two threads: each adds up both
            shared[p] = stage.flat_grads()
            barrier.wait()
            total = sum(shared)
            barrier.wait()
            stage.set_flat_grads(total)
        return reduce

    shares = [[(0, 1), (1, 0)], [(1, 1), (0, 0)]]  # any split of the micro-batches, in any order
    threads = [threading.Thread(target=replay, args=(replicas[p], range(3), inputs, grads, None,
                                                     lambda j: chaos_batch(j, chunks), dp, microbatches,
                                                     torch.device("cpu"), shares[p], reducer(p))) for p in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for replica in replicas:
        for name, value in stages[lost].module.state_dict().items():
            assert (replica.module.state_dict()[name] - value).abs().max().item() <= TOLERANCE, name


# ---- parallel replay over idle survivors (`fault.swift_parallel`) ---------------------------------------------


def test_helpers_are_chosen_where_the_cost_model_finds_them_faster() -> None:
    survivors = [Worker(0, s) for s in (0, 2, 3)]
    uniform = CostModel.uniform(4)  # no all-reduce cost: helpers shorten the replay while they shrink the largest share
    assert choose_helpers(uniform, [1], {1: 3}, 4, survivors, None) == {1: survivors}  # a chunk each
    assert choose_helpers(uniform, [1], {1: 3}, 4, survivors, 2) == {1: [Worker(0, 0)]}  # 2 helpers: still 2 chunks
    assert choose_helpers(uniform, [1], {1: 3}, 4, survivors, 1) == {1: [Worker(0, 0)]}  # nearest first
    assert choose_helpers(uniform, [1], {1: 3}, 4, survivors, 0) == {}
    assert choose_helpers(uniform, [1], {1: 0}, 4, survivors, None) == {}  # nothing to replay
    assert choose_helpers(uniform, [1], {1: 3}, 2, survivors, None) == {1: [Worker(0, 0)]}  # 2 chunks: one helper
    costly = CostModel.uniform(4, allreduce=10.0)  # summing the gradients costs more than the chunks saved
    assert choose_helpers(costly, [1], {1: 3}, 4, survivors, None) == {}
    assert replay_seconds(uniform, 1, 3, 4, 0) > replay_seconds(uniform, 1, 3, 4, 1)
    # two lost stages share the survivors, each helping one stage
    many = [Worker(0, s) for s in (0, 2, 4, 5)]
    chosen = choose_helpers(CostModel.uniform(6), [1, 3], {1: 2, 3: 2}, 4, many, 3)
    assert chosen == {1: [Worker(0, 0), Worker(0, 2), Worker(0, 4)], 3: [Worker(0, 5)]}
    assert choose_helpers(CostModel.uniform(6), [1, 3], {1: 2, 3: 2}, 4, many, 1) == \
        {1: [Worker(0, 0)], 3: [Worker(0, 2)]}


def test_replayers_share_the_micro_batches_round_robin() -> None:
    replayers = [Worker(0, 1), Worker(0, 0), Worker(0, 2)]
    split = shares(replayers, 2, 2)
    assert split == {Worker(0, 1): [(0, 0), (1, 1)], Worker(0, 0): [(0, 1)], Worker(0, 2): [(1, 0)]}
    with pytest.raises(RecoveryError, match="helpers"):
        LoggingPolicy(helpers=-1)


def _assert_helped(results: dict, lost: int, helpers: list[str], microbatches: int = 4) -> None:
    """The replacement and its helpers replayed the same iterations, each a disjoint share of the chunks."""
    rebuilt = results[f"0:{lost}"]
    assert rebuilt["replayed_with"] == [f"0:{lost}", *helpers]
    assert rebuilt["replayed"], "nothing was replayed"
    chunks = [tuple(k) for k in rebuilt["replay_share"]]
    for w in helpers:
        r = results[w]
        assert r["helped"] == lost and r["replayed"] == rebuilt["replayed"] and r["replayed_with"] == \
            rebuilt["replayed_with"], w
        chunks += [tuple(k) for k in r["replay_share"]]
    assert sorted(chunks) == [(0, m) for m in range(microbatches)]  # every chunk once
    for w, r in results.items():
        if w not in helpers and w != f"0:{lost}":
            assert r["helped"] is None and r["replayed"] == [], w


@pytest.mark.slow
def test_idle_survivors_help_replay_a_lost_stage_with_dropout(tmp_path: Path) -> None:
    # stage 1 dies in iteration 3 (checkpoint 1): its replacement and every survivor (its neighbours,
    # who also send each other their logs, and stage 3) replay iteration 2, a chunk each
    results, err = _launch(tmp_path, 4, 1, "0:1@3.9", 5, noisy=True, helpers=3)
    assert "Traceback" not in err, err[-6000:]
    _assert_fault_free(results, 4, 1, 5, noisy=True)
    _assert_rebuilt_by_replay(results, 1, 2, err, helped=True)
    _assert_helped(results, 1, ["0:0", "0:2", "0:3"])


@pytest.mark.slow
def test_a_helper_death_falls_back_to_a_restart(tmp_path: Path) -> None:
    # stage 1 dies in iteration 3 (checkpoint 1); every survivor helps (so none waits for a restart
    # in vain, which would cost the launcher's grace), and helper 0:0 dies before its first gradient sum
    results, err = _launch(tmp_path, 4, 1, "0:1@3.9", 5, helpers=3, helper_dies="0:0")
    assert "Traceback" not in err, err[-6000:]
    _assert_fault_free(results, 4, 1, 5)
    for r in results.values():
        assert r["run"] == 1 and r["restored_from"] is not None, r["worker"]
        assert r["restart_reason"] == "stage(s) 1 lost, cannot replay (a worker of its parallel replay failed)", \
            (r["worker"], r["restart_reason"])
