"""Which part of the model each worker holds under a plan, and which gradients it reduces with whom.

A plan's `Layout` counts the model in *units*: its layers when the plan gives each pipeline its own
partition (`Plan.partitions`, re-formed pipelines), else one unit per virtual stage (every pipeline holds
the same stages, whatever their layers). Pipeline d's virtual stage s holds units `span(d, s)`; an empty
span is a failed place of a re-formed pipeline, which runs nothing. From it, one code path for both:

- a stage's ends: it is first (loads the inputs) when it holds unit 0, last (the loss) when it holds the
  last unit, so a re-formed pipeline's last live worker computes the loss wherever it sits;
- what crosses a boundary is keyed by the unit it falls before (`runtime.shapes`), so a receiver across a
  gap allocates what its sender's layers return;
- ALLREDUCE's collectives (`reductions`): without partitions one per place, over its stage group, on every
  parameter the worker holds (today's one collective per stage group); with them one per segment
  (`schedcomp.partitions.segments`) over its holders, on that segment's layers' parameters, in layer order.
  Every rank creates the groups of all reductions in this order (`Comm.prepare_stage_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schedcomp.ir import Plan
from schedcomp.partition import spans
from schedcomp.partitions import segments
from schedcomp.topology import Worker


@dataclass(frozen=True)
class Reduction:
    """One collective of ALLREDUCE: `holders` sum the gradients of model layers `layers` (None: every
    parameter a holder holds, a plan without per-pipeline partitions)."""

    holders: tuple[Worker, ...]
    layers: range | None


@dataclass(frozen=True)
class Layout:
    """Per pipeline, per virtual stage, the units it holds (module docstring), and the reductions."""

    spans: tuple[tuple[range, ...], ...]
    units: int
    reductions: tuple[Reduction, ...]
    failed: frozenset[Worker]

    @classmethod
    def of(cls, plan: Plan) -> Layout:
        topology = plan.topology
        if plan.partitions is None:
            stages = tuple(range(s, s + 1) for s in range(topology.stages))
            reductions = tuple(Reduction(topology.stage_group(s), None) for s in range(topology.pp))
            return cls((stages,) * topology.dp, topology.stages, reductions, topology.failed)
        parts = plan.partitions
        reductions = tuple(Reduction(seg.holders, seg.layers) for seg in segments(parts, topology.failed))
        return cls(tuple(spans(p) for p in parts), sum(parts[0]), reductions, topology.failed)

    @property
    def per_layer(self) -> bool:
        """Whether units are model layers (per-pipeline partitions)."""
        return self.reductions[0].layers is not None if self.reductions else False

    def span(self, pipeline: int, stage: int) -> range:
        return self.spans[pipeline][stage]

    def ends(self, pipeline: int, stage: int) -> tuple[bool, bool]:
        """Whether pipeline's virtual stage holds the model's first unit, and its last."""
        held = self.span(pipeline, stage)
        return (len(held) > 0 and held.start == 0, len(held) > 0 and held.stop == self.units)

    def reductions_of(self, worker: Worker) -> tuple[Reduction, ...]:
        """The collectives `worker`'s ALLREDUCE runs, in order (none where it holds nothing)."""
        return tuple(r for r in self.reductions if worker in r.holders)

    def layers_of(self, worker: Worker, module: Any, layers: range) -> list[Any]:
        """The layers `layers` (model indices) in `module`, `worker`'s stage (an `nn.Sequential` of its span)."""
        first = self.span(worker.pipeline, worker.stage).start
        return [module[layer - first] for layer in layers]

    def sources(self, cut: int, place_of: dict[int, int] | None = None) -> tuple[tuple[Worker, int], ...]:
        """Live (worker, virtual stage) whose held span ends at unit `cut`: any of them can tell what crosses
        there (`runtime.shapes`). `place_of`: virtual stage -> place (identity without virtual stages)."""
        out = []
        for d, stages in enumerate(self.spans):
            for s, held in enumerate(stages):
                w = Worker(d, place_of[s] if place_of is not None else s)
                if len(held) and held.stop == cut and w not in self.failed:
                    out.append((w, s))
        return tuple(out)
