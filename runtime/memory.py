"""Activation memory measured around each compute op (`PipelineTrainer(profile=True)`).

What a worker holds between ops is what the cost model plans (`CostModel.memory_delta`): F adds a
micro-batch's activations, B frees all but what W needs, W frees the rest.

- CPU: the bytes of the tensors F saves for backward (`torch.autograd.graph.saved_tensors_hooks`),
  each storage counted once and parameters not at all; after B, the bytes of what the split backward
  stashed for W (inputs and output gradients of the split linear layers). Exact and deterministic.
- CUDA: allocator deltas, `torch.cuda.memory_allocated` before and after each op, and the op's peak
  from `torch.cuda.max_memory_allocated` (reset before it), less the weight gradients the op
  allocated (the first W or B of an iteration creates `.grad`): everything else the op keeps, and
  its transient workspace in the peak. The first matmul on a stream also allocates cuBLAS's persistent
  workspace (32 MiB on Hopper), which no plan counts: each iteration starts from zero (`forget`) and
  `schedcomp.profile.measured_peaks` leaves out each process's first iteration.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from schedcomp.ir import InstrKind
from schedcomp.runtime.stage import Stage

Key = Hashable


def storage_bytes(tensors: Iterable[Tensor], skip: set[int] | frozenset[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors` (views share one), leaving out `skip`'s."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and ptr not in seen:
            seen[ptr] = storage.nbytes()
    return sum(seen.values())


@contextmanager
def saved_tensors() -> Iterator[list[Tensor]]:
    """Collect every tensor autograd saves for backward inside the block (the tensors, unchanged)."""
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


class MemoryMeter:
    """One worker's activation memory, op by op: `held` after the last op, `peak` during it.

    `stages`: the stage, or every chunk the worker holds (virtual stages); `measure` names the
    op's chunk (default: the first), since two chunks hold the same micro-batch at once.
    """

    def __init__(self, stages: Stage | Sequence[Stage], device: torch.device) -> None:
        self.stages = (stages,) if isinstance(stages, Stage) else tuple(stages)
        self.stage = self.stages[0]
        self.device = device
        self.cuda = device.type == "cuda"
        self.params = {t.untyped_storage().data_ptr() for stage in self.stages
                       for t in (*stage.module.parameters(), *stage.module.buffers())}
        self.saved: dict[tuple[int, Key], int] = {}  # CPU: bytes F saved, per (chunk, micro-batch)
        self.stashed: dict[tuple[int, Key], int] = {}  # CPU: bytes B left for W, per (chunk, micro-batch)
        self.held = 0.0
        self.peak = 0.0

    @contextmanager
    def measure(self, kind: InstrKind, key: Key, stage: Stage | None = None) -> Iterator[None]:
        """Run one compute op of micro-batch `key` (of chunk `stage`) inside the block and account for its memory."""
        stage = stage if stage is not None else self.stage
        slot = (stage.index, key)
        before = self.held
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start, grads = torch.cuda.memory_allocated(self.device), self._grad_bytes()
            yield
            torch.cuda.synchronize(self.device)
            grown = self._grad_bytes() - grads  # weight gradients the op allocated are not activations
            self.held = before + torch.cuda.memory_allocated(self.device) - start - grown
            self.peak = max(self.held, before + torch.cuda.max_memory_allocated(self.device) - start - grown)
            return
        if kind is InstrKind.F:
            with saved_tensors() as saved:
                yield
            self.saved[slot] = storage_bytes(saved, self.params)
            self.held += self.saved[slot]
        else:
            yield
            if kind in (InstrKind.B, InstrKind.BW):
                self.held -= self.saved.pop(slot, 0)
            if kind is InstrKind.B:
                self.stashed[slot] = self._stash_bytes(stage, key)
                self.held += self.stashed[slot]
            elif kind is InstrKind.W:
                self.held -= self.stashed.pop(slot, 0)
        self.peak = max(before, self.held)

    def _grad_bytes(self) -> int:
        return storage_bytes(p.grad for stage in self.stages for p in stage.params if p.grad is not None)

    def _stash_bytes(self, stage: Stage, key: Key) -> int:
        pending = stage.store._pending.get(key, ())
        return storage_bytes((t for _, x, g in pending for t in (x, g)), self.params)

    def forget(self) -> None:
        """A new or aborted iteration: nothing is held any more."""
        self.saved.clear()
        self.stashed.clear()
        self.held = self.peak = 0.0
