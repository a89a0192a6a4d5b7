"""`compile(..., reform="auto")`: of several ways to compile one job, keep the fastest plan.

With per-layer costs and failures the compiler has two answers (issue 14, part 1): re-route the lost work
to live peers (re-partitioning layers, re-cutting with `recut`: one partition in every pipeline) or re-form
the pipelines that lost workers over their live workers (`schedcomp.reform`, the batch re-balanced by
throughput). Which wins depends on the failures: re-forming where they are concentrated in a pipeline,
re-routing where they are spread. `fastest` compiles each candidate and keeps the smallest period. Every
candidate's plan has passed `check`, memory limit included, so a plan over the limit never competes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from schedcomp.errors import MemoryLimitError, RecoveryError, SchedcompTypeError, ScheduleError, TopologyError
from schedcomp.ir import Plan

AUTO = "auto"
NEVER = "never"
Reform = Iterable[int] | Literal["auto", "never"]
"""`compile(reform=)`: pipelines to re-form (forced), "auto" (re-form where it beats re-routing) or "never"."""

def reform_mode(value: object) -> Literal["auto", "never"] | tuple[int, ...]:
    """`reform=` read: "auto", "never", or the pipelines named (checked against the job by `reform_pipelines`)."""
    if value is None:  # (the default before "auto": no pipeline re-formed)
        return NEVER
    if isinstance(value, str):
        if value not in (AUTO, NEVER):
            raise ScheduleError(f"reform must be 'auto', 'never' or pipelines to re-form, got {value!r}")
        return AUTO if value == AUTO else NEVER
    if isinstance(value, bytes) or not isinstance(value, Iterable):
        raise SchedcompTypeError(f"reform must be 'auto', 'never' or a list of pipelines to re-form, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class Timed:
    """A candidate's checked plan and its simulated period (`simulate(plan).period`): a candidate that timed
    its plan on the way (the re-formed one times each of its variants) hands the period over, so `fastest`
    does not simulate the plan a second time."""

    plan: Plan
    period: float


def timed(plan: Plan) -> Timed:
    """`plan` with its simulated period, for a candidate that did not simulate it on the way."""
    from schedcomp.simulator import simulate

    return Timed(plan, simulate(plan).period)


Candidate = tuple[str, Callable[[], Timed]]
"""A name for `meta["choice"]` and a function compiling that candidate's checked plan, with its period."""

CANNOT_COMPILE = (ScheduleError, MemoryLimitError, RecoveryError, TopologyError)
"""What a candidate raises when it cannot build this job (no piece fits the limit, a pipeline lost every
worker, a stage lost every replica): it drops out. Anything else (a plan `check` refuses) is a bug and
propagates."""

TIE = 1e-9
"""Periods within this relative tolerance tie (the simulator's sums differ in the last bits)."""


def fastest(candidates: Sequence[Candidate]) -> Plan:
    """The plan with the smallest simulated period among `candidates` that compile (each hands over its
    period: no plan is simulated here); ties go to the earlier one. Its `meta["choice"]` names the kept
    candidate and each one's period (None: it dropped out). When none compiles, the first candidate's error
    is raised."""
    periods: dict[str, float | None] = {}
    best: tuple[float, str, Plan] | None = None
    first_error: Exception | None = None
    for name, build in candidates:
        try:
            candidate = build()
        except CANNOT_COMPILE as exc:
            first_error = first_error or exc
            periods[name] = None
            continue
        plan, period = candidate.plan, candidate.period
        periods[name] = period
        if best is None or period < best[0] * (1 - TIE):
            best = (period, name, plan)
    if best is None:
        assert first_error is not None, "fastest needs at least one candidate"
        raise first_error
    _, name, plan = best
    return plan.with_meta({**plan.meta, "choice": {"kept": name, "periods": periods}})
