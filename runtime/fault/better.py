"""Switching every member to a better plan for the same failed set, at one agreed iteration boundary.

A plan source with `improved(topology) -> Plan | None` (`schedcomp.improving.ImprovingPlans`) serves a
failure set its cache lacks with a repaired plan and compiles it fully in the background; each worker's
compile finishes at its own time. Per generation G, in the store (`Keys.better`):
1. a worker holding the better plan offers its digest: the first offer's digest wins, and a worker whose
   plan differs turns the switch off for G (`off`), logging both digests; the others count themselves
   `ready`;
2. at each iteration boundary, the first worker to see every member ready fixes the switch iteration as a
   rejoin does (`agreement.switch_iteration`: no member can be past it yet) with `compare_set` (`at`);
3. every member calls `use_plan` at that boundary.
Keys are the generation's, so a failure (a new generation) cancels a pending switch; a worker whose
compile fails or does no better never offers, and nobody switches.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from torch.distributed import Store

from schedcomp.ir import Plan
from schedcomp.runtime.fault.agreement import switch_iteration
from schedcomp.runtime.fault.membership import GenerationAborted, View
from schedcomp.runtime.fault.store import Keys
from schedcomp.topology import Topology

log = logging.getLogger(__name__)

Improved = Callable[[Topology], "Plan | None"]


def offer_better(store: Store, view: View, digest: str) -> bool:
    """Say this member holds a better plan for `view`'s failed set, by its digest; False when the first
    offer's digest differs (nobody then switches in this generation)."""
    first = store.compare_set(Keys.better(view.generation, "digest"), "", digest).decode()
    if first != digest:
        store.set(Keys.better(view.generation, "off"), "1")
        log.warning("generation %d: this worker's better plan (%s) differs from another's (%s): no switch",
                    view.generation, digest[:12], first[:12])
        return False
    store.add(Keys.better(view.generation, "ready"), 1)
    return True


def agreed_better(store: Store, view: View, completed: int, lead: int) -> int | None:
    """The iteration from which every member runs the better plan of this generation, or None yet: fixed
    by the first member to see every member ready, at `switch_iteration(completed, lead)`."""
    at = Keys.better(view.generation, "at")
    if store.check([at]):
        return int(store.get(at))
    if store.check([Keys.better(view.generation, "off")]):
        return None
    if store.add(Keys.better(view.generation, "ready"), 0) < len(view.members):
        return None
    return int(store.compare_set(at, "", str(switch_iteration(completed, lead))))


@dataclass
class _Offer:
    generation: int
    plan: Plan | None  # None: offered nothing that can be switched to (differing digests)


class BetterPlan:
    """One worker's side of the switch (see the module docstring): `due(view, completed)` is the plan to
    run from the next iteration, at the boundary every member agreed on, or None."""

    def __init__(self, improved: Improved, store: Store, lead: int) -> None:
        self.improved, self.store, self.lead = improved, store, lead
        self._offer: _Offer | None = None

    def due(self, view: View, completed: int) -> Plan | None:
        if not view.failed:  # the cache holds the fault-free plan
            return None
        if self._offer is None or self._offer.generation != view.generation:
            plan = self.improved(view.topology)
            if plan is None:
                return None
            digest = hashlib.sha256(plan.to_text().encode()).hexdigest()
            self._offer = _Offer(view.generation, plan if offer_better(self.store, view, digest) else None)
        plan = self._offer.plan
        if plan is None:
            return None
        at = agreed_better(self.store, view, completed, self.lead)
        if at is None or at > completed + 1:
            return None
        self._offer.plan = None  # switched (or given up): once per generation
        if at < completed + 1:  # past it already: the others switched, so this worker cannot run with them
            raise GenerationAborted(f"generation {view.generation}: the better plan was due from iteration {at}, but "
                                    f"this worker is at {completed + 1}: agree on the next generation")
        return plan
