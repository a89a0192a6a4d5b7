"""Which model layers each stage holds: a plan's partition.

A model of L layers (an `nn.Sequential` at run time) is cut into the job's stages by a `Partition`: the
number of layers of each (virtual) stage, in model order, each at least one. Stage s holds layers
`spans(partition)[s]`. Every pipeline uses the same partition, so a stage's live workers still hold the
same weights and all-reduce them as one group; what changes between plans is where the boundaries lie.

A plan without a partition (`Plan.partition` is None) leaves the cut to the runtime (an even split, or
the `layers_per_stage` it is given), as before. A plan with one fixes it: compiled for a failure set, its
boundaries may differ from the fault-free plan's (layers moved off a stage that lost workers), and a
runtime switching to it moves those layers' weights and optimizer state between workers
(`schedcomp.runtime`).
"""

from __future__ import annotations

from collections.abc import Sequence

from schedcomp.errors import PlanFormatError

Partition = tuple[int, ...]
"""Layers per stage, in model order (see the module docstring)."""

MAX_LAYERS = 1 << 20
"""The most layers a model may have: far above any real model, and bounded so a hostile file cannot
make a runtime build a million-layer plan."""


def as_partition(value: object, stages: int, what: str = "partition") -> Partition:
    """`value` checked as a partition of `stages` stages: a list of positive whole layer counts, one per
    stage; PlanFormatError in one line otherwise."""
    how = f"give one positive whole number of layers per stage ({stages} numbers)"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise PlanFormatError(f"{what} must be a list of layer counts, got {type(value).__name__}: {how}")
    if len(value) != stages:
        raise PlanFormatError(f"{what} has {len(value)} entries but the plan has {stages} stages: {how}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value):
        bad = next(n for n in value if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1))
        raise PlanFormatError(f"{what} holds {bad!r}: {how}")
    if sum(value) > MAX_LAYERS:
        raise PlanFormatError(f"{what} has {sum(value)} layers, more than {MAX_LAYERS}: check the model")
    return tuple(value)


def spans(partition: Partition) -> tuple[range, ...]:
    """The layers each stage holds: `range(first, last + 1)` per stage."""
    out, start = [], 0
    for n in partition:
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def stage_of_layer(partition: Partition) -> tuple[int, ...]:
    """For each layer, the stage holding it."""
    return tuple(s for s, n in enumerate(partition) for _ in range(n))


def even(layers: int, stages: int) -> Partition:
    """`layers` split as evenly as possible over `stages` (earlier stages take the remainder), as the
    runtime splits an `nn.Sequential` by default."""
    if layers < stages:
        raise PlanFormatError(f"cannot split {layers} layers into {stages} stages: give at least one layer per stage")
    return tuple(layers // stages + (1 if s < layers % stages else 0) for s in range(stages))
