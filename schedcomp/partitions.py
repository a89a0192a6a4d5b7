"""Per-pipeline partitions: re-formed pipelines, which layers each worker holds, and who reduces what.

A plan may give each pipeline its own partition of the model's L layers (`Plan.partitions`): per pipeline
one layer count per place. A *re-formed* pipeline (Oobleck's) has lost workers and its live workers hold
all L layers between them: its count is 0 exactly at its failed places. Every other count is positive
(a pipeline with a failed worker that is not re-formed keeps the layers there, its ops re-routed to
peers). Ops of pipeline d exist only at its *held* stages (positive counts); the neighbour of a held
stage is the next (previous) held stage of the same pipeline, across any gap.

Gradients are reduced per *segment*: a maximal run of layers with the same holders (per pipeline the live
worker holding them). A worker reduces each of its segments over that segment's holders, in increasing
layer order: one global order, so collectives over overlapping groups cannot deadlock. With one shared
partition the segments are the stages and their holders the stage groups.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from schedcomp.errors import PlanFormatError
from schedcomp.limits import MAX_COST
from schedcomp.partition import MAX_LAYERS, Partition, spans
from schedcomp.topology import Worker

Partitions = tuple[Partition, ...]
"""Per pipeline, layers per place (see the module docstring)."""


@dataclass(frozen=True)
class Segment:
    """Layers `layers` (a range), held by `holders`: per pipeline its live worker holding them, by rank."""

    layers: range
    holders: tuple[Worker, ...]


def are_layer_times(values: Sequence[object]) -> bool:
    """Whether `values` can be `Plan.layer_allreduce`: at most MAX_LAYERS times, each from 0 to the cost
    models' `MAX_COST` (bounded as their times are, so a segment's sum stays finite: 1e308 per layer
    overflowed it)."""
    return len(values) <= MAX_LAYERS and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= MAX_COST for x in values)


def as_partitions(value: object, dp: int, pp: int, failed: Collection[Worker] = (),
                  what: str = "partitions") -> Partitions:
    """`value` checked as per-pipeline partitions of a job of `dp` pipelines of `pp` places with `failed`
    workers (rules in the module docstring); PlanFormatError in one line otherwise."""
    how = f"give {dp} lists (one per pipeline) of {pp} whole layer counts each"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise PlanFormatError(f"{what} must be a list of per-pipeline partitions, got {type(value).__name__}: {how}")
    if len(value) != dp:
        raise PlanFormatError(f"{what} has {len(value)} entries but the plan has {dp} pipelines: {how}")
    out: list[Partition] = []
    for d, counts in enumerate(value):
        if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence) or len(counts) != pp:
            raise PlanFormatError(f"{what}[{d}] must be a list of {pp} layer counts: {how}")
        bad = next((n for n in counts if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0)), None)
        if bad is not None:
            raise PlanFormatError(f"{what}[{d}] holds {bad!r}: {how}")
        out.append(tuple(counts))
    total = sum(out[0])
    if total > MAX_LAYERS:
        raise PlanFormatError(f"{what} has {total} layers, more than {MAX_LAYERS}: check the model")
    for d, counts in enumerate(out):
        if sum(counts) != total:
            raise PlanFormatError(f"{what}[{d}] holds {sum(counts)} layers but pipeline 0's holds {total}: "
                                  "every pipeline holds the whole model")
        zeros = {s for s, n in enumerate(counts) if n == 0}
        if zeros:
            dead = {s for s in range(pp) if Worker(d, s) in failed}
            if zeros != dead:
                s = min(zeros ^ dead)
                why = ("a live worker must hold layers" if s in zeros
                       else "a re-formed pipeline's failed places hold none")
                raise PlanFormatError(f"{what}[{d}] gives place {s} {counts[s]} layers: {why} (0 exactly at the "
                                      "failed places of a re-formed pipeline)")
            if len(zeros) == pp:
                raise PlanFormatError(f"{what}[{d}] holds no layers: a pipeline with no live worker runs nothing")
    return tuple(out)


def held_stages(partition: Partition) -> tuple[int, ...]:
    """The stages (places) a pipeline's partition gives layers, in order: where its ops run."""
    return tuple(s for s, n in enumerate(partition) if n)


def held_ends(partition: Partition) -> tuple[int, int]:
    """A pipeline's first and last held stage: the forwards LOAD feeds (inputs, targets)."""
    held = held_stages(partition)
    return held[0], held[-1]


def next_stage(partition: Partition) -> tuple[int, ...]:
    """Per stage, the next held stage after it (len(partition) past the last): where an F sends its output."""
    out, nxt = [0] * len(partition), len(partition)
    for s in range(len(partition) - 1, -1, -1):
        out[s] = nxt
        if partition[s]:
            nxt = s
    return tuple(out)


def previous_stage(partition: Partition) -> tuple[int, ...]:
    """Per stage, the held stage before it (-1 before the first): where a B sends its input gradient."""
    out, prev = [0] * len(partition), -1
    for s, n in enumerate(partition):
        out[s] = prev
        if n:
            prev = s
    return tuple(out)


def segments(partitions: Partitions, failed: Collection[Worker] = ()) -> tuple[Segment, ...]:
    """The model's layers as segments (module docstring), in layer order: every layer in exactly one, its
    holders one live worker per pipeline (a failed worker of a pipeline that is not re-formed holds its
    layers but reduces nothing: its ops ran on peers of the same span, which reduce them)."""
    if not partitions:
        return ()
    stage_of = [[s for s, n in enumerate(p) for _ in range(n)] for p in partitions]
    layers = len(stage_of[0])
    out: list[Segment] = []
    start = 0
    for layer in range(1, layers + 1):
        if layer < layers and all(st[layer] == st[layer - 1] for st in stage_of):
            continue
        holders = tuple(w for d, st in enumerate(stage_of) if (w := Worker(d, st[start])) not in failed)
        out.append(Segment(range(start, layer), holders))
        start = layer
    return tuple(out)


def segments_by_holder(segs: Sequence[Segment]) -> dict[Worker, list[int]]:
    """Per holder of `segs` (`segments`), the numbers of the segments it reduces, in layer order (the order of
    its ALLREDUCE's collectives): read by `check`'s deadlock walk and `simulate`'s collectives alike."""
    out: dict[Worker, list[int]] = {}
    for k, seg in enumerate(segs):
        for w in seg.holders:
            out.setdefault(w, []).append(k)
    return out


def span_of(partition: Partition, stage: int) -> range:
    """The layers `stage` holds under `partition` (empty where it holds none)."""
    return spans(partition)[stage]


def held_by(partitions: Partitions, worker: Worker) -> range:
    """The layers `worker` holds under per-pipeline `partitions`: its own pipeline's span at its place."""
    return span_of(partitions[worker.pipeline], worker.stage)


Reach = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
"""Per pipeline, (`next_stage`, `previous_stage`) of its partition: where each stage's neighbours are."""


def reach(partitions: Partitions) -> Reach:
    """Each pipeline's neighbour tables (one computation per plan, read per transfer)."""
    return tuple((next_stage(p), previous_stage(p)) for p in partitions)


def neighbours(reached: Reach, pipeline: int, stage: int) -> tuple[int, int]:
    """The next and previous stage `pipeline` holds around `stage`, over any gap (the stage count past its last,
    -1 before its first): where its ops at `stage` send and receive. The one lookup for lower, the plan index
    and check."""
    nxt, prv = reached[pipeline]
    return nxt[stage], prv[stage]
