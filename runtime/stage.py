"""One pipeline stage held by this process: module, loss, optimizer, in-flight activations.

`Stage` knows nothing about plans or communication: the executor calls `forward`, `backward`
(B or BW) and `backward_weight` (W) with a micro-batch key, and moves the tensors they return.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from schedcomp.errors import PlanFormatError, RuntimeSetupError
from schedcomp.partition import even
from schedcomp.runtime.data import Tensors, as_tuple
from schedcomp.runtime.rng import drawing
from schedcomp.runtime.splitgrad import WeightGradStore, enable_split_backward
from schedcomp.runtime.training import LossScaler, lr_scheduler_of

LossFn = Callable[[Any, Any], Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
StageBuilder = Callable[[int], nn.Module]
Key = Hashable


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor crossing a stage boundary (what a receiver allocates)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype)

    @property
    def has_grad(self) -> bool:
        """Whether a gradient flows back for this tensor (floating-point values only)."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    def empty(self, device: torch.device) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """Layer counts per stage, as even as possible (`partition.even`, the compiler's split), refused with the
    runtime's error."""
    try:
        return even(layers, stages)
    except PlanFormatError as e:
        raise RuntimeSetupError(str(e)) from None


def split_sequential(
    model: nn.Sequential, stage: int, stages: int, layers_per_stage: Sequence[int] | None
) -> nn.Module:
    """Stage `stage` of `model`: its layers, by `layers_per_stage` (default: an even split)."""
    counts = tuple(layers_per_stage) if layers_per_stage is not None else even_split(len(model), stages)
    if len(counts) != stages or sum(counts) != len(model) or min(counts) < 1:
        raise RuntimeSetupError(
            f"layers_per_stage {list(counts)} must give {stages} positive counts "
            f"summing to the model's {len(model)} layers"
        )
    start = sum(counts[:stage])
    return nn.Sequential(*(model[i] for i in range(start, start + counts[stage])))


def build_module(build: StageBuilder | nn.Sequential, stage: int, stages: int,
                 layers_per_stage: Sequence[int] | None = None) -> nn.Module:
    """The module of `stage`, from a builder `stage -> nn.Module` or by splitting an `nn.Sequential`."""
    if isinstance(build, nn.Sequential):
        return split_sequential(build, stage, stages, layers_per_stage)
    if layers_per_stage is not None:
        raise RuntimeSetupError("layers_per_stage applies to an nn.Sequential model: drop it when giving a builder")
    module = build(stage)
    if not isinstance(module, nn.Module):
        raise RuntimeSetupError(
            f"the stage builder returned {type(module).__name__} for stage {stage}: return an nn.Module"
        )
    return module


class Stage:
    """A stage's module with split backward, its loss (last stage) and optimizer, and its activations.

    Micro-batch keys are `(home pipeline, microbatch)`. `forward` keeps the inputs and outputs
    needed by the backward; `backward` frees them (keeping only what W needs, in `store`).
    `ends`: whether it holds the model's first and last layers (default: stage 0 and the last; a
    re-formed pipeline's stage may hold either end elsewhere, `runtime.layout`).
    """

    def __init__(self, index: int, stages: int, module: nn.Module, loss_fn: LossFn | None,
                 make_optimizer: OptimizerFactory, ends: tuple[bool, bool] | None = None) -> None:
        self.index, self.stages = index, stages
        self.is_first, self.is_last = ends if ends is not None else (index == 0, index == stages - 1)
        self.module = module
        self.loss_fn = loss_fn
        self.store = WeightGradStore()
        self.split_layers = enable_split_backward(module, self.store)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params)
        self.autocast: torch.dtype | None = None  # F (and the loss) under torch.autocast (`training`)
        self.scaler: LossScaler | None = None  # float16: the loss is multiplied by its scale
        self._saved: dict[Key, tuple[tuple[Tensor, ...], tuple[Tensor, ...]]] = {}

    def forward(self, key: Key, inputs: tuple[Tensor, ...], targets: Tensors | None = None,
                scale: float = 1.0, seed: int | None = None) -> tuple[Tensor, ...]:
        """Run the stage on one micro-batch; return the outputs to send (last stage: the scaled loss).

        Received inputs become leaves that collect their gradient in the backward. `seed`: the
        micro-batch's random stream (`runtime.rng`; None: the global one, as it stands).
        """
        if not self.is_first:
            for t in inputs:
                if TensorMeta.of(t).has_grad:
                    t.requires_grad_(True)
        device = inputs[0].device if inputs else torch.device("cpu")
        with self.store.forward(key), self._autocast(), drawing(seed, device):
            out = self.module(*inputs)
            if self.is_last:
                if self.loss_fn is None:
                    raise RuntimeSetupError("the last stage needs a loss function: pass loss_fn to PipelineTrainer")
                loss = self.loss_fn(out, targets) * scale
        if self.is_last:
            if self.scaler is not None:  # backward of the scaled loss; a power of two, so dividing back is exact
                self._saved[key] = (inputs, (loss * self.scaler.scale,))
            else:
                self._saved[key] = (inputs, (loss,))
            return (loss.detach(),)
        outputs = as_tuple(out)
        self._saved[key] = (inputs, outputs)
        return tuple(o.detach() for o in outputs)

    def backward(self, key: Key, grads: tuple[Tensor, ...], split: bool) -> tuple[Tensor, ...]:
        """B (`split`) or BW of one micro-batch; return the gradients of its floating-point inputs.

        `grads` are the gradients of the floating-point outputs, in order (ignored at the last stage).
        """
        inputs, outputs = self._saved.pop(key)
        if self.is_last:
            tensors, grad_tensors = list(outputs), None
        else:
            floats = [o for o in outputs if TensorMeta.of(o).has_grad]
            pairs = [(o, g) for o, g in zip(floats, grads, strict=True) if o.requires_grad]
            tensors, grad_tensors = [o for o, _ in pairs], [g for _, g in pairs]
        if tensors:
            with self.store.backward(split):
                torch.autograd.backward(tensors, grad_tensors)
        if self.is_first:
            return ()
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs if TensorMeta.of(x).has_grad)

    def backward_weight(self, key: Key) -> None:
        """W of one micro-batch: the weight gradients B deferred."""
        self.store.flush(key)

    @torch.no_grad()
    def output_meta(self, inputs: tuple[Tensor, ...]) -> tuple[TensorMeta, ...]:
        """Shapes and dtypes of this stage's outputs for `inputs`, without side effects.

        Runs in eval mode (no batch-norm statistics updated) with the random state restored.
        """
        devices = [inputs[0].device] if inputs and inputs[0].is_cuda else []
        training = self.module.training
        self.module.eval()
        try:
            with torch.random.fork_rng(devices=devices), self._autocast():
                out = self.module(*inputs)
        finally:
            self.module.train(training)
        return tuple(TensorMeta.of(o) for o in as_tuple(out))

    @property
    def numel(self) -> int:
        """Elements of the parameters that train (the length of `flat_grads`)."""
        return sum(p.numel() for p in self.params)

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.autocast is None:
            return nullcontext()
        device = self.params[0].device.type if self.params else "cpu"
        return torch.autocast(device_type=device, dtype=self.autocast)

    def flat_grads(self) -> Tensor:
        """Every parameter's gradient in one flat tensor (zeros where a parameter got none)."""
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])

    def set_flat_grads(self, flat: Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n

    def step(self) -> None:
        """Apply the update, then advance the LR schedule tied to the optimizer (`training`), if any."""
        self.optimizer.step()
        scheduler = lr_scheduler_of(self.optimizer)
        if scheduler is not None:
            scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def in_flight(self) -> int:
        """Micro-batches whose forward ran and whose backward has not (activation memory held)."""
        return len(self._saved)

    def discard(self, key: Key | None = None) -> None:
        """Forget in-flight micro-batch `key` and its deferred weight gradient (None: all; an aborted iteration)."""
        if key is None:
            self._saved.clear()
            self.store.clear()
        else:
            self._saved.pop(key, None)
            self.store.drop(key)

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by `factor` (lossy recovery: the mean over the micro-batches held)."""
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)
