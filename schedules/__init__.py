"""Schedule families: GPipe, 1F1B, ZB-H1 and ZB-H2 (fault-free), keyed by name in `FAMILIES`.

A family builds the compute order of each stage of one pipeline; `fault_free_order` copies it
to each of the dp pipelines and returns an `Order` for `schedcomp.lower.lower`.
"""

from __future__ import annotations

from schedcomp.errors import ScheduleError
from schedcomp.ir import Op, Order
from schedcomp.schedules import gpipe, one_f_one_b, zb_h1, zb_h2
from schedcomp.schedules.family import Family, StageOrders
from schedcomp.topology import Topology, Worker

FAMILIES: dict[str, Family] = {
    m.NAME: Family(m.NAME, m.build, m.min_microbatches, m.DESCRIPTION) for m in (gpipe, one_f_one_b, zb_h1, zb_h2)
}


def get_family(name: str) -> Family:
    """The family called `name`, or a `ScheduleError` listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        known = ", ".join(FAMILIES)
        raise ScheduleError(
            f"unknown schedule family {name!r}: choose one of {known} (or 'adaptive' for failures)"
        ) from None


def fault_free_order(family_name: str, topology: Topology, microbatches: int) -> Order:
    """The family's order, replicated on each of the dp pipelines (ops named with their pipeline)."""
    family = get_family(family_name)
    if topology.failed:
        names = ", ".join(str(w) for w in sorted(topology.failed))
        raise ScheduleError(
            f"{family.name} is a fault-free schedule but worker(s) {names} failed: "
            'use the adaptive schedules (schedule="adaptive", or --schedule adaptive)'
        )
    pp = topology.pp
    need = family.min_microbatches(pp)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < need:
        raise ScheduleError(
            f"{family.name} with pp={pp} needs at least {need} micro-batches, got {microbatches!r}: "
            f"use microbatches >= {need}"
        )
    stages: StageOrders = family.build(pp, microbatches)
    ops: dict[Worker, tuple[Op, ...]] = {}
    for d in range(topology.dp):
        for s, stage_ops in enumerate(stages):
            ops[Worker(d, s)] = tuple(Op(o.kind, d, o.microbatch, o.stage) for o in stage_ops)
    return Order(topology, microbatches, ops, family.name)


__all__ = ["FAMILIES", "Family", "fault_free_order", "get_family"]
