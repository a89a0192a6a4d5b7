"""Memory limits: parsing them ("60GiB"), resolving the default, and reporting peaks against them.

A plan compiled for a failure set is *memory-safe by default*: every worker stays at or below the peak
that the fault-free plan of the same job holds on its stage, so a job that fit before a failure still
fits after it. `compile(memory_limit=...)` takes:

- "fault-free" (the default): with failures, ZB-H1's per-stage peak (`REFERENCE`; with virtual stages
  the peak of the family with the same placement, `reference_family`); a limit in the cost model wins
  over it, and a fault-free plan is its own reference (no limit added);
- a fault-free family name ("1f1b", "zb-h1", ...): that family's per-stage peak;
- None or "none": no limit at all (the summary says it was lifted);
- a number (in the cost model's memory unit), one number per stage, or a size in bytes ("60GiB",
  "1.5e9B") when the cost model's activations are in bytes (`schedcomp profile`).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from schedcomp.costs import CostModel
from schedcomp.cut import NO_CUT, Cut
from schedcomp.errors import CostModelError, MemoryLimitError
from schedcomp.semantics import SEMANTICS

if TYPE_CHECKING:
    from schedcomp.ir import Plan
    from schedcomp.topology import Topology, Worker

FAULT_FREE = "fault-free"
NO_LIMIT = "none"
REFERENCE = "zb-h1"
"""The fault-free family whose per-stage peak bounds a failure plan by default."""
MAX_BYTES = 2.0**60
"""Larger limits (1 EiB) are refused: no device has that much, so it is a typo or an attempt at 'inf'."""

MemoryLimit = float | str | Sequence[float] | None


def is_fault_free(limit: MemoryLimit) -> bool:
    """Whether `limit` names the default, "fault-free" (any case, any surrounding blanks)."""
    return isinstance(limit, str) and limit.strip().lower() == FAULT_FREE

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgtpe]i?b|b|bytes?)?\s*", re.IGNORECASE)
_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}


def parse_memory(text: str) -> tuple[float, bool]:
    """(value, in bytes?) of "60GiB", "512MB", "1e9B" (bytes) or "4", "3.5" (the cost model's unit).

    KiB/MiB/GiB are powers of 1024, kB/MB/GB powers of 1000. Raises `MemoryLimitError` on anything
    that is not a positive size below 1 EiB (so "inf", "nan", "1e308", "-1" are refused)."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise MemoryLimitError(
            f"memory limit {text!r} is not a size: give a number, a size such as 60GiB or 512MB, "
            f"{FAULT_FREE!r} or {NO_LIMIT!r}"
        )
    number, unit = match.groups()
    value = float(number)
    in_bytes = unit is not None
    if in_bytes and unit[0].lower() in _POWERS:
        value *= (1024 if "i" in unit.lower() else 1000) ** _POWERS[unit[0].lower()]
    if not (math.isfinite(value) and value > 0) or value >= MAX_BYTES:
        raise MemoryLimitError(
            f"memory limit {text!r} must be a positive size below 1 EiB: give the device's real limit, "
            f"or {NO_LIMIT!r} to lift it"
        )
    return value, in_bytes


def show_memory(value: float, costs: CostModel, *, unit: bool = True) -> str:
    """`value` in the cost model's memory unit, for people: "3.5 activation units" or "1.5 GiB"."""
    if not math.isfinite(value):
        return "unlimited"
    if costs.memory_unit == "bytes":
        return format_bytes(value)
    return f"{value:g} activation units" if unit else f"{value:g}"


def format_bytes(value: float) -> str:
    """1.5 GiB, 512 KiB, 100 B."""
    for power, name in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if abs(value) >= 1024**power:
            return f"{value / 1024**power:.4g} {name}"
    return f"{value:.0f} B"


def stage_deltas(costs: CostModel, stage: int) -> dict[Any, float]:
    """The memory model, the one every consumer uses: how much activation memory each instruction kind
    (and each op kind: `OpKind.F` looks up as `InstrKind.F`) adds when it runs at `stage`. Kinds whose
    semantics name no memory effect add nothing."""
    return {k: 0.0 if sem.memory is None else costs.memory_delta(sem.memory.value, stage)
            for k, sem in SEMANTICS.items()}


LIMIT_TOLERANCE = 1e-9


def limit_top(limit: float) -> float:
    """The most activation a worker under `limit` may hold (`check`'s test): the limit and a relative 1e-9,
    for sums that differ in their last bits."""
    return limit + LIMIT_TOLERANCE * max(1.0, limit)


def stream_deltas(costs: CostModel, instructions: Iterable[Any], stage: int, cut: Cut = NO_CUT) -> list[float]:
    """What each instruction of a stream adds, at its op's stage: with virtual stages a worker's ops
    belong to several chunks, each with its own activation size. `stage` (the worker's) serves the
    op-less instructions and ops whose stage is outside the model (a hand-made plan, left to `check`).
    A re-cut micro-batch (`cut`, `schedcomp.cut`) holds its stage's activation times its size."""
    tables: dict[int, dict[Any, float]] = {}
    out = []
    append, stages = out.append, costs.pp  # (a property: read once, not per instruction of a 3.6M-row plan)
    recut = cut or None  # (None: a plain truth test per instruction, not Cut.__bool__)
    for ins in instructions:
        op = ins.op
        s = op.stage if op is not None and 0 <= op.stage < stages else stage
        table = tables.get(s)
        if table is None:
            table = tables[s] = stage_deltas(costs, s)
        delta = table[ins.kind]
        append(delta * recut.size(op.pipeline, op.microbatch) if recut and op is not None and delta else delta)
    return out


def memory_levels(deltas: Iterable[float]) -> tuple[float, ...]:
    """Memory held after each step, from what each step adds (one worker runs its steps one at a time)."""
    return tuple(itertools.accumulate(deltas, initial=0.0))[1:]


def peak_of(levels: Sequence[float]) -> float:
    """The most memory held at any point (0 before the first step)."""
    return max(0.0, *levels) if levels else 0.0


def family_stage_peaks(name: str, pp: int, microbatches: int, costs: CostModel) -> tuple[float, ...]:
    """The most memory each stage holds in fault-free family `name` (every pipeline runs the same order);
    with virtual stages (`costs` has pp x chunks stages) the peak of each worker over its chunks.

    Built for any `microbatches`, also below the family's minimum: the orders stay valid there."""
    from schedcomp.schedules import get_family

    peaks = []
    for ops in get_family(name).orders(pp, microbatches, costs.pp // pp):
        deltas = {t: stage_deltas(costs, t) for t in {op.stage for op in ops}}  # a worker's chunks have their own
        peaks.append(peak_of(memory_levels(deltas[op.stage][op.kind] for op in ops)))
    return tuple(peaks)


def reference_family(topology: Topology) -> str:
    """The fault-free family whose peak bounds a failure plan of `topology` by default: ZB-H1, or with
    virtual stages the family that places its chunks the same way (interleaved-1f1b, zb-v)."""
    from schedcomp.schedules import FAMILIES

    if topology.chunks == 1:
        return REFERENCE
    return next(name for name, f in FAMILIES.items() if f.placement == topology.placement)


def resolve_limit(limit: MemoryLimit, topology: Topology, microbatches: int, costs: CostModel) -> CostModel:
    """`costs` with the memory limit `limit` names (see the module docstring)."""
    from schedcomp.schedules import FAMILIES

    if limit is None or (isinstance(limit, str) and limit.strip().lower() == NO_LIMIT):
        return costs.with_memory_limit(None)
    if isinstance(limit, str):
        name = limit.strip().lower()
        if name == FAULT_FREE:
            if costs.memory_limit is not None or not topology.failed:
                return costs
            name = reference_family(topology)
        if name in FAMILIES:
            if topology.chunks > 1 and not FAMILIES[name].placement:
                chunked = ", ".join(n for n, f in FAMILIES.items() if f.placement)
                raise MemoryLimitError(f"memory limit {limit!r} names a family with one stage per worker, but "
                                       f"this plan has {topology.chunks} chunks per worker: name {chunked}, or give "
                                       "a number")
            peaks = family_stage_peaks(name, topology.pp, microbatches, costs)
            # With virtual stages a limit is one number for every worker: the family's largest peak.
            return costs.with_memory_limit(peaks if topology.chunks == 1 else max(peaks))
        value, in_bytes = parse_memory(limit)
        if in_bytes and costs.memory_unit != "bytes":
            raise MemoryLimitError(
                f"memory limit {limit} is in bytes but the cost model's activation memory is in units: "
                "measure it (schedcomp profile TRACE -o costs.json, then --costs costs.json) or give the limit "
                "in activation units"
            )
        return costs.with_memory_limit(value)
    try:
        return costs.with_memory_limit(limit)
    except CostModelError as exc:
        raise MemoryLimitError(str(exc)) from None


def stage_peak_memory(peaks: Mapping[Worker, float], pp: int) -> tuple[float, ...]:
    """The most any worker of each place holds, from each worker's peak (with virtual stages a worker's
    peak spans all its chunks)."""
    return tuple(max((p for w, p in peaks.items() if w.stage == s), default=0.0) for s in range(pp))


def limit_facts(plan: Plan, peaks: Mapping[Worker, float] | None = None) -> dict[str, Any]:
    """Peak memory against the limit, for `compile --json`, `compare`, `precompile` and `PlanCache`;
    `peaks`: each worker's, when the caller has them already (a simulation's `memory`)."""
    from schedcomp.check import peak_memory

    costs = plan.costs
    peaks = peak_memory(plan) if peaks is None else peaks
    stage_peaks = list(stage_peak_memory(peaks, plan.topology.pp))
    limited = costs.memory_limit is not None
    facts: dict[str, Any] = {
        "memory_unit": costs.memory_unit,
        "memory_limit": list(costs.memory_limit) if isinstance(costs.memory_limit, tuple) else costs.memory_limit,
        "stage_peak_memory": stage_peaks,
    }
    # Each worker against its own pipeline's limit (a re-formed pipeline has its own, `Plan.costs_of`; every
    # other pipeline's is `costs`): the same verdict and headroom as each place's peak against its limit, as
    # every place of a plan without re-formed pipelines has a live worker, and a re-formed one's gaps hold nothing.
    limit_of = {w: plan.costs_of(w.pipeline).limit_at(w.stage) for w in peaks}
    facts["within_memory_limit"] = all(p <= limit_of[w] * (1 + 1e-9) for w, p in peaks.items())
    if limited:
        facts["memory_headroom"] = min((limit_of[w] - p for w, p in peaks.items()), default=math.inf)
    elif plan.topology.failed:
        facts["memory_note"] = (f"memory limit lifted: workers may hold more than the fault-free "
                                f"{reference_family(plan.topology)} plan "
                                "holds on their stage")
    return facts


OVER_PLAN = 0.20
"""A measured peak more than this fraction above the planned one is warned about."""


def planned_vs_measured(plan: Plan, spans: Sequence[Any]) -> list[dict[str, Any]]:
    """Per worker of `plan`: its planned peak activation memory and the peak measured in `spans` (a
    trace recorded with `profile=True`), both in bytes. A plan in activation units is scaled by the
    measured bytes one micro-batch's F adds at each stage. Raises `MemoryLimitError` when the trace
    carries no memory."""
    from schedcomp.check import peak_memory
    from schedcomp.profile import activation_bytes, measured_peaks

    measured = measured_peaks(spans)
    if not measured:
        raise MemoryLimitError("the trace carries no memory: record it with PipelineTrainer(profile=True) "
                               "from this version on")
    costs = plan.costs
    scale = [1.0] * costs.pp
    if costs.memory_unit != "bytes":
        per_stage = activation_bytes(spans, costs.pp)
        assert per_stage is not None  # measured peaks imply measured deltas
        scale = [b / a if a > 0 else 0.0 for b, a in zip(per_stage[0], costs.activation, strict=True)]
    rows = []
    for w, planned in sorted(peak_memory(plan).items()):
        got = measured.get(w)
        if got is None:
            continue
        want = planned * scale[w.stage]
        rows.append({"worker": str(w), "stage": w.stage, "planned": want, "measured": got,
                     "ratio": got / want if want > 0 else math.inf})
    return rows


def over_plan_warnings(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per stage whose measured peak is more than `OVER_PLAN` above the plan's."""
    worst: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["ratio"] > 1 + OVER_PLAN and r["ratio"] > worst.get(r["stage"], {"ratio": 0.0})["ratio"]:
            worst[r["stage"]] = r
    return [f"warning: stage {s} holds {r['ratio'] - 1:.0%} more activation memory than planned (worker {r['worker']}: "
            f"{r['measured']:.4g} bytes measured, {r['planned']:.4g} planned): re-profile (schedcomp profile TRACE "
            "-o costs.json) and compile with --costs costs.json" for s, r in sorted(worst.items())]
