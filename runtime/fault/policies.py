"""Which recovery policy a `ResilientTrainer` runs, from its arguments (`policy`, `checkpoint`,
`logging`), and which ones a job with virtual stages, whose plans move layers, whose plans re-cut
micro-batches, or whose plans re-form pipelines, refuses (`cut_of`: each plan's cut, per pipeline where it
re-forms them).

The policies themselves are in `fault.recovery` (rollback, restart), `runtime.lossy` and
`fault.swift` (logging-based recovery).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from schedcomp.cut import Cut
from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.ir import Plan
from schedcomp.runtime.fault.boundary_log import LoggingPolicy
from schedcomp.runtime.fault.recovery import RecoveryPolicy, RestartPolicy, RollbackPolicy
from schedcomp.runtime.fault.restart import RESTART, CheckpointPolicy
from schedcomp.runtime.fault.swift import SwiftPolicy
from schedcomp.runtime.lossy import LossyPolicy
from schedcomp.runtime.moves import Cuts
from schedcomp.runtime.stage import even_split

POLICIES: dict[str, Callable[[], RecoveryPolicy]] = {"rollback": RollbackPolicy, "lossy": LossyPolicy,
                                                     "restart": RestartPolicy}


def recovery_policy(policy: str | RecoveryPolicy, checkpoint: CheckpointPolicy | None = None,
                    logging: LoggingPolicy | None = None) -> RecoveryPolicy:
    """The policy object `ResilientTrainer(policy=..., checkpoint=..., logging=...)` runs: a name maps to a fresh one.

    `CheckpointPolicy(on_failure="restart")` is the older spelling of `policy="restart"`; `logging`
    makes the default policy logging-based recovery (`fault.swift.SwiftPolicy`).
    """
    if logging is not None:
        if policy != "rollback" or checkpoint is None or checkpoint.on_failure == RESTART:
            raise RecoveryError("logging-based recovery replays from checkpoints and rolls back otherwise: pass "
                                "checkpoint=CheckpointPolicy(...) (on_failure='replan') and no other policy")
        return SwiftPolicy(logging, checkpoint)
    if checkpoint is not None and checkpoint.on_failure == RESTART:
        if not isinstance(policy, (str, RestartPolicy)):
            raise RecoveryError(f"on_failure='restart' restarts on every failure, so recovery policy {policy!r} "
                                "would never run: pass one or the other")
        policy = "restart"
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise RecoveryError(f"unknown recovery policy {policy!r}: use one of {', '.join(POLICIES)}")
        policy = POLICIES[policy]()
    if not isinstance(policy, RecoveryPolicy):
        raise RecoveryError(f"recovery policy {policy!r} lacks the hooks of `fault.recovery.RecoveryPolicy`: "
                            "subclass RollbackPolicy and override what you need")
    if isinstance(policy, RestartPolicy) and checkpoint is None:
        raise RecoveryError("recovery policy 'restart' needs a checkpoint: pass checkpoint=CheckpointPolicy(...)")
    return policy


def refuse_chunks(policy: RecoveryPolicy, chunks: int) -> None:
    """Refuse, in one line, a policy that recovers one stage per worker for a job whose workers hold
    several chunks (lossy: its residual streams and rescaling; logging: its boundary logs and replay)."""
    if chunks <= 1:
        return
    if isinstance(policy, SwiftPolicy):
        raise RuntimeSetupError(f"logging-based recovery replays one stage per worker, but this job's workers hold "
                                f"{chunks} chunks: drop logging= (rollback, and checkpoint-restart when a place "
                                "loses every worker)")
    if isinstance(policy, LossyPolicy):
        raise RuntimeSetupError(f"the lossy policy finishes an iteration one stage per worker, but this job's workers "
                                f"hold {chunks} chunks: use policy='rollback' (the default) with virtual stages")


def refuse_moves(policy: RecoveryPolicy, partitions: Iterable[Cuts | None]) -> None:
    """Refuse, in one line, a policy that works one fixed stage per worker when the plans cut the model in
    more than one way (lossy: its residual streams; logging: its boundary logs and replay)."""
    cuts = set(partitions)
    if len(cuts) <= 1 or not keeps_stages(policy):
        return
    shown = ", ".join(str(list(c)) if c is not None else "the runtime's" for c in sorted(cuts, key=str))
    raise RuntimeSetupError(f"the {policy.name} policy keeps each stage's layers in place, but the plans cut the "
                            f"model in {len(cuts)} ways ({shown}): use policy='rollback' (the default), which moves "
                            "layers at a plan switch")


def refuse_reformed(policy: RecoveryPolicy | None, reformed: bool, model: Any) -> None:
    """Refuse, in one line, plans that may re-form pipelines (`reformed`) with a stage builder (their workers take
    their own pipeline's layers of one model) or with a policy that keeps one fixed stage per worker and whole
    micro-batches (re-formed workers hold other layers and run other shares of the batch)."""
    if reformed and not isinstance(model, nn.Sequential):
        raise RuntimeSetupError("the plan source serves plans with re-formed pipelines (per-pipeline partitions), "
                                "whose workers take their own pipeline's layers of the model: pass the model as an "
                                "nn.Sequential, not a stage builder")
    if reformed and policy is not None and not runs_pieces(policy):
        raise RuntimeSetupError(f"the {policy.name} policy keeps each stage's layers and whole micro-batches, but this "
                                "plan source serves plans with re-formed pipelines: use policy='rollback' (the "
                                "default), or plans compiled with reform='never' (schedcomp precompile --reform "
                                "never)")


def may_reform(plans: Any) -> bool:
    """Whether a plan source may serve plans with re-formed pipelines, as far as known in advance: a cache whose
    index gives some scenario's partitions (`PlanCache.partitions`), or whose plans in memory re-form, or whose
    cuts have shares (only re-formed plans have them). A plain function's are known only as it serves them."""
    cache = getattr(plans, "cache", plans)
    indexed, held = getattr(cache, "partitions", None), getattr(cache, "plans", None)
    return (bool(indexed) and isinstance(indexed, Mapping)) or any(cut.shares for cut in recuts_of(plans)) or (
        isinstance(held, Mapping) and any(isinstance(p, Plan) and p.partitions is not None for p in held.values()))


def keeps_stages(policy: RecoveryPolicy) -> bool:
    """Whether `policy` works one fixed stage per worker on whole micro-batches: lossy (its residual streams, lost
    chunks and rescaling) and logging (its boundary logs and replay) do, so they run no plan that moves layers,
    re-cuts micro-batches or re-forms pipelines."""
    return isinstance(policy, (LossyPolicy, SwiftPolicy))


def runs_pieces(policy: RecoveryPolicy) -> bool:
    """Whether `policy` can run plans that re-cut micro-batches (`keeps_stages`' policies work with whole ones)."""
    return not keeps_stages(policy)


def refuse_recut(policy: RecoveryPolicy, recut: bool) -> None:
    """Refuse, in one line, a policy that works with whole micro-batches when the plans may re-cut them."""
    if recut and not runs_pieces(policy):
        raise RuntimeSetupError(f"the {policy.name} policy works with whole micro-batches, but this plan source "
                                "re-cuts them (precompile --recut): use policy='rollback' (the default), or a cache "
                                "precompiled without --recut")


def may_recut(plans: Any) -> bool:
    """Whether a plan source may serve plans that re-cut micro-batches (`schedcomp.cut`): a cache precompiled
    with `recut` (its index says so; `ImprovingPlans` then compiles with it too), or one whose plans re-cut.
    A plain function's are known only as it serves them (False)."""
    return getattr(getattr(plans, "cache", plans), "recut", False) is True or bool(recuts_of(plans))


def recuts_of(plans: Any) -> list[Cut]:
    """The cuts of micro-batches of the plans a source may serve, as far as known in advance: those a cache's
    index gives (`PlanCache.cuts`, no plan read) and those of the plans it holds; none for a plain function."""
    cache = getattr(plans, "cache", plans)
    indexed, held = getattr(cache, "cuts", None), getattr(cache, "plans", None)
    found = list(indexed.values()) if isinstance(indexed, Mapping) else []
    return found + ([plan.cut for plan in held.values() if isinstance(plan, Plan) and plan.cut]
                    if isinstance(held, Mapping) else [])


def cut_of(plan: Plan, model: Any) -> Cuts | None:
    """The cut `plan` runs `model` at: per pipeline its partition where it re-forms pipelines (`Plan.partitions`),
    else its partition, else the runtime's even split of an `nn.Sequential` (None for a stage builder). Every
    plan a resilient job takes passes here (at construction those of a cache it reads, then each as it is
    served); a re-formed plan's layers are cut from the model, so a stage builder is refused here, in one line."""
    if plan.partitions is not None:
        refuse_reformed(None, True, model)
        # Each place's checkpoint writer is its lowest live pipeline; with every pipeline that lost workers
        # re-formed, those writers hold every layer between them. Re-routing beside a re-formed pipeline breaks that.
        rerouted = sorted({w.pipeline for w in plan.topology.failed if plan.partitions[w.pipeline][w.stage]})
        if rerouted:
            raise RuntimeSetupError(f"this plan re-forms some pipelines but re-routes around the failures of pipeline "
                                    f"{rerouted[0]}: resilient jobs run plans that re-form every pipeline that lost "
                                    "workers (as compile(reform=...) makes them), or none")
        return plan.partitions
    if plan.partition is not None or not isinstance(model, nn.Sequential):
        return plan.partition
    return even_split(len(model), plan.topology.stages)


def may_cut_elsewhere(plans: Any, model: Any) -> bool:
    """Whether a plan source may switch to plans that cut the model elsewhere (so layers move): a cache with
    layer costs whose plans cut it in more than one way, or whose background compiles may re-partition
    (`ImprovingPlans`), one that may re-form pipelines (`may_reform`), or a cache holding such plans in
    memory. A plain function is not known in advance, nor a cache without layer costs whose plans on disk
    were edited to cut elsewhere: False (a refusal then comes at the switch)."""
    if not isinstance(model, nn.Sequential):
        return False
    cache = getattr(plans, "cache", plans)
    layered = getattr(cache, "layers", None) is not None
    if layered and hasattr(plans, "improved"):
        return True
    if layered:  # its plans re-partition: read them all now (a lookup at failure time then reads none)
        return len(set(cuts_of(plans, model))) > 1
    if may_reform(plans):  # a re-formed plan always cuts the model elsewhere (known from a cache's index)
        return True
    # Without layer costs a precompiled cache's plans leave the cut to the runtime: only the plans already in
    # memory are looked at. Reading every plan from disk at start costs seconds per plan at scale, which a
    # job that never moves a layer should not pay.
    held = getattr(cache, "plans", None)
    return isinstance(held, Mapping) and len({cut_of(plan, model) for plan in held.values()}) > 1


def cuts_of(plans: Any, model: Any) -> list[Cuts | None]:
    """The cuts of every plan a `PlanCache` (or `ImprovingPlans`' cache) holds (read from disk); a plain
    function's are known only as it serves them (empty)."""
    cache = getattr(plans, "cache", plans)
    if not (hasattr(cache, "preload") and hasattr(cache, "plans")):
        return []
    cache.preload()
    return [cut_of(plan, model) for plan in cache.plans.values()]
