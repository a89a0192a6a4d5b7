"""Per-layer costs, and the per-stage cost model a partition of the layers makes of them.

A `LayerCosts` is a `CostModel` with one entry per *layer* of the model (forward, backward_input,
backward_weight, activation, allreduce, optimizer, b_frees; p2p, speed and memory_unit as a stage model's)
plus `static`: the memory each layer holds whatever the schedule (weights, gradients, optimizer state), in
the activation's unit. `stage_costs(layer_costs, partition)` sums them over each stage's layers, so every
stage-level consumer (solvers, lower, check, simulate) runs unchanged on the result.

Memory under a new partition: a device's total (activations + static) stays what it was under the job's
partition, so a stage's activation limit grows by the static memory it gave away and shrinks by the
static memory it took on (`limit_from`). A partition that leaves a stage no room for the activations of
one micro-batch (or of one piece, for a pipeline that runs pieces of at most `piece` micro-batches) is
infeasible (`MemoryLimitError`).

JSON: the cost model's dict (one entry per layer) plus `"static"`, `"format": "schedcomp-layer-costs"`
and `"version"`; read with the cost model's care (one-line `CostModelError`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from schedcomp import fileio
from schedcomp.costs import CostModel, _per_stage, load_model, model_path
from schedcomp.errors import CostModelError, MemoryLimitError, SchedcompTypeError
from schedcomp.partition import MAX_LAYERS, Partition, spans

FORMAT = "schedcomp-layer-costs"
VERSION = 1
_TOL = 1e-9


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs (`costs`, one entry per layer; its memory limit must be None: limits are per
    device, set on the stage model) and per-layer static memory (`static`, default 0)."""

    costs: CostModel
    static: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.costs, CostModel):
            raise SchedcompTypeError(f"LayerCosts.costs must be a CostModel, got {type(self.costs).__name__}")
        if self.costs.pp > MAX_LAYERS:
            raise CostModelError(f"layer costs have {self.costs.pp} layers, more than {MAX_LAYERS}")
        if self.costs.memory_limit is not None:
            raise CostModelError("layer costs take no memory_limit: give the limit per device "
                                 "(--memory-limit), it applies to stages")
        object.__setattr__(self, "static", _per_stage("static", self.static or 0.0, self.costs.pp))

    @property
    def layers(self) -> int:
        return self.costs.pp

    @classmethod
    def even(cls, costs: CostModel, layers_per_stage: int) -> LayerCosts:
        """Each stage of `costs` split evenly over `layers_per_stage` layers (its times, activation,
        all-reduce and step divided by k; b_frees, p2p and speed factors kept; no memory limit: that is the
        job's, per device)."""
        if isinstance(layers_per_stage, bool) or not isinstance(layers_per_stage, int) or layers_per_stage < 1:
            raise CostModelError(f"layers per stage must be a positive integer, got {layers_per_stage!r}")
        k = layers_per_stage
        if costs.pp * k > MAX_LAYERS:
            raise CostModelError(f"{costs.pp} stages x {k} layers is more than {MAX_LAYERS} layers")

        def split(values: Sequence[float]) -> list[float]:
            return [v / k for v in values for _ in range(k)]

        frees = costs.b_frees
        per_layer = dataclasses.replace(
            costs, forward=split(costs.forward), backward_input=split(costs.backward_input),
            backward_weight=split(costs.backward_weight), allreduce=split(costs.allreduce),
            optimizer=split(costs.optimizer), activation=split(costs.activation),
            b_frees=tuple(f for f in frees for _ in range(k)) if isinstance(frees, tuple) else frees,
            memory_limit=None)
        return cls(per_layer)

    # ---- JSON -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.costs.to_dict(), "version": VERSION, "static": list(self.static)}

    @classmethod
    def from_dict(cls, data: Any) -> LayerCosts:
        if not isinstance(data, dict):
            raise CostModelError("layer costs must be a JSON object with per-layer lists such as 'forward'")
        if data.get("format") != FORMAT:
            raise CostModelError(f"layer costs need \"format\": \"{FORMAT}\" (a stage cost model goes to --costs)")
        version = data.get("version", VERSION)
        if version != VERSION or isinstance(version, bool):
            raise CostModelError(f"layer costs version {version!r} is not supported: this schedcomp reads {VERSION}")
        rest = {k: v for k, v in data.items() if k not in ("format", "version", "static")}
        costs = CostModel.from_dict(rest)
        static = data.get("static", 0.0)
        if not isinstance(static, (list, int, float)) or isinstance(static, bool):
            raise CostModelError(f"static must be a number or one number per layer, got {type(static).__name__}")
        return cls(costs, static if isinstance(static, list) else (static,) * costs.pp)

    def to_json(self) -> str:
        return fileio.dumps_json(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        fileio.write_atomic(model_path(path, "layer costs"), self.to_json(), CostModelError)

    @classmethod
    def load(cls, path: str | Path) -> LayerCosts:
        return load_model(path, "layer costs", cls.from_dict)


def check_partition(layer_costs: LayerCosts, partition: Partition) -> None:
    if sum(partition) != layer_costs.layers:
        raise CostModelError(f"the partition {list(partition)} holds {sum(partition)} layers but the layer costs "
                             f"have {layer_costs.layers}: give counts that sum to the model's layers")


def static_of(layer_costs: LayerCosts, partition: Partition) -> tuple[float, ...]:
    """Static memory each stage holds under `partition`."""
    return tuple(math.fsum(layer_costs.static[i] for i in span) for span in spans(partition))


def stage_costs(layer_costs: LayerCosts, partition: Partition, *,
                limit_from: tuple[CostModel, Partition] | None = None) -> CostModel:
    """The per-stage cost model of `partition`: per stage the sums over its layers (b_frees: the
    activation-weighted mean). `limit_from` = (the job's stage model with its resolved limit, the job's
    partition) carries the limit over by the static-memory rule of the module docstring (each stage must
    have room for one micro-batch); without it the result has no limit."""
    check_partition(layer_costs, partition)
    c = layer_costs.costs
    ranges = spans(partition)

    def total(values: Sequence[float]) -> list[float]:
        return [math.fsum(values[i] for i in span) for span in ranges]

    activation = total(c.activation)
    frees: float | tuple[float, ...] = c.b_frees
    if isinstance(frees, tuple):
        frees = tuple(min(1.0, math.fsum(c.activation[i] * frees[i] for i in span) / a) if a else 0.5
                      for span, a in zip(ranges, activation, strict=True))
    limit: float | tuple[float, ...] | None = None
    if limit_from is not None:
        limit = moved_limit(layer_costs, partition, *limit_from)
    return dataclasses.replace(
        c, forward=total(c.forward), backward_input=total(c.backward_input), backward_weight=total(c.backward_weight),
        allreduce=total(c.allreduce), optimizer=total(c.optimizer), activation=activation, b_frees=frees,
        memory_limit=limit)


def moved_limit(layer_costs: LayerCosts, partition: Partition, job_costs: CostModel,
                job_partition: Partition, *, piece: float = 1.0) -> tuple[float, ...] | None:
    """Each stage's activation limit under `partition`: its limit under `job_partition` (`job_costs`)
    plus the static memory it gave away minus what it took on. None when the job has no limit;
    `MemoryLimitError` when a stage is left without room for one micro-batch, or for one piece where the
    pipeline runs pieces of at most `piece` micro-batches (a re-formed pipeline's finer pieces)."""
    if job_costs.memory_limit is None:
        return None
    check_partition(layer_costs, job_partition)
    before, after = static_of(layer_costs, job_partition), static_of(layer_costs, partition)
    limits = tuple(job_costs.limit_at(s) + before[s] - after[s] for s in range(len(partition)))
    ranges = spans(partition)
    for s, (room, span) in enumerate(zip(limits, ranges, strict=True)):
        need = math.fsum(layer_costs.costs.activation[i] for i in span) * piece
        if room < need * (1 - _TOL):
            what = "one micro-batch's" if piece == 1.0 else f"one piece's ({piece:g} of a micro-batch)"
            raise MemoryLimitError(f"partition {list(partition)}: stage {s} would have {room:g} for activations, "
                                   f"less than {what} {need:g}")
    return limits
