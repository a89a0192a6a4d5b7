"""Schedule families: GPipe, 1F1B, ZB-H1, ZB-H2, and with virtual stages interleaved 1F1B and ZB-V
(fault-free), keyed by name in `FAMILIES`.

A family builds the compute order of each worker of one pipeline; `fault_free_order` copies it
to each of the dp pipelines and returns an `Order` for `schedcomp.lower.lower`. A family with
virtual stages runs on a topology with its placement (`Topology.chunks`, `Topology.placement`).
"""

from __future__ import annotations

from schedcomp.errors import ScheduleError
from schedcomp.ir import Op, Order
from schedcomp.schedules import gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zb_h2, zb_v
from schedcomp.schedules.family import Family, StageOrders
from schedcomp.topology import Topology, Worker

FAMILIES: dict[str, Family] = {
    m.NAME: Family(m.NAME, m.build, m.min_microbatches, m.DESCRIPTION) for m in (gpipe, one_f_one_b, zb_h1, zb_h2)
}
FAMILIES.update({m.NAME: Family(m.NAME, m.build, m.min_microbatches, m.DESCRIPTION, m.PLACEMENT, m.DEFAULT_CHUNKS)
                 for m in (interleaved_1f1b, zb_v)})
ONE_STAGE_FAMILIES = tuple(name for name, family in FAMILIES.items() if not family.placement)
"""The families that run one stage per worker (the others hold several chunks: `Family.placement`)."""


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
    if family.placement and topology.chunks > 1 and topology.placement != family.placement:
        raise ScheduleError(f"{family.name} places chunks {family.placement!r} but the topology places them "
                            f"{topology.placement!r}: build it with placement={family.placement!r}")
    stages: StageOrders = family.orders(pp, microbatches, topology.chunks)
    ops: dict[Worker, tuple[Op, ...]] = {}
    for d in range(topology.dp):
        for s, stage_ops in enumerate(stages):
            ops[Worker(d, s)] = tuple(Op(o.kind, d, o.microbatch, o.stage) for o in stage_ops)
    return Order(topology, microbatches, ops, family.name)


__all__ = ["FAMILIES", "ONE_STAGE_FAMILIES", "Family", "fault_free_order", "get_family"]
