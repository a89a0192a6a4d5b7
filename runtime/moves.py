"""Layers moving between workers when a plan switch changes the partition (`Plan.partition`, or per
pipeline `Plan.partitions`).

A plan compiled for a failure set may cut the model elsewhere than the plan in use: layers leave a
stage that lost workers for its neighbours (the same cut in every pipeline), or a re-formed pipeline's
live workers take all the model's layers between them (each pipeline its own cut). At an iteration boundary
(every stage stepped) `move_layers(old, new, ...)` gives each worker the layers the new partition puts
on it, with their parameters and optimizer state, bit for bit, and rebuilds its stages:

- who sends what (`plan_moves`, pure): a worker receives each layer it newly holds from the worker of
  its own pipeline that held it, when that one is live, else from the lowest-rank live worker that held
  it, in any pipeline (replicas are identical after the step). One message per (receiver,
  source) pair, all of them in one order (receiver rank, then source rank) that every rank derives from
  the two partitions and the live workers alone: no negotiation, and no deadlock (the first transfer
  not yet done always has both its ends at it);
- what a layer carries (`layer_states`): its `state_dict`, its non-persistent buffers (a rotary
  embedding's `inv_freq`, a causal mask: not in `state_dict`, yet a layer that was freed and comes back
  needs them) and, per trainable parameter, the optimizer's state (Adam's `step`, `exp_avg`, `exp_avg_sq`,
  ...), as plain data over `transfer.send_tree` (tensors on the worker's device, so NCCL carries them;
  nothing pickled);
- the rebuild: each (virtual) stage a worker holds becomes a new `Stage` over its layers in model order
  (layers it keeps are the same module objects), its optimizer `make_optimizer(params)` loaded with the
  layers' states and its old optimizer's param-group settings (the lr an LR schedule set), and what was
  tied to the old optimizer (the LR schedule, float16's loss scaler) carried over. A layer a worker no
  longer holds is freed (its tensors go to the meta device; one that comes back is materialised again).

Only `torch.optim`-style optimizers split per layer: a `state_dict` of `state` (per parameter index) and
one param group. Anything else is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.ir import Plan
from schedcomp.partition import Partition, spans, stage_of_layer
from schedcomp.partitions import Partitions, held_by
from schedcomp.runtime.comm import Comm
from schedcomp.runtime.fault.transfer import flatten, recv_tree, send_tree
from schedcomp.runtime.stage import Stage, even_split
from schedcomp.runtime.training import attached_to
from schedcomp.topology import Worker

LayerState = dict[str, Any]
"""{"module": the layer's state_dict, "buffers": its non-persistent buffers, "optimizer": per trainable
parameter, its state}"""
StageFactory = Callable[[int, nn.Module], Stage]  # (virtual stage, module) -> a prepared Stage


def _identity(stage: int) -> int:
    return stage


@dataclass(frozen=True)
class Move:
    """One message of a move: `layers` (model indices, in order) from `source` to `receiver`."""

    source: Worker
    receiver: Worker
    layers: tuple[int, ...]


Cuts = Partition | Partitions
"""One partition every pipeline shares, or per pipeline its own (`Plan.partitions`, re-formed pipelines)."""


def _per_pipeline(cuts: Cuts) -> Callable[[int], Partition]:
    if cuts and isinstance(cuts[0], tuple):
        return lambda d: cuts[d]  # type: ignore[return-value]
    return lambda d: cuts  # type: ignore[return-value]


def plan_moves(old: Cuts, new: Cuts, workers: Sequence[Worker],
               place_of: Callable[[int], int] = _identity, stale: Collection[Worker] = ()) -> tuple[Move, ...]:
    """Every message that takes the live `workers` (in rank order) from cut `old` to `new` (each one shared
    partition or per-pipeline partitions).

    `place_of(s)`: the place (`Worker.stage`) holding virtual stage s (`Topology.place_of`; the identity
    without virtual stages). `stale`: workers that idled on the old plan (their layers missed its steps), never
    a source. RecoveryError when no live worker held a layer that must move.
    """
    old_of, new_of = _per_pipeline(old), _per_pipeline(new)
    pipelines = {w.pipeline for w in workers}
    if len({sum(old_of(d)) for d in pipelines} | {sum(new_of(d)) for d in pipelines}) > 1:
        raise RuntimeSetupError(f"cuts {list(old)} and {list(new)} cut models of different sizes: a plan switch "
                                "keeps the model")
    rank = {w: r for r, w in enumerate(workers)}
    sources = {w: r for w, r in rank.items() if w not in stale}
    old_place = {d: [place_of(s) for s in stage_of_layer(old_of(d))] for d in pipelines}
    messages: dict[tuple[Worker, Worker], list[int]] = {}
    for receiver in workers:
        for s, held in enumerate(spans(new_of(receiver.pipeline))):
            if place_of(s) != receiver.stage:
                continue
            for layer in held:
                if old_place[receiver.pipeline][layer] == receiver.stage:
                    continue  # it keeps this layer
                source = _source(receiver, sources, old_place, layer)
                messages.setdefault((receiver, source), []).append(layer)
    order = sorted(messages, key=lambda pair: (rank[pair[0]], rank[pair[1]]))
    return tuple(Move(source, receiver, tuple(messages[receiver, source])) for receiver, source in order)


def _source(receiver: Worker, rank: Mapping[Worker, int], old_place: Mapping[int, list[int]], layer: int) -> Worker:
    """The receiver's own pipeline's old holder when live, else the lowest-rank live worker that held the layer
    (in any pipeline: every replica holds the same weights and optimizer state after a step)."""
    own = Worker(receiver.pipeline, old_place[receiver.pipeline][layer])
    if own in rank:
        return own
    holders = [w for w in rank if old_place[w.pipeline][layer] == w.stage]
    if not holders:
        raise RecoveryError(f"no live worker holds layer {layer} (every worker that held it failed): "
                            "restart the job from a checkpoint")
    return min(holders, key=rank.__getitem__)


def holds_like(cuts: Partitions | None, worker: Worker) -> Callable[[Worker], bool]:
    """Whether a worker at `worker`'s place holds the layers `worker` holds under per-pipeline `cuts` (the plan in
    use; where pipelines hold different ones, re-formed, a replacement's donor must; every replica otherwise)."""
    if cuts is None or len(set(cuts)) == 1:
        return lambda other: True
    return lambda other: held_by(cuts, other) == held_by(cuts, worker)


# ---- a stage's state, per layer ------------------------------------------------------------------------


def trainable(layer: nn.Module) -> list[nn.Parameter]:
    return [p for p in layer.parameters() if p.requires_grad]


def optimizer_dict(optimizer: Any) -> dict[str, Any]:
    """The optimizer's state dict, refused in one line where it does not split per layer."""
    state = optimizer.state_dict()
    if not (isinstance(state, dict) and isinstance(state.get("state"), dict)
            and isinstance(state.get("param_groups"), list)):
        raise RuntimeSetupError(f"{type(optimizer).__name__}'s state_dict is not torch.optim's (state per "
                                "parameter index, param_groups): layers cannot move with it; use a torch.optim "
                                "optimizer")
    if len(state["param_groups"]) != 1:
        raise RuntimeSetupError(f"the stage optimizer has {len(state['param_groups'])} param groups: layers move "
                                "with one group per stage, so make_optimizer(params) should keep one")
    return state


def group_settings(optimizer: Any) -> dict[str, Any]:
    """The optimizer's param-group settings (lr, betas, ...), without its parameters: what every stage shares."""
    return {k: v for k, v in optimizer_dict(optimizer)["param_groups"][0].items() if k != "params"}


def tied_states(optimizer: Any) -> dict[str, Any]:
    """The state of what is tied to the optimizer (LR schedule, float16's loss scaler), by name."""
    return {name: stateful.state_dict() for name, stateful in attached_to(optimizer).items()}


def layer_states(module: nn.Module, optimizer: Any, first: int) -> dict[int, LayerState]:
    """Each layer of `module` (an `nn.Sequential` whose layer 0 is model layer `first`, optimised by `optimizer`):
    its module state and its trainable parameters' optimizer state, by model layer index."""
    if not isinstance(module, nn.Sequential):
        raise RuntimeSetupError("layers move only between stages cut from an nn.Sequential model")
    per_param = optimizer_dict(optimizer)["state"]
    index = {id(p): i for i, p in enumerate(optimizer.param_groups[0]["params"])}  # `state_dict()`'s numbering
    return {first + k: {"module": layer.state_dict(), "buffers": transient_buffers(layer),
                        "optimizer": [per_param.get(index[id(p)], {}) for p in trainable(layer)]}
            for k, layer in enumerate(module)}


def transient_buffers(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers `state_dict` leaves out (registered with `persistent=False`), by name."""
    kept = layer.state_dict(keep_vars=True)
    return {name: buf for name, buf in layer.named_buffers() if name not in kept}


def job_splits_per_layer(model: nn.Sequential, partition: Partition, make_optimizer: Any) -> bool:
    """Whether every stage of `partition` splits per layer: the same answer on every worker (each judges
    every stage, from the whole model and a throwaway optimizer over its layers, not only those it holds),
    so one job never writes checkpoints of both formats. Also False where the optimizer's settings hold
    tensors (a tensor `lr`): per-layer manifests keep settings as plain numbers."""
    for held in spans(partition):
        module = nn.Sequential(*(model[i] for i in held))
        params = trainable(module)
        try:
            optimizer = make_optimizer(params)
        except Exception:  # an optimizer that cannot be built here is judged as not splitting
            return False
        if not _splits(module, params, optimizer) or any(
                torch.is_tensor(v) for group in optimizer.param_groups for k, v in group.items() if k != "params"):
            return False
    return True


def _splits(module: nn.Module, params: Sequence[nn.Parameter], optimizer: Any) -> bool:
    try:
        _check_movable(module, params, optimizer)
    except RuntimeSetupError:
        return False
    return True


def check_movable(stage: Stage) -> None:
    """Refuse, in one line, a stage whose layers could not move with their state: called before training
    where plans may cut the model elsewhere, so the refusal never comes in the middle of a recovery."""
    _check_movable(stage.module, stage.params, stage.optimizer)


def _check_movable(module: nn.Module, params: Sequence[nn.Parameter], optimizer: Any) -> None:
    optimizer_dict(optimizer)
    if [id(p) for p in optimizer.param_groups[0]["params"]] != [id(p) for p in params]:
        raise RuntimeSetupError("the stage optimizer does not hold exactly the stage's trainable parameters, in "
                                "order: layers cannot move with its state; let make_optimizer(params) optimise the "
                                "params it is given")
    if isinstance(module, nn.Sequential):
        per_layer = [id(p) for layer in module for p in trainable(layer)]
        if len(per_layer) != len(set(per_layer)):
            raise RuntimeSetupError("a stage's layers share parameters: layers move only where each holds its own")


# ---- the move ------------------------------------------------------------------------------------------


def move_layers(old: Cuts, new: Cuts, stages: Mapping[int, Stage], model: nn.Sequential, *,
                me: Worker, workers: Sequence[Worker], comm: Comm, build: StageFactory,
                place_of: Callable[[int], int] = _identity, stale: Collection[Worker] = ()) -> dict[int, Stage]:
    """This worker's stages under `new`, with the layers it newly holds received (collective over `workers`).

    `stages`: its stages under `old`, by virtual stage; `model`: the whole model, whose layer objects are
    the ones stages hold; `workers`: the live workers taking part, in rank order (`comm`'s ranks);
    `build(s, module)`: a new, prepared `Stage` (its optimizer fresh) for virtual stage s.
    """
    old_spans, new_spans = spans(_per_pipeline(old)(me.pipeline)), spans(_per_pipeline(new)(me.pipeline))
    mine: dict[int, LayerState] = {}
    for s, stage in stages.items():
        mine.update(layer_states(stage.module, stage.optimizer, old_spans[s].start))
    for move in plan_moves(old, new, workers, place_of, stale):
        if move.source == me:
            send_tree({layer: mine[layer] for layer in move.layers}, comm.p2p_group(*_ranks(comm, move)),
                      [comm.ranks.rank(move.receiver)], comm.device, wait=comm.wait)
        elif move.receiver == me:
            got, _ = recv_tree(comm.p2p_group(*_ranks(comm, move)), comm.ranks.rank(move.source), comm.device,
                               wait=comm.wait)
            if not isinstance(got, dict) or set(got) != set(move.layers):
                raise RecoveryError(f"worker {move.source} sent layers {sorted(got) if isinstance(got, dict) else '?'}"
                                    f" where {list(move.layers)} were due: every rank must switch to the same plan")
            for layer, state in got.items():
                load_layer_state(_materialise(model[layer], comm.device), state)
                mine[layer] = state
    held = {s: list(new_spans[s]) for s in stages}
    for layer in set(mine) - {layer for layers in held.values() for layer in layers}:
        model[layer].to("meta")  # freed: nothing on this worker reads it any more
    return {s: _rebuild(s, [model[layer] for layer in held[s]], [mine[layer] for layer in held[s]], stages[s], build)
            for s in stages}


def _ranks(comm: Comm, move: Move) -> tuple[int, int]:
    return comm.ranks.rank(move.source), comm.ranks.rank(move.receiver)


def _materialise(layer: nn.Module, device: torch.device) -> nn.Module:
    """`layer` with real tensors on `device` (a freed layer's are on the meta device; values are loaded next)."""
    if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
        return layer.to_empty(device=device)
    return layer.to(device)


def _rebuild(s: int, layers: list[nn.Module], states: list[LayerState], old: Stage, build: StageFactory) -> Stage:
    """Virtual stage s over `layers`, its optimizer holding their `states` and `old`'s group settings."""
    stage = build(s, nn.Sequential(*layers))
    load_layer_optimizer(stage.optimizer, layers, states, group_settings(old.optimizer), tied_states(old.optimizer))
    return stage


def load_layer_state(layer: nn.Module, state: LayerState) -> None:
    """Copy a layer's module state and non-persistent buffers (from `layer_states`) into `layer`."""
    layer.load_state_dict(state["module"])
    with torch.no_grad():
        for name, value in state["buffers"].items():
            layer.get_buffer(name).copy_(value)


def load_layer_optimizer(optimizer: Any, layers: Sequence[nn.Module], states: Sequence[LayerState],
                         group: Mapping[str, Any], attached: Mapping[str, Any]) -> None:
    """Load `optimizer` (over the trainable parameters of `layers`, in order) with the layers' per-parameter
    `states`, the param-group settings `group` (its lr, betas, ...) and the state of what is tied to it
    (`attached`: the LR schedule's, float16's loss scaler's, by name)."""
    params = [p for layer in layers for p in trainable(layer)]
    if [id(p) for p in params] != [id(p) for p in optimizer.param_groups[0]["params"]]:
        raise RuntimeSetupError("a stage's layers share parameters: layers move only where each holds its own")
    per_param = {i: state for i, state in enumerate(st for layer_state in states for st in layer_state["optimizer"])
                 if state}
    optimizer.load_state_dict({"state": per_param, "param_groups": [{**group, "params": list(range(len(params)))}]})
    for name, stateful in attached_to(optimizer).items():  # the LR schedule, float16's loss scaler
        stateful.load_state_dict(attached[name])


def moved_bytes(moves: Collection[Move], states: Mapping[int, LayerState]) -> int:
    """The tensor bytes `moves` carry, from the layers' `states` (what `bench_moves` reports)."""
    total = 0
    for move in moves:
        _, tensors = flatten({layer: states[layer] for layer in move.layers})
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


# ---- which cut a trainer runs ----------------------------------------------------------------------------


def base_partition(build: object, layers_per_stage: Sequence[int] | None, stages: int) -> Partition | None:
    """The cut of a plan without a partition: `layers_per_stage`, else an even split of an `nn.Sequential`
    (None for a stage builder, whose cut the runtime does not know)."""
    if not isinstance(build, nn.Sequential):
        return None
    return tuple(layers_per_stage) if layers_per_stage is not None else even_split(len(build), stages)


def partition_for(partition: Partition | None, model: nn.Sequential | None, base: Partition | None,
                  stages: int) -> Partition | None:
    """The cut a plan of `stages` (virtual) stages whose `Plan.partition` is `partition` runs on this model;
    one line where it cannot."""
    if partition is None:
        return base
    if len(partition) != stages:
        raise RuntimeSetupError(f"the plan's partition {list(partition)} has {len(partition)} entries for its "
                                f"{stages} stages: give one layer count per stage")
    if model is None:
        raise RuntimeSetupError(f"the plan fixes the layers of each stage (partition {list(partition)}): pass the "
                                "model as an nn.Sequential, which the runtime cuts there (a stage builder cannot)")
    if sum(partition) != len(model):
        raise RuntimeSetupError(f"the plan's partition {list(partition)} holds {sum(partition)} layers but the model "
                                f"has {len(model)}: compile the plan for this model")
    return tuple(partition)


def cuts_for(plan: Plan, model: nn.Sequential | None, base: Partition | None) -> Partitions | None:
    """Per pipeline, the layers each (virtual) stage of `plan` holds on this model: `Plan.partitions`, else
    the one cut `partition_for` gives every pipeline (None for a stage builder); one line where it cannot."""
    if plan.partitions is None:
        job = partition_for(plan.partition, model, base, plan.topology.stages)
        return None if job is None else (job,) * plan.topology.dp
    if model is None or sum(plan.partitions[0]) != len(model):
        raise RuntimeSetupError(f"the plan's pipelines hold {sum(plan.partitions[0])} layers each (re-formed "
                                "pipelines): pass the model as an nn.Sequential of that many layers")
    return plan.partitions
