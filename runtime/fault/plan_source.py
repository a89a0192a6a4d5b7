"""A resilient job's plan source as its workers ask it (`ResilientTrainer(plans, ...)`).

`PlanSource` wraps what the user passed, a `PlanCache`, an `ImprovingPlans` or any `topology -> Plan`:

- it asks it with the job's chunks per worker and their placement (a cache knows them; a function's are
  those of its first plan), whatever topology the session hands it (the session's count places);
- it refuses, in one line and before training, what the recovery policy cannot run of what it may serve
  (`fault.policies`: virtual stages, re-cut micro-batches, re-formed pipelines, plans that cut the model
  elsewhere), as far as the source says in advance; the rest as each plan is served (`plan_for`, `refuse_cut`);
- it keeps the cuts of the re-cut plans a failure may bring, checked against each batch size
  (`data.PieceRows`), and whether its plans may move layers (then every stage is checked movable at start).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import Plan
from schedcomp.partition import Partition
from schedcomp.runtime.data import PieceRows
from schedcomp.runtime.fault.policies import (
    cut_of,
    cuts_of,
    keeps_stages,
    may_cut_elsewhere,
    may_recut,
    may_reform,
    recuts_of,
    refuse_chunks,
    refuse_moves,
    refuse_recut,
    refuse_reformed,
)
from schedcomp.runtime.fault.recovery import RecoveryPolicy
from schedcomp.runtime.moves import Cuts
from schedcomp.runtime.training import TrainingOptions
from schedcomp.topology import LOOP, Topology

Lookup = Callable[[Topology], Plan]


class PlanSource:
    """The plans a resilient job runs, from `plans`, checked against its `policy` and training `options`.

    `model` is what the trainer builds stages from (an `nn.Sequential` is cut by each plan's partition).
    """

    def __init__(self, plans: Any, model: Any, policy: RecoveryPolicy, options: TrainingOptions) -> None:
        self.source = plans
        self.model, self.policy = model, policy
        # anything with `lookup(topology) -> Plan` (a `PlanCache`) or a plain function
        self.lookup: Lookup = plans.lookup if hasattr(plans, "lookup") else plans
        # the job's chunks per worker and their placement (a `PlanCache` knows them; see `plan_for`)
        self.chunks, self.placement = getattr(plans, "chunks", 1), getattr(plans, "placement", LOOP)
        refuse_chunks(policy, self.chunks)
        options.refuse_chunks(self.chunks)
        refuse_reformed(policy, may_reform(plans), model)  # from a cache's index: before its plans are read
        refuse_recut(policy, may_recut(plans))
        self.pieces = PieceRows(recuts_of(plans))  # each batch size against the re-cut plans a failure may bring
        # plans that cut the model elsewhere move layers at a switch (`runtime.moves`): lossy and logging refuse
        self.cuts: set[Cuts | None] = set(cuts_of(plans, model)) if keeps_stages(policy) else set()
        refuse_moves(policy, self.cuts)
        self.moves_layers = may_cut_elsewhere(plans, model)  # then every stage is checked movable at start
        if self.moves_layers and keeps_stages(policy):
            raise RuntimeSetupError(f"the {policy.name} policy keeps each stage's layers in place, but this plan "
                                    "source may switch to plans that move them (a cache with layer costs, compiled "
                                    "further in the background): use policy='rollback' (the default)")

    def plan_for(self, topology: Topology) -> Plan:
        """The cached plan for this topology's failed set (the session's topologies count places;
        the plan source is asked with the job's chunks and placement)."""
        plan = self.lookup(Topology.of(topology.pp, topology.dp, topology.failed, self.chunks, self.placement))
        self.chunks, self.placement = plan.topology.chunks, plan.topology.placement
        # a function's plans: known as it serves them
        refuse_reformed(self.policy, plan.partitions is not None, self.model)
        self.refuse_cut(plan)
        refuse_recut(self.policy, bool(plan.cut))
        if plan.cut and plan.cut not in self.pieces.cuts:  # a function's: checked now, on every worker alike
            self.pieces.add(plan.cut)
            problem = self.pieces.piece_problem(plan.cut, plan.topology.dp, plan.microbatches)
            if problem:
                raise RuntimeSetupError(f"the plan for failed workers {', '.join(map(str, sorted(topology.failed)))} "
                                        f"has a piece that {problem}: use a larger batch, or pass the PlanCache "
                                        "itself (or ImprovingPlans) so its cuts are checked before training")
        return plan

    def refuse_cut(self, plan: Plan) -> None:
        """Refuse (one line) a plan whose cut of the model the policy cannot move to (`policies.refuse_moves`)."""
        self.cuts.add(cut_of(plan, self.model))
        refuse_moves(self.policy, self.cuts)

    def base_cut(self, pp: int, dp: int) -> Partition | None:
        """The job's base cut: its healthy plan's (no worker failed), the one per-stage checkpoints restore into."""
        healthy = self.lookup(Topology.of(pp, dp, (), self.chunks, self.placement))
        if healthy.partitions is not None:  # (compile re-forms only pipelines that lost workers)
            raise RuntimeSetupError("the plan source's fault-free plan re-forms pipelines: serve one partition for "
                                    "every pipeline when no worker failed")
        cut = cut_of(healthy, self.model)
        assert cut is None or isinstance(cut[0], int)
        return cut  # type: ignore[return-value]

    def close(self) -> None:
        """Stop what the source runs in the background (`ImprovingPlans`' compiles), if anything."""
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
