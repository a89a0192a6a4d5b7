"""The training loop around the optimizer step: LR schedules, global gradient clipping, non-finite skip.

`PipelineTrainer(..., lr_scheduler=, max_grad_norm=, skip_nonfinite=, grad_check=)` (and
`ResilientTrainer` with the same options) give what users of DeepSpeed or Megatron expect, without
giving up the staggered optimizer:

- LR schedules: `lr_scheduler(optimizer)` builds one torch scheduler per stage; it steps right after
  the stage's optimizer, once per applied update (a skipped update does not advance it, as in
  Megatron and DeepSpeed). Its state travels with the optimizer's wherever a stage's state goes
  (`transfer.stage_state`: step snapshots, replica transfers, checkpoints), so the schedule stays
  exact across plan switches, rollbacks, rejoins and restarts.
- Global checks: the norm over every stage's gradients (as `clip_grad_norm_` computes it on the
  whole model) and a non-finite flag need a value from every stage. Each worker launches an
  asynchronous all-reduce of its stage's share at STEP (the lowest live replica of a stage counts
  its norm, so replicas are not counted twice). Two ways to use it (`grad_check`):
  - "post" (default, Zero Bubble's post-validation): the stage steps at once, optimistically, and
    validates when the result arrives, at the start of its next iteration (or when the step's
    result is read); a step that turns out wrong (clipping was due, or a gradient anywhere was
    not finite) is undone from the snapshot taken before it and redone clipped (or not redone).
    A stage that already knows its step will be wrong (its own norm exceeds the limit, its own
    gradient is not finite) waits for the result instead of stepping twice.
  - "barrier": every stage waits for the result before stepping (the synchronous barrier, for
    comparison; `ResilientTrainer` always uses it, so a step is final when its commit is recorded).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from schedcomp.errors import RuntimeSetupError

SchedulerFactory = Callable[[Any], Any]  # optimizer -> a torch.optim.lr_scheduler.LRScheduler
POST, BARRIER = "post", "barrier"
GRAD_CHECKS = (POST, BARRIER)
KEEP_OUTCOMES = 1024  # iterations whose outcome a worker remembers (for results read late)
CLIP_EPS = 1e-6  # as `torch.nn.utils.clip_grad_norm_`: coefficient max_norm / (norm + eps)


@dataclass(frozen=True)
class TrainingOptions:
    """What the trainers do around STEP; the defaults change nothing."""

    lr_scheduler: SchedulerFactory | None = None
    max_grad_norm: float | None = None
    skip_nonfinite: bool = False
    grad_check: str = POST
    autocast: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.autocast not in (None, torch.bfloat16, torch.float16):
            raise RuntimeSetupError(f"autocast takes torch.bfloat16 or torch.float16, got {self.autocast!r}")
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise RuntimeSetupError("lr_scheduler takes a function optimizer -> scheduler, e.g. "
                                    "lambda o: torch.optim.lr_scheduler.StepLR(o, 10)")
        norm = self.max_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float))
                                 or not math.isfinite(norm) or norm <= 0):
            raise RuntimeSetupError(f"max_grad_norm must be a positive finite number, got {norm!r}")
        if self.grad_check not in GRAD_CHECKS:
            raise RuntimeSetupError(f"grad_check must be one of {', '.join(GRAD_CHECKS)}, got {self.grad_check!r}")

    @property
    def checks_globally(self) -> bool:
        """Whether STEP needs a value from every stage (the global norm or non-finite flag)."""
        return self.max_grad_norm is not None or self.skip_nonfinite or self.scales_loss

    @property
    def scales_loss(self) -> bool:
        """float16 autocast: the loss is scaled, and an overflow anywhere skips the update everywhere."""
        return self.autocast == torch.float16

    def refuse_chunks(self, chunks: int) -> None:
        """The global check runs one stage per worker for now: refuse it, in one line, with `chunks` > 1."""
        if chunks > 1 and self.checks_globally:
            raise RuntimeSetupError("max_grad_norm, skip_nonfinite and float16 run one stage per worker for now: "
                                    "compile a family without virtual stages (chunks=1) to use them")


class LossScaler:
    """float16's dynamic loss scale (GradScaler's rule), the same on every worker.

    It changes only on the global non-finite flag, which every worker of the job receives alike
    (`GlobalCheck`), so no worker ever needs another's scale: halve it on an overflow anywhere,
    double it after `interval` updates in a row without one. Tied to the optimizer's state
    (`attach`), so rollbacks, transfers and checkpoints keep it.
    """

    def __init__(self, scale: float = 2.0 ** 16, interval: int = 2000) -> None:
        self.scale, self.interval, self.good = scale, interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.good = self.scale * 0.5, 0
        else:
            self.good += 1
            if self.good == self.interval:
                self.scale, self.good = self.scale * 2.0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "interval": self.interval, "good": self.good}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.interval, self.good = float(state["scale"]), int(state["interval"]), int(state["good"])


# ---- LR schedules ---------------------------------------------------------------------------------

# optimizer -> what else steps with it, by name (its LR schedule, fp16's loss scaler). Keyed by the
# optimizer so that every place that moves an optimizer's state (`transfer.stage_state`) moves
# these too, without being told about them.
_ATTACHED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
LR_SCHEDULER, LOSS_SCALER = "lr_scheduler", "loss_scaler"


def attach(optimizer: Any, name: str, stateful: Any) -> None:
    """Tie `stateful` (with `state_dict` / `load_state_dict`) to the optimizer's state under `name`."""
    _ATTACHED.setdefault(optimizer, {})[name] = stateful


def attached_to(optimizer: Any) -> dict[str, Any]:
    """What is tied to this optimizer's state, by name (empty: nothing)."""
    try:
        return dict(_ATTACHED.get(optimizer, {}))
    except TypeError:  # an optimizer that cannot be weakly referenced has nothing tied to it
        return {}


def attach_lr_scheduler(optimizer: Any, factory: SchedulerFactory) -> Any:
    """Build `factory(optimizer)` and tie it to the optimizer (see `lr_scheduler_of`)."""
    scheduler = factory(optimizer)
    if not all(callable(getattr(scheduler, m, None)) for m in ("step", "state_dict", "load_state_dict")):
        raise RuntimeSetupError(f"lr_scheduler returned {type(scheduler).__name__}, which lacks step, state_dict "
                                "or load_state_dict: return a torch.optim.lr_scheduler scheduler")
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise RuntimeSetupError("ReduceLROnPlateau steps on a metric the trainer does not have: use a schedule "
                                "of the iteration (StepLR, LambdaLR, CosineAnnealingLR, OneCycleLR, ...)")
    attach(optimizer, LR_SCHEDULER, scheduler)
    return scheduler


def lr_scheduler_of(optimizer: Any) -> Any | None:
    """The scheduler stepped with this optimizer (None: none)."""
    return attached_to(optimizer).get(LR_SCHEDULER)


def prepare_stage(stage: Any, options: TrainingOptions) -> None:
    """Give a freshly built `Stage` what the options ask for: its LR schedule, autocast, float16's loss scaler."""
    if options.lr_scheduler is not None:
        attach_lr_scheduler(stage.optimizer, options.lr_scheduler)
    stage.autocast = options.autocast
    if options.scales_loss:
        stage.scaler = LossScaler()
        attach(stage.optimizer, LOSS_SCALER, stage.scaler)


# ---- global checks --------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepOutcome:
    """What the global check decided for one iteration's update (the same on every worker)."""

    iteration: int
    grad_norm: float  # over every stage's gradients, as clip_grad_norm_ on the whole model (nan: not finite)
    clipped: bool  # the update was scaled by max_grad_norm / (grad_norm + 1e-6)
    skipped: bool  # the update was not applied (skip_nonfinite and a gradient anywhere was inf or nan)
    redone: bool = False  # post-validation: this worker undid its optimistic step (and redid it, unless skipped)


def grad_norm(params: Sequence[nn.Parameter]) -> Tensor:
    """The 2-norm of these parameters' gradients, computed as `clip_grad_norm_` does (0-d tensor)."""
    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor `clip_grad_norm_` multiplies gradients by (1.0: not clipped)."""
    return min(1.0, max_norm / (norm + CLIP_EPS))


def decide(options: TrainingOptions, iteration: int, squared_norm: float, nonfinite: float) -> StepOutcome:
    """The update of an iteration from the reduced [squared norm, non-finite count]."""
    finite = nonfinite == 0 and math.isfinite(squared_norm)  # a stage with an inf or nan sends 1 and no norm
    norm = math.sqrt(squared_norm) if finite else math.nan
    skipped = (options.skip_nonfinite or options.scales_loss) and not finite
    clipped = (not skipped and options.max_grad_norm is not None and math.isfinite(norm)
               and clip_coefficient(norm, options.max_grad_norm) < 1.0)
    return StepOutcome(iteration, norm, clipped, skipped)


@dataclass
class _Pending:
    iteration: int
    work: dist.Work | None
    buffer: Tensor
    stepped: bool  # an optimistic step was taken (post-validation)
    grads: list[Tensor | None] | None  # the reduced gradients, kept to redo the step clipped (None: no STEP)


class GlobalCheck:
    """One worker's side of the global norm and non-finite check (see the module docstring).

    `step(iteration)` is what STEP runs; `settle()` validates the pending step (call before the
    stage touches its parameters again); `contribute_nothing(iteration)` keeps a worker without a
    stream in the collective. `snapshot`: a `transfer.StepSnapshot` of the stage (the undo).
    """

    def __init__(self, options: TrainingOptions, stage: Any, snapshot: Any, comm: Callable[[], Any],
                 counted: Callable[[], Sequence[nn.Parameter]]) -> None:
        self.options, self.stage, self.snapshot = options, stage, snapshot
        self.comm, self.counted = comm, counted  # the current generation's `Comm` (it changes on regroup)
        self.outcomes: dict[int, StepOutcome] = {}
        self._pending: _Pending | None = None
        self._launched = -1  # the last iteration whose share was sent

    def _launch(self, iteration: int, squared: float, nonfinite: float) -> tuple[dist.Work | None, Tensor]:
        comm = self.comm()
        buffer = torch.tensor([squared, nonfinite], dtype=torch.float64, device=comm.control_device)
        self._launched = iteration
        return dist.all_reduce(buffer, group=comm.control, async_op=True), buffer

    def launched(self, iteration: int) -> bool:
        return self._launched == iteration

    def local_share(self) -> tuple[float, float, float]:
        """(this stage's norm, its share of the squared global norm, 1.0 if a gradient is not finite)."""
        norm = float(grad_norm(self.stage.params))
        finite = math.isfinite(norm)
        # the parameters whose norm this worker counts: all of its stage's, none, or (re-formed pipelines) some
        counted = self.counted()
        share = norm if len(counted) == len(self.stage.params) else float(grad_norm(counted)) if counted else 0.0
        return norm, (share * share if finite else 0.0), (0.0 if finite else 1.0)

    def step(self, iteration: int) -> None:
        self.settle()  # at most one pending step
        if self.stage.scaler is not None:
            self.stage.scale_grads(1.0 / self.stage.scaler.scale)  # the gradients of the unscaled loss
        norm, squared, nonfinite = self.local_share()
        work, buffer = self._launch(iteration, squared, nonfinite)
        limit = self.options.max_grad_norm
        doomed = nonfinite > 0 or (limit is not None and clip_coefficient(norm, limit) < 1.0)
        optimistic = self.options.grad_check == POST and not doomed
        grads = [p.grad for p in self.stage.params]
        if optimistic:
            self.snapshot.take(iteration)
            self.stage.step()  # clears .grad; the tensors live on in `grads` for a redo
        self._pending = _Pending(iteration, work, buffer, optimistic, grads)
        if self.options.grad_check == BARRIER:
            self.settle()

    def contribute_nothing(self, iteration: int) -> None:
        self.settle()
        work, buffer = self._launch(iteration, 0.0, 0.0)
        self._pending = _Pending(iteration, work, buffer, False, None)

    def settle(self) -> StepOutcome | None:
        """Wait for the pending check and fix the step it covers; returns its outcome (None: none pending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.work is not None:
            self.comm().wait(pending.work)
        squared, nonfinite = pending.buffer.tolist()
        outcome = decide(self.options, pending.iteration, squared, nonfinite)
        if pending.grads is not None:
            outcome = self._apply(pending, outcome)  # may restore the snapshot: the scaler's update comes after
        if self.stage.scaler is not None:
            self.stage.scaler.update(overflow=not math.isfinite(outcome.grad_norm))
        self.outcomes[pending.iteration] = outcome
        if len(self.outcomes) > KEEP_OUTCOMES:  # a long run: forget the oldest (inserted first)
            del self.outcomes[next(iter(self.outcomes))]
        return outcome

    def _apply(self, pending: _Pending, outcome: StepOutcome) -> StepOutcome:
        stage = self.stage
        right = not outcome.skipped and not outcome.clipped
        if pending.stepped and right:
            return outcome
        redone = pending.stepped
        if redone:
            self.snapshot.restore()
        if outcome.skipped:
            stage.optimizer.zero_grad(set_to_none=True)
            return replace(outcome, redone=redone)
        coefficient = clip_coefficient(outcome.grad_norm, self.options.max_grad_norm) if outcome.clipped else 1.0
        assert pending.grads is not None
        with torch.no_grad():
            for p, g in zip(stage.params, pending.grads, strict=True):
                p.grad = g.mul_(coefficient) if g is not None else None
        stage.step()
        return replace(outcome, redone=redone)

    def outcome(self, iteration: int) -> StepOutcome | None:
        """The outcome of `iteration`'s update (settles it if it is the pending one)."""
        if self._pending is not None and self._pending.iteration == iteration:
            self.settle()
        return self.outcomes.get(iteration)
