"""SWIFT's parallel recovery over idle workers: survivors help the replacement replay a lost stage.

    ResilientTrainer(..., logging=LoggingPolicy("memory", helpers=2))   # at most 2 helpers per lost stage

While a lost stage s is rebuilt (`fault.swift`), the other stages' workers would only wait at the
first boundary that needs s. With `LoggingPolicy.helpers` = n > 0 (None: no bound), up to n of them
help instead, when the plan's cost model says it is faster (`choose_helpers`):

1. Choice: every survivor computes the same helpers from what all hold alike (the plan's cost
   model, the agreed checkpoint, the generation's members) and the survivors' record in the store
   (first writer wins) carries them, so a replacement reads the same list.
2. Shares: the stage's replayers (its replacements, then its helpers, each sorted) split its
   micro-batches round-robin (`shares`); every micro-batch draws from its own random stream
   (`runtime.rng`), so any split replays exactly.
3. Logs: each neighbour of s sends every replayer only its share's entries, all sends posted
   before any receive (`post_logs`), so two neighbours that both help cannot wait on each other.
4. Replay: a helper builds stage s beside its own (its parameters, optimizer state and the logs of
   its share: the memory it takes on), restores s's checkpoint and replays its share; before each
   optimizer step the replayers sum their gradients over a group of their own (made by every
   member, in the same order, right after the survivors regroup). Then the helper drops its copy.
5. A replayer's death breaks the generation while the others replay: no second replay is tried,
   the job restarts from its checkpoints with `HELPER_FAILED` as its reason (survivors that had
   gone on find the stage's replay never confirmed, `unconfirmed`).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from schedcomp.costs import CostModel
from schedcomp.errors import RecoveryError
from schedcomp.runtime.data import as_tuple, chunk_index, micro_batch, to_device
from schedcomp.runtime.fault.boundary_log import BoundaryLog, Key
from schedcomp.runtime.fault.checkpoint import restore
from schedcomp.runtime.fault.membership import GenerationAborted
from schedcomp.runtime.fault.recovery import RecoveryHost
from schedcomp.runtime.fault.transfer import encode_header, flatten, recv_tree, to_bytes
from schedcomp.runtime.rng import stream_seed
from schedcomp.runtime.stage import Stage, build_module
from schedcomp.runtime.training import prepare_stage
from schedcomp.topology import Worker

HELPER_FAILED = "a worker of its parallel replay failed"
Logged = dict[int, dict[Key, tuple[Tensor, ...]]]  # iteration -> chunk -> tensors received by the lost stage
Pending = list[tuple[dist.Work, Tensor]]  # sends posted, with the buffers they read


def replay_seconds(costs: CostModel, stage: int, iterations: int, chunks: int, helpers: int) -> float:
    """Replay time of `iterations` iterations of `stage` over 1 + `helpers` workers, in the cost model's units:
    each iteration, the largest share's forwards and backwards, the gradient sum (with helpers), the step."""
    per_chunk = costs.forward[stage] + costs.backward_input[stage] + costs.backward_weight[stage]
    reduce = costs.allreduce[stage] if helpers else 0.0
    return iterations * (math.ceil(chunks / (1 + helpers)) * per_chunk + reduce + costs.optimizer[stage])


def choose_helpers(costs: CostModel, lost: Sequence[int], iterations: Mapping[int, int], chunks: int,
                   idle: Iterable[Worker], most: int | None) -> dict[int, list[Worker]]:
    """The helpers of each lost stage: the fewest that make its replay fastest, at most `most` each.

    `iterations[s]`: iterations to replay for stage s; `idle`: the survivors (each helps one stage at
    most, the lost stages taking them in order, nearest stage first: its neighbours already hold logs).
    """
    free = sorted(idle)
    chosen: dict[int, list[Worker]] = {}
    for s in sorted(lost):
        bound = min(len(free), chunks - 1, most if most is not None else len(free))
        if iterations.get(s, 0) <= 0 or bound <= 0:
            continue
        times = [replay_seconds(costs, s, iterations[s], chunks, k) for k in range(bound + 1)]
        k = times.index(min(times))
        if k:
            chosen[s] = sorted(sorted(free, key=lambda w: (abs(w.stage - s), w))[:k])
            free = [w for w in free if w not in chosen[s]]
    return chosen


def shares(replayers: Sequence[Worker], dp: int, microbatches: int) -> dict[Worker, list[Key]]:
    """Each replayer's micro-batches (home pipeline, micro-batch), round-robin over the global batch."""
    every = [(p, m) for p in range(dp) for m in range(microbatches)]
    return {w: every[i::len(replayers)] for i, w in enumerate(replayers)}


def _of(entries: list[list], share: Iterable[Key]) -> list[list]:
    """The log entries ([iteration, pipeline, micro-batch, tensors]) of these chunks."""
    wanted = set(share)
    return [e for e in entries if (e[1], e[2]) in wanted]


def post_logs(log: BoundaryLog, stage: int, iterations: range, to: Mapping[int, list[Key]],
              group: dist.ProcessGroup, me: int) -> Pending:
    """Post the sends of what this worker logged for `stage` in `iterations` to each rank of `to`, only
    that rank's share; the caller waits for them after its own receives (`recv_tree` reads them). Not
    to itself (`me`, a neighbour that helps): `receive_logs` reads its own log."""
    entries = log.entries(stage, iterations)
    pending: Pending = []
    for rank, share in sorted(to.items()):
        if rank == me:
            continue
        skeleton, tensors = flatten(_of(entries, share))
        header = torch.frombuffer(bytearray(encode_header(skeleton, tensors)), dtype=torch.uint8)
        payload = to_bytes(tensors, torch.device("cpu"))
        sizes = torch.tensor([header.numel(), payload.numel()], dtype=torch.int64)
        for t in (sizes, header, payload) if payload.numel() else (sizes, header):
            pending.append((dist.isend(t, dst=rank, group=group), t))
    return pending


def receive_logs(host: RecoveryHost, stage: int, senders: Iterable[Worker],
                 own: tuple[BoundaryLog, range, list[Key]] | None = None) -> tuple[Logged, Logged]:
    """What `stage`'s neighbours among `senders` sent this worker: (inputs from s - 1, gradients from s + 1).

    `own`: this worker's log, the iterations and its share, when it is a neighbour itself (a helper)."""
    session = host.session
    inputs: Logged = {}
    grads: Logged = {}
    for w in sorted(w for w in senders if abs(w.stage - stage) == 1):
        if w == session.me:
            assert own is not None
            log, iterations, share = own
            entries = _of(log.entries(stage, iterations), share)
        else:
            entries, _ = recv_tree(session.groups.world, session.groups.rank_of(w), wait=host.wait)
        table = inputs if w.stage < stage else grads
        for j, p, m, tensors in entries:
            table.setdefault(int(j), {})[(int(p), int(m))] = tuple(tensors)
    return inputs, grads


def replay_group(host: RecoveryHost, replayers: Sequence[Worker]) -> dist.ProcessGroup | None:
    """The group the replayers of one stage sum their gradients over (collective: every member calls it)."""
    session = host.session
    return session.generation.new_group([session.groups.rank_of(w) for w in replayers])


def reducer(host: RecoveryHost, group: dist.ProcessGroup | None):
    """`replay`'s `reduce`: sum the replayers' gradients before each step (None: a lone replayer)."""
    if group is None:
        return None

    def reduce(stage: Stage) -> None:
        flat = stage.flat_grads()
        host.wait(dist.all_reduce(flat, group=group, async_op=True))
        stage.set_flat_grads(flat)

    return reduce


def help_replay(host: RecoveryHost, log: BoundaryLog, directory: str | Path, stage: int, source: int, rerun: int,
                seed: int | None, share: list[Key], group: dist.ProcessGroup | None,
                replayers: Sequence[Worker]) -> None:
    """A helper: build `stage` beside this worker's own, restore its checkpoint `source`, replay `share` of
    iterations `source + 1 .. rerun - 1` with the other replayers, then drop the copy."""
    trainer, session, report = host.trainer, host.session, host.report
    assert trainer is not None and report is not None
    pp = session.env.pp
    with torch.random.fork_rng(devices=[trainer.device] if trainer.device.type == "cuda" else []):
        # a builder may seed: not ours; an nn.Sequential is cut as the job is (its checkpoints hold layers)
        module = build_module(host.build_stage, stage, pp, trainer.partition).to(trainer.device)
    copy = Stage(stage, pp, module, host.loss_fn if stage == pp - 1 else None, host.make_optimizer)
    prepare_stage(copy, trainer.options)
    restore(directory, source, stage, copy.module, copy.optimizer, host.checkpoint_cut)
    joiners = set(session.joiners())
    began = time.perf_counter()
    try:
        inputs, grads = receive_logs(host, stage, (w for w in session.view.members if w not in joiners),
                                     (log, range(source + 1, rerun), share))
        replay(copy, range(source + 1, rerun), inputs, grads, seed, host.batch_for, session.env.dp,
               trainer.plan.microbatches, trainer.device, share, reducer(host, group))
    except (GenerationAborted, RuntimeError) as e:
        raise helper_failed(stage) from e
    report.replayed = list(range(source + 1, rerun))
    report.replay_seconds = time.perf_counter() - began
    report.helped, report.replay_share = stage, [list(k) for k in share]
    report.replayed_with = [str(w) for w in replayers]
    del copy, module, inputs, grads  # the helper's copy of the stage goes: its memory is the helper's own stage's
    gc.collect()


def helper_failed(stage: int) -> RecoveryError:
    return RecoveryError(f"stage(s) {stage} lost, cannot replay ({HELPER_FAILED})")


def done_key(generation: int, stage: int) -> str:
    """Set by a stage's first replacement once its parallel replay completed."""
    return f"swift/gen{generation}/replayed/{stage}"


def unconfirmed(host: RecoveryHost, started: Mapping[int, int]) -> int | None:
    """A lost stage whose parallel replay (stage -> generation it started in) never completed (None: none)."""
    store = host.session.store
    for stage, generation in sorted(started.items()):
        if not store.check([done_key(generation, stage)]):
            return stage
    return None


def wait_sends(host: RecoveryHost, pending: Pending) -> None:
    for work, _ in pending:
        host.wait(work)


def replay(stage: Stage, iterations: Iterable[int], inputs: Logged, grads: Logged, seed: int | None,
           batch_for, dp: int, microbatches: int, device: torch.device, share: Iterable[Key] | None = None,
           reduce: Callable[[Stage], None] | None = None) -> None:
    """Run `iterations` of `stage` alone: every chunk's forward and backward from the logs, then the optimizer step.

    `inputs[j][chunk]`: what the previous stage sent (unused at stage 0, which reads the batch);
    `grads[j][chunk]`: the gradients the next stage sent back (unused at the last stage, which has
    the loss); `seed`: the job's, from which each forward's random stream derives (`runtime.rng`),
    so the chunks may be replayed in any order and anywhere. `share`: the chunks (home pipeline,
    micro-batch) to replay here (default: all); `reduce(stage)` then sums the gradients with the
    workers replaying the others, before each step.
    """
    chunks = dp * microbatches
    mine = sorted((p, m) for p in range(dp) for m in range(microbatches)) if share is None else list(share)
    for j in iterations:
        x_all, y_all = batch_for(j)
        for key in mine:
            p, m = key
            index = chunk_index(p, m, microbatches)
            if stage.is_first:
                x = tuple(t.to(device) for t in as_tuple(micro_batch(x_all, index, chunks)))
            else:
                x = tuple(t.to(device).clone() for t in inputs[j][key])  # becomes a leaf with a .grad
            y = to_device(micro_batch(y_all, index, chunks), device) if stage.is_last else None
            drawn = None if seed is None else stream_seed(seed, j, stage.index, p, m)
            stage.forward(key, x, y, scale=1.0 / chunks, seed=drawn)
            stage.backward(key, () if stage.is_last else tuple(g.to(device) for g in grads[j][key]), split=False)
        if reduce is not None:
            reduce(stage)
        stage.step()
