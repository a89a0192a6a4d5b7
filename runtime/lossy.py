"""`LossyPolicy`, the lossy-forward recovery of `ResilientTrainer(policy="lossy")`: finish the interrupted iteration.

Rollback (the default) re-runs the iteration a failure hit, so the model trained is exactly the
fault-free one. Lossy forward (Nicolae et al., CCGrid 2022) trades samples for time: the
survivors finish that iteration from where each stopped, on the new generation, without the
micro-batches the failure took; nothing is undone or re-run. `fault.residual` decides what each
survivor still runs; this module gathers what it needs and runs it:

1. Claim: lossy finishing is tried once per iteration. The first survivor to claim iteration i
   writes its generation into the store (`compare_set`: every survivor reads the same value);
   a later generation finding another's claim (a failure while finishing) falls back to rollback,
   which is always correct: whoever stepped in the unfinished attempt restores its snapshot and
   the iteration is re-run in full. Rollback is also used when the new generation admits
   replacements (they hold no state of the iteration), when some survivor already dropped its
   state (an earlier attempt to recover failed before this claim), when nothing of the iteration
   had run anywhere (re-running it loses nothing), after the last iteration, or when the
   residuals cannot be computed (survivors ran different plans; see `fault.residual`).
2. Progress: every survivor publishes how many instructions of iteration i it completed and a
   digest of the plan it ran; all wait for all (abortable), so all compute the same residuals.
3. Regroup onto the cached plan for the new failed set, plus the old plan's channels among
   survivors (the residual's transfers follow the old plan).
4. Stages whose live replicas had partly stepped: the stepped one sends its state (and ledger).
5. Run the residual (`PipelineTrainer.resume`). A lost micro-batch whose B already ran on a
   survivor gets its W there too (no communication needed): B already put the gradients of the
   layers that do not defer theirs (norms, embeddings) into `.grad`, so the whole micro-batch
   counts at that stage, as its ledger says. At STEP each stage scales its reduced gradient by
   `chunks / contributors`, contributors being the micro-batches its ledger counts, so the update
   is the mean gradient over the micro-batches that stage holds (`lossy_scale`); a stage left
   with none skips its optimizer step (both decided by `LossyPolicy.on_step`).

The policy's state (`LossyPolicy.recent`, kept from `on_iteration`): the last two iterations'
state on this worker. Cost when nothing fails: each worker keeps the tensors it sent in the
previous iteration (the activations and gradients crossing its stage boundaries) until the
current one ends, because a failure may catch a receiver that never consumed them after their
sender moved on.

The next iteration then runs on the new plan. A finished iteration is not checkpointed (a second
failure could still roll it back; the next iteration's checkpoint is taken as usual).
`Report.skipped[i]` lists the global-batch chunks lost in iteration i, `Report.skipped_samples[i]`
their samples.
"""

from __future__ import annotations

import hashlib
import json
import logging

import torch
from torch import Tensor

from schedcomp.errors import RecoveryError
from schedcomp.ir import Plan
from schedcomp.runtime.comm import channels
from schedcomp.runtime.data import as_tuple
from schedcomp.runtime.executor import Iteration
from schedcomp.runtime.fault.protocol import await_keys
from schedcomp.runtime.fault.recovery import OnFailure, RecoveryHost, RollbackPolicy, StepDecision
from schedcomp.runtime.fault.residual import residuals, skipped_chunks
from schedcomp.runtime.fault.rollback import Rollback
from schedcomp.runtime.fault.transfer import recv_stage_state, send_stage_state
from schedcomp.topology import Worker

log = logging.getLogger(__name__)


def lossy_scale(ledger: Tensor | None) -> float:
    """`chunks / contributors` for a reduced ledger (1.0 when every micro-batch counted, or no ledger)."""
    if ledger is None:
        return 1.0
    held = int(torch.count_nonzero(ledger))
    return ledger.numel() / held if 0 < held < ledger.numel() else 1.0


def plan_digest(plan: Plan) -> str:
    return hashlib.sha256(plan.to_text().encode()).hexdigest()[:16]


class LossyPolicy(RollbackPolicy):
    """Finish the interrupted iteration without the lost micro-batches (see the module docstring).

    Its state: `recent`, this worker's state of its last two iterations (kept from `on_iteration`),
    and `intact`, whether it still holds the interrupted one (False once the trainer dropped it).
    """

    name = "lossy"

    def __init__(self) -> None:
        self.recent: dict[int, Iteration] = {}
        self.intact = False

    def on_iteration(self, it: Iteration) -> None:
        it.keep_sent = True  # a receiver may not have consumed them when a failure hits
        self.recent = {n: r for n, r in self.recent.items() if n >= it.number - 1}
        self.recent[it.number] = it

    def on_step(self, it: Iteration) -> StepDecision:
        # A stage whose ledger counts nothing holds no gradient: momentum or decay must not move it.
        return StepDecision(lossy_scale(it.ledger), it.ledger is None or bool(it.ledger.any()))

    def on_failure(self, error: BaseException) -> OnFailure:
        self.intact = True  # finish the iteration from this state
        return OnFailure.KEEP

    def on_drop(self) -> None:
        self.recent.clear()
        self.intact = False

    def finish(self, host: RecoveryHost, decision: Rollback) -> int | None:
        return finish_interrupted(host, decision, self)


def finish_interrupted(rt: RecoveryHost, decision: Rollback, state: LossyPolicy) -> int | None:
    """Finish iteration `decision.rerun` without the lost micro-batches; returns the next iteration.

    `state`: the policy's state of the interrupted iteration (`state.intact`: this worker still
    holds it; it was not dropped by an earlier attempt to recover). Returns None (use rollback)
    in the cases of the module docstring; raises `GenerationAborted` / `RuntimeError` if the
    generation breaks meanwhile (recovery starts over).
    """
    session, trainer, report = rt.session, rt.trainer, rt.report
    assert trainer is not None and report is not None and session.view is not None and rt.snapshot is not None
    i, view = decision.rerun, session.view
    if i >= rt.iterations:  # the failure hit after the last iteration was stepped everywhere
        return None
    claim = session.store.compare_set(f"lossy/{i}", "", str(view.generation)).decode()
    if claim != str(view.generation) or session.joiners():
        return None
    current = state.recent.get(i)
    plan = current.plan if current is not None else trainer.plan
    mine = {"progress": current.index if current is not None else 0, "plan": plan_digest(plan), "intact": state.intact}
    records = _exchange(rt, f"gen{view.generation}/progress", mine)
    if len({r["plan"] for r in records.values()}) > 1 or not all(r["intact"] for r in records.values()):
        return None
    if not any(r["progress"] for r in records.values()):  # nothing of it ran: re-running loses nothing
        return None
    if any(records[w]["progress"] != len(plan.streams[w]) for w in decision.undo):
        return None  # a worker that stepped must have finished its stream: records inconsistent
    failed = [w for w in plan.workers if w not in view.members]
    try:
        residual = residuals(plan, {w: r["progress"] for w, r in records.items()}, failed)[session.me]
    except RecoveryError as e:  # every survivor computes the same: all fall back together
        log.warning("worker %s: cannot finish iteration %d without the lost micro-batches (%s): rolling back",
                    session.me, i, e)
        return None
    if any(n > i for n in state.recent):  # it had begun iteration i + 1: nothing of it was stepped anywhere
        state.recent = {i: current} if current is not None else {}
        trainer.stage.discard()
        trainer.stage.optimizer.zero_grad(set_to_none=True)
    trainer.regroup(rt.plan_for(view.topology), session.groups.rank, session.generation.new_group, rt.wait)
    trainer.comm.connect(channels(plan, among=view.members))
    ledger = current.ledger if current is not None and current.ledger is not None else \
        torch.zeros(trainer.dp * plan.microbatches, dtype=torch.float64)
    stage = trainer.stage
    if residual.donor is not None:  # its replica stepped: take that state (and what it counted) instead
        rt.snapshot.take(i)
        got = recv_stage_state(stage.module, stage.optimizer, session.groups.world,
                               src=session.groups.rank_of(residual.donor), wait=rt.wait)
        ledger.copy_(torch.tensor(got.info["ledger"], dtype=torch.float64))
        stage.optimizer.zero_grad(set_to_none=True)
        session.commit(i)
    for recipient in residual.recipients:
        send_stage_state(stage.module, stage.optimizer, session.groups.world, [session.groups.rank_of(recipient)],
                         info={"ledger": report.ledger.get(i, ledger.tolist())}, wait=rt.wait)
    batch = rt.batch_for(i)
    it = trainer.resume(i, batch, residual, step=rt.step_for(i, checkpoint=False), ledger=ledger, interrupted=current,
                        started=state.on_iteration)
    lost = skipped_chunks(residual.lost, plan.microbatches)
    rt.record(i, it)
    report.skipped[i] = list(lost)
    report.skipped_samples[i] = len(lost) * _rows(batch, trainer.dp * plan.microbatches)
    log.warning("worker %s: finished iteration %d without %d lost micro-batches (%d samples)", session.me, i,
                len(lost), report.skipped_samples[i])
    return i + 1


def _rows(batch: tuple, chunks: int) -> int:
    """Samples per micro-batch: the global batch's leading dimension over the chunks."""
    return int(as_tuple(batch[0])[0].shape[0]) // chunks


def _exchange(rt: RecoveryHost, prefix: str, record: dict, poll: float = 0.002) -> dict[Worker, dict]:
    """Publish this worker's record under `prefix` and read every member's (gives up if the generation breaks,
    `MeetingTimeout` past the agreement timeout: see `protocol.await_keys`)."""
    session = rt.session
    assert session.view is not None
    store, members = session.store, session.view.members
    store.set(f"{prefix}/{session.me}", json.dumps(record))
    keys = [f"{prefix}/{w}" for w in members]
    await_keys(store, keys, session.signal, timeout=session.agree_timeout, what=f"every member's record at {prefix}",
               poll=poll)
    return {w: json.loads(store.get(k)) for w, k in zip(members, keys, strict=True)}
