"""The embedded training loop: `PipelineTrainer(plan, build_stage, loss_fn, make_optimizer).step(batch)`."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from schedcomp.errors import RuntimeSetupError
from schedcomp.ir import InstrKind, Instruction, Plan
from schedcomp.partition import Partition
from schedcomp.partitions import Partitions, held_by
from schedcomp.runtime.comm import Comm, GroupFactory, RankMap, Waiter, channels, init_distributed
from schedcomp.runtime.data import Tensors, as_tuple, micro_batch, to_device
from schedcomp.runtime.executor import Iteration, Timing, run_residual, run_stream
from schedcomp.runtime.fault.residual import Residual
from schedcomp.runtime.fault.transfer import StepSnapshot
from schedcomp.runtime.layout import Layout
from schedcomp.runtime.memory import MemoryMeter
from schedcomp.runtime.moves import base_partition, cuts_for, move_layers, partition_for
from schedcomp.runtime.plan_agreement import check_same_plan, describe_shape, job_shape
from schedcomp.runtime.replicas import counted_params, sync_replicas
from schedcomp.runtime.result import Loss
from schedcomp.runtime.shapes import probe_boundaries
from schedcomp.runtime.stage import LossFn, OptimizerFactory, Stage, StageBuilder, TensorMeta, build_module
from schedcomp.runtime.trace import common_origin, gather_spans, write_trace
from schedcomp.runtime.training import POST, GlobalCheck, SchedulerFactory, StepOutcome, TrainingOptions, prepare_stage
from schedcomp.timeline import Span
from schedcomp.topology import Worker

log = logging.getLogger(__name__)


class PipelineTrainer:
    """Train one pipeline stage per process by executing a compiled plan's instruction streams.

    - `plan`: a `Plan`; launch one process per live worker (rank i runs the i-th live worker in
      sorted order, see `schedcomp.runtime.comm`), e.g. with `torchrun --standalone`.
    - `build_stage`: `stage_index -> nn.Module`, or an `nn.Sequential` split by `layers_per_stage`
      (default: even). Replicas of a stage are synchronised from the lowest rank at start.
      A stage takes the previous stage's outputs as positional arguments (stage 0: the batch's
      inputs) and returns a tensor or a tuple of tensors. With virtual stages (a plan whose
      topology has `chunks` = v > 1) the model has pp * v stages: `build_stage` is called with
      each virtual stage index this worker holds (`Topology.chunks_of`), and an `nn.Sequential`
      is split into pp * v stages. `self.stages` maps each held virtual stage to its `Stage`;
      `self.stage` is the first of them (the only one without virtual stages). A plan with re-formed
      pipelines (`Plan.partitions`) needs an `nn.Sequential`: each worker takes its own pipeline's
      layers (`self.held_layers`), and ALLREDUCE reduces per segment (`runtime.layout`).
    - `loss_fn(outputs, targets)`: the mean loss of one micro-batch, on the last stage.
    - `make_optimizer(params)`: the optimizer of one stage (e.g. `lambda p: torch.optim.SGD(p, lr=0.1)`).
    - `profile=True` records every instruction's start and end, and the activation memory held after
      each compute op (`runtime.memory`), for `save_trace` / `schedcomp profile`.
    - Resilient jobs (`schedcomp.runtime.resilient`) pass `process=(rank, size, device)` and
      `make_group` of their generation instead of joining a default group, a `wait` that gives up
      when the generation breaks, and `setup_collectives=False` (no replica sync and no clock
      broadcast at start: a replacement receives its state from a replica instead).

    - Around the optimizer step (`runtime.training`): `lr_scheduler=lambda optimizer: torch.optim.
      lr_scheduler.X(optimizer, ...)` (stepped after each applied update, on every stage),
      `max_grad_norm` (clip by the norm over all stages, as `clip_grad_norm_` on the whole model),
      `skip_nonfinite` (skip the update on every stage when any gradient is inf or nan), and
      `grad_check` ("post": each stage steps at once and undoes a wrong step when the global
      values arrive, Zero Bubble's post-validation; "barrier": wait for them before stepping).
      The step's result reports it (`Loss.skipped`, `Loss.grad_norm`, `Loss.outcome`).
      `autocast=torch.bfloat16` runs F and the loss under `torch.autocast` with float32 master
      weights (and float32 weight gradients); `torch.float16` also scales the loss by a dynamic
      scale that every worker updates alike from the global overflow flag (`training.LossScaler`).
    - `seed`: random layers (dropout) draw from a stream per (seed, iteration, stage, home pipeline,
      micro-batch) (`runtime.rng`), the same whichever worker runs the micro-batch and in whatever
      order; None draws from the global generators as they stand (the order then matters).

    `step((inputs, targets))` runs one iteration; every rank passes the same global batch (only
    the first and last stages read it). Micro-batch (home pipeline p, index m) is chunk
    `p * microbatches + m` of `dp * microbatches` equal chunks. Each micro-batch's loss is scaled
    by `1 / (dp * microbatches)` and ALLREDUCE sums, so gradients are those of the global mean
    loss whoever ran which micro-batch (a plan with a cut, `Plan.cut`, loads each piece's rows by
    `Cut.global_rows` and weights its loss by its rows over the batch's). `step` never waits on other
    stages: see `Loss`.
    """

    def __init__(self, plan: Plan, build_stage: StageBuilder | nn.Sequential, loss_fn: LossFn,
                 make_optimizer: OptimizerFactory, *, layers_per_stage: Sequence[int] | None = None,
                 backend: str | None = None, profile: bool = False, make_group: GroupFactory | None = None,
                 process: tuple[int, int, torch.device] | None = None, wait: Waiter | None = None,
                 setup_collectives: bool = True, lr_scheduler: SchedulerFactory | None = None,
                 max_grad_norm: float | None = None, skip_nonfinite: bool = False, grad_check: str = POST,
                 autocast: torch.dtype | None = None, seed: int | None = 0) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RuntimeSetupError(f"seed must be a whole number or None, got {seed!r}")
        self.seed = seed
        self.options = TrainingOptions(lr_scheduler, max_grad_norm, skip_nonfinite, grad_check, autocast)
        self.options.refuse_chunks(plan.topology.chunks)  # before any process group is made
        rank, size, device = process if process is not None else init_distributed(backend)
        self.ranks = RankMap.of(plan)
        if size != len(self.ranks.workers):
            raise RuntimeSetupError(f"the plan has {len(self.ranks.workers)} live workers but {size} processes run: "
                                    f"launch exactly {len(self.ranks.workers)}")
        self.rank, self.device = rank, device
        self.worker = self.ranks.worker(rank)
        self.pp, self.dp = plan.topology.pp, plan.topology.dp
        self.shape = job_shape(plan)
        stages = plan.topology.stages  # virtual stages: pp * chunks
        # an nn.Sequential is cut by the plan's partition, else as before; a switch may move layers (`moves`)
        self.model = build_stage if isinstance(build_stage, nn.Sequential) else None
        self.base_partition = base_partition(build_stage, layers_per_stage, stages)
        self.partition = partition_for(plan.partition, self.model, self.base_partition, stages)
        if layers_per_stage is not None and plan.partition is not None and self.partition != self.base_partition:
            raise RuntimeSetupError(f"layers_per_stage {list(layers_per_stage)} differs from the plan's partition "
                                    f"{list(plan.partition)}: drop layers_per_stage (the plan's cut is used)")
        self._loss_fn, self._make_optimizer = loss_fn, make_optimizer
        self.comm = Comm(self.ranks, rank, device, make_group, wait)
        self.checks: GlobalCheck | None = None
        self.profile = profile
        self.cuts = cuts_for(plan, self.model, self.base_partition)  # per pipeline, the layers of each place
        self._layout = Layout.of(plan)  # of the plan whose cut the stages hold (`_build_stage` reads it)
        cut = self.partition if self.model is not None else layers_per_stage
        self._hold({s: self._build_stage(s, self._module(build_stage, s, stages, cut).to(device))
                    for s in plan.topology.chunks_of(self.worker.stage)})
        self._fresh = True  # holds the layers it was built with: nothing to compare before its first plan
        self.iteration = 0
        self.step_seconds: list[float] = []
        self._history: list[tuple[int, Plan]] = []
        self._timings: list[tuple[int, Timing, dict[int, float], dict[int, tuple[float, float]]]] = []
        self._signature: tuple[int, tuple[TensorMeta, ...]] | None = None
        self._boundaries: dict[int, tuple[TensorMeta, ...]] = {}
        self.use_plan(plan)
        if setup_collectives:
            self.sync_replicas()
            self._clock0 = common_origin(self.comm)
        else:
            self._clock0 = time.perf_counter()

    # ---- plans ---------------------------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        return self._history[-1][1]

    @property
    def stream(self) -> tuple[Instruction, ...]:
        return self.plan.streams.get(self.worker, ())

    def use_plan(self, plan: Plan, joined: Collection[Worker] = ()) -> None:
        """Run `plan` from the next iteration on (collective: every rank switches at the same step).

        Any plan of the same pp and dp whose workers have processes is accepted (e.g. one from a
        plan cache, re-routed around failed workers); a process without a stream idles. A plan that
        cuts the model elsewhere moves layers, with their optimizer state, between workers first
        (`runtime.moves`); `joined`: workers that receive their whole state from a replica after this
        switch (a resilient job's replacements), so take no part in the move.
        """
        if job_shape(plan) != self.shape:
            raise RuntimeSetupError(f"plan is for {describe_shape(job_shape(plan))} but this job runs "
                                    f"{describe_shape(self.shape)}: compile the plan for this job's shape")
        for w in plan.workers:
            self.ranks.rank(w)  # raises if the plan needs a worker with no process
        target = partition_for(plan.partition, self.model, self.base_partition, plan.topology.stages)
        cuts, layout = cuts_for(plan, self.model, self.base_partition), Layout.of(plan)
        self._check_same_plan(plan, joined)
        # A process idling on this plan moves like any other (its layers are current, and it may be their only
        # holder), except where the plan gives its place no layers (a re-formed pipeline's failed place): it keeps
        # what it has and gives none; its record says it holds none, so a later plan sends it all it needs.
        keeps = frozenset(w for w in plan.topology.failed if cuts is not None and plan.topology.chunks == 1
                          and cuts[w.pipeline][w.stage] == 0)
        if cuts != self.cuts and self.worker not in joined and self.worker not in keeps:
            self._move(plan, cuts, frozenset(joined) | keeps, layout)
        if self.worker not in joined:  # (a joined worker's state comes whole from a replica, after the switch)
            self.partition, self.cuts = target, cuts
        self._layout = layout
        # one group per distinct holder set, in the reductions' (layer) order: the same on every rank
        self.comm.prepare_stage_groups([r.holders for r in self._layout.reductions])
        self.comm.connect(channels(plan))
        if self._history and self._history[-1][0] == self.iteration:
            self._history[-1] = (self.iteration, plan)
        else:
            self._history.append((self.iteration, plan))
        self._signature = None  # the shape probe's source workers may have changed
        split = any(ins.kind is InstrKind.B for ins in self.stream)
        for stage in self.stages.values():
            stage.store.needed = split
        log.debug("worker %s runs %s plan from iteration %d: %d instructions", self.worker, plan.family or "a",
                  self.iteration, len(self.stream))

    def _check_same_plan(self, plan: Plan, joined: Collection[Worker] = ()) -> None:
        """Refuse to run unless every rank holds the same plan and, but for fresh and `joined` workers,
        the same cut of the model (`runtime.plan_agreement`)."""
        check_same_plan(plan, None if self._fresh else self.cuts, self.comm, self.ranks.workers, joined)
        self._fresh = False

    def _module(self, build: StageBuilder | nn.Sequential, s: int, stages: int,
                cut: Sequence[int] | None) -> nn.Module:
        """This worker's virtual stage s: its own pipeline's layers where pipelines hold different ones."""
        if self.model is not None and self.cuts is not None and self._layout.per_layer:
            held = self._layout.span(self.worker.pipeline, s)
            return nn.Sequential(*(self.model[i] for i in held))
        return build_module(build, s, stages, cut)

    @property
    def held_layers(self) -> range:
        """The model layers this worker's (only) stage holds (an `nn.Sequential` model without virtual stages)."""
        assert self.cuts is not None
        return held_by(self.cuts, self.worker)

    @property
    def own_cut(self) -> Partition | None:
        """The partition of this worker's own pipeline, which its stages hold (a re-formed pipeline's differs from
        the others'): per-layer checkpoints are written and restored under it."""
        return self.cuts[self.worker.pipeline] if self.cuts is not None else self.partition

    @property
    def on_base_cut(self) -> bool:
        """Whether every pipeline holds the job's base cut (the only one per-stage checkpoints restore into)."""
        return self.cuts is None or all(cut == self.base_partition for cut in self.cuts)

    def _move(self, plan: Plan, cuts: Partitions | None, joined: Collection[Worker], layout: Layout) -> None:
        """Take this worker's stages from the current cut to `cuts` (collective over the other
        workers, but for `joined`, which take no part; see `runtime.moves`)."""
        assert self.model is not None and self.cuts is not None and cuts is not None
        self.settle()  # a pending step is applied before its state moves
        workers = tuple(w for w in self.ranks.workers if w not in joined)
        stale = self.plan.topology.failed  # idle on the plan in use: their layers missed its steps, never a source
        self._layout = layout  # the rebuilt stages' ends (after the pending step, which is the old plan's)
        self._hold(move_layers(self.cuts, cuts, self.stages, self.model, me=self.worker, workers=workers,
                               comm=self.comm, build=self._build_stage, place_of=plan.topology.place_of,
                               stale=stale))

    def _build_stage(self, s: int, module: nn.Module) -> Stage:
        """Virtual stage s over `module` (on this worker's device), with a fresh optimizer and the options."""
        stages = self.pp * self.shape[2]  # virtual stages: pp * chunks
        ends = self._layout.ends(self.worker.pipeline, s)
        stage = Stage(s, stages, module, self._loss_fn if ends[1] else None, self._make_optimizer, ends)
        prepare_stage(stage, self.options)
        return stage

    def _hold(self, stages: dict[int, Stage]) -> None:
        """Run `stages` (by virtual stage) from now on: the global check and the memory meter follow them."""
        self.stages = stages
        self.stage = next(iter(stages.values()))
        if self.options.checks_globally:
            snapshot = StepSnapshot(self.stage.module, self.stage.optimizer)
            if self.checks is None:
                self.checks = GlobalCheck(self.options, self.stage, snapshot, lambda: self.comm,
                                          lambda: counted_params(self._layout, self.worker, self.stage))
            self.checks.stage, self.checks.snapshot = self.stage, snapshot
        self._meter = MemoryMeter(tuple(stages.values()), self.device) if self.profile else None

    def regroup(self, plan: Plan, rank: int, make_group: GroupFactory, wait: Waiter | None = None,
                joined: Collection[Worker] = ()) -> None:
        """Move to a new generation of a resilient job: new ranks, fresh groups, `plan` from now on.

        Collective over the new generation's members (they build the same groups in the same
        order). This process keeps its worker; the plan's workers are the generation's members.
        """
        ranks = RankMap.of(plan)
        if ranks.worker(rank) != self.worker:
            raise RuntimeSetupError(f"rank {rank} of the new generation is worker {ranks.worker(rank)}, "
                                    f"not this process's {self.worker}: use the plan of this generation")
        self.ranks, self.rank = ranks, rank
        self.comm = Comm(ranks, rank, self.device, make_group, wait or self.comm.wait)
        self._history = [(self.iteration, plan)]
        self.use_plan(plan, joined)

    def sync_replicas(self) -> None:
        """Give every replica of this stage the lowest rank's parameters and buffers (`runtime.replicas`)."""
        sync_replicas(self._layout, self.worker, self.stages, self.ranks, self.comm)

    def settle(self) -> StepOutcome | None:
        """Validate the last update now (max_grad_norm, skip_nonfinite; see `training`): parameters
        are final after it. `run_iteration` and reading a step's result do it by themselves."""
        return self.checks.settle() if self.checks is not None else None

    def update(self, iteration: int) -> None:
        """The update STEP applies: the optimizer step (and LR schedule), through the global check if any."""
        if self.checks is not None:
            self.checks.step(iteration)
        else:
            for stage in self.stages.values():
                stage.step()

    # ---- shapes ----------------------------------------------------------------------------------

    def _probe_shapes(self, inputs: Tensors) -> None:
        """Learn what crosses each stage boundary (what receivers allocate) when the input shape changes
        (`runtime.shapes`; collective)."""
        chunks = self.dp * self.plan.microbatches
        first = as_tuple(micro_batch(inputs, 0, chunks))
        signature = (chunks, tuple(TensorMeta.of(t) for t in first))
        if signature == self._signature:
            return
        self._boundaries = probe_boundaries(first, self._layout, self.plan.topology, self.stages, self.comm,
                                            self.device)
        self._signature = signature

    # ---- training ---------------------------------------------------------------------------------

    def step(self, batch: tuple[Tensors, Tensors]) -> Loss:
        """Run one iteration of this worker's stream on `batch = (inputs, targets)`; see `Loss`."""
        it = self.run_iteration(batch)
        loss = it.loss()
        # On the compute device (every group serves it): moving it to the CPU would wait for the GPU.
        loss = (loss if loss is not None else torch.zeros((), device=self.device)).to(torch.float64)
        work = dist.all_reduce(loss, group=self.comm.control, async_op=True)
        checks = self.checks
        return Loss(loss, work, functools.partial(checks.outcome, it.number) if checks is not None else None)

    def run_iteration(self, batch: tuple[Tensors, Tensors], *, step: Callable[[Iteration], None] | None = None,
                      ledger: Tensor | None = None, before: Callable[[int, Instruction], None] | None = None,
                      started: Callable[[Iteration], None] | None = None) -> Iteration:
        """Run one iteration of the stream and return its state (losses: this worker's scaled ones).

        `step` replaces the optimizer step at STEP, `ledger` counts micro-batches into the
        all-reduce and `before` runs before each instruction (see `executor`); `started` gets the
        iteration's state before its first instruction (a recovery policy may keep it, to finish
        the iteration after a failure); `iteration` is advanced only when the stream completes.
        """
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise RuntimeSetupError("step takes batch=(inputs, targets), each a tensor or a tuple of tensors")
        self.settle()  # the last update is validated before this iteration reads the parameters
        self._probe_shapes(batch[0])
        began = time.perf_counter()
        if step is None and self.checks is not None:
            step = self._update
        it = self._iteration(self.iteration, batch, step, ledger)
        if started is not None:
            started(it)
        timing: Timing | None = [] if self.profile else None
        if self._meter is not None:
            # Activations never outlive their iteration (each F's B and W run in it), so what the device still
            # holds from the last one is not activation memory (on CUDA, the cuBLAS workspaces): count from zero.
            self._meter.forget()
        run_stream(it, self.stream, timing, before)
        if self.checks is not None and not self.checks.launched(it.number):
            self.checks.contribute_nothing(it.number)  # no STEP here (an idle worker): still in the collective
        if timing is not None:
            self._timings.append((self.iteration, timing, it.arrivals, it.memory))
        self.step_seconds.append(time.perf_counter() - began)
        self.iteration += 1
        return it

    def _iteration(self, number: int, batch: tuple[Tensors, Tensors], step: Callable[[Iteration], None] | None,
                   ledger: Tensor | None) -> Iteration:
        inputs, targets = batch
        held = self.stages
        it = Iteration(
            plan=self.plan, worker=self.worker, stage=self.stage, stages=held, comm=self.comm,
            inputs=to_device(inputs, self.device) if any(stage.is_first for stage in held.values()) else inputs,
            targets=to_device(targets, self.device) if any(stage.is_last for stage in held.values()) else targets,
            boundaries=self._boundaries,
            layout=self._layout,
            number=number,
            record=self.profile,
            step=step,
            ledger=ledger,
            meter=self._meter,
            seed=self.seed,
        )
        return it

    def _update(self, it: Iteration) -> None:
        self.update(it.number)

    def resume(self, number: int, batch: tuple[Tensors, Tensors], residual: Residual,
               step: Callable[[Iteration], None], ledger: Tensor, interrupted: Iteration | None = None,
               started: Callable[[Iteration], None] | None = None) -> Iteration:
        """Finish iteration `number`, interrupted by a failure, on the current generation (lossy policy).

        Starts from `interrupted`, this worker's state of that iteration (None: it had not started
        it; a fresh one, passed to `started` as in `run_iteration`) and runs `residual`
        (`fault.residual`); call after `regroup`. `ledger` is used only for a fresh start: an
        interrupted iteration keeps counting in its own.
        """
        self._probe_shapes(batch[0])  # collective: every survivor resumes (after a regroup it probes again)
        it = interrupted
        if it is None:
            it = self._iteration(number, batch, step, ledger)
            if started is not None:
                started(it)
        # the residual runs on the current plan: its live workers are the ones its all-reduces sum over
        it.comm, it.plan, it.layout, it.step = self.comm, self.plan, self._layout, step
        run_residual(it, residual.resend, residual.repost, residual.rest, residual.lost)
        self.iteration = number + 1
        return it

    def abandon(self) -> None:
        """Forget the iteration in flight (its generation broke): activations, stashes, gradients."""
        for stage in self.stages.values():
            stage.discard()
            stage.optimizer.zero_grad(set_to_none=True)
        if self._meter is not None:
            self._meter.forget()

    # ---- measurement ------------------------------------------------------------------------------

    def spans(self) -> list[Span]:
        """This worker's measured spans (seconds from the job's common origin); needs profile=True."""
        return gather_spans(self, everyone=False)

    def save_trace(self, path: str | Path) -> list[Span]:
        """Gather every worker's spans to rank 0 and write a Chrome/Perfetto trace there (collective)."""
        spans = gather_spans(self, everyone=True)
        if self.rank == 0:
            write_trace(spans, path)
        return spans

    def close(self) -> None:
        """Leave the job (validates the last update, destroys the default process group)."""
        self.settle()
        if dist.is_initialized():
            dist.destroy_process_group()
