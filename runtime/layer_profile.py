"""Per-layer costs, measured: what the compiler needs to move layers between stages.

`profile_layers(model, inputs, targets, loss_fn, make_optimizer)` runs one micro-batch through each
layer of an `nn.Sequential` the way a pipeline stage runs it (`runtime.stage.Stage`: the split backward,
the same optimizer), one layer at a time in this one process, and returns a `LayerProfile`: per layer
the median times of F, B, W and the optimizer step (milliseconds), the activation memory F holds and
the share of it B frees (`runtime.memory.MemoryMeter`: exact saved-tensor bytes on CPU, allocator deltas
on CUDA), and the static memory the layer holds whatever the schedule (parameters, their gradients and
the optimizer's state, in bytes). `LayerProfile.to_json()` is a layer-cost file for
`schedcomp compile --layer-costs`.

What one process cannot see is left out, not guessed: the gradient all-reduce (it depends on the
cluster; 0 here) and the p2p latency (0). `schedcomp profile` of a real run measures both per stage.

    python -m schedcomp.runtime.layer_profile -o layers.json   # the demo GPT's layers, on this machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from schedcomp.errors import RuntimeSetupError, SchedcompError
from schedcomp.fileio import write_atomic
from schedcomp.ir import InstrKind
from schedcomp.runtime.memory import MemoryMeter, storage_bytes
from schedcomp.runtime.stage import LossFn, OptimizerFactory, Stage, as_tuple

FORMAT = "schedcomp-layer-costs"
VERSION = 1
_KEY = (0, 0)  # the one micro-batch each layer runs


@dataclass(frozen=True)
class LayerProfile:
    """Measured per-layer costs (see the module docstring); one entry per layer of the model."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    optimizer: tuple[float, ...]
    activation: tuple[float, ...]
    b_frees: tuple[float, ...]
    static: tuple[float, ...]
    memory_unit: str

    def to_dict(self) -> dict[str, object]:
        layers = len(self.forward)
        return {
            "format": FORMAT, "version": VERSION,
            "forward": list(self.forward), "backward_input": list(self.backward_input),
            "backward_weight": list(self.backward_weight), "optimizer": list(self.optimizer),
            "allreduce": [0.0] * layers, "p2p": 0.0,
            "activation": list(self.activation), "b_frees": list(self.b_frees), "static": list(self.static),
            "memory_unit": self.memory_unit,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"


def profile_layers(model: nn.Sequential, inputs: Tensor | tuple[Tensor, ...], targets: object, loss_fn: LossFn,
                   make_optimizer: OptimizerFactory, *, repeats: int = 5, warmup: int = 1) -> LayerProfile:
    """Measure each layer of `model` on one micro-batch `inputs` (see the module docstring).

    The layers are used in place (their parameters take `warmup + repeats` optimizer steps: profile a
    copy if that matters). Times are medians over `repeats` after `warmup` untimed rounds."""
    if not isinstance(model, nn.Sequential) or len(model) < 1:
        raise RuntimeSetupError(f"profile_layers takes the model as a non-empty nn.Sequential, got "
                                f"{type(model).__name__}: its layers are what stages hold")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise RuntimeSetupError(f"repeats must be a positive whole number, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise RuntimeSetupError(f"warmup must be a whole number >= 0, got {warmup!r}")
    n = len(model)
    def optimizer_of(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        # A layer without parameters (an activation, a reshape) has nothing to step: an empty stand-in.
        return make_optimizer(params) if params else torch.optim.SGD([torch.zeros(0, requires_grad=True)], lr=0.0)

    stages = [Stage(i, n, nn.Sequential(model[i]), loss_fn if i == n - 1 else None, optimizer_of) for i in range(n)]
    first = as_tuple(inputs)
    device = first[0].device if first else torch.device("cpu")
    meters = [MemoryMeter(stage, device) for stage in stages]
    times: dict[str, list[list[float]]] = {k: [[] for _ in range(n)] for k in ("F", "B", "W", "STEP")}
    for round_ in range(warmup + repeats):
        timed = round_ >= warmup
        xs: tuple[Tensor, ...] = first
        for i, (stage, meter) in enumerate(zip(stages, meters, strict=True)):
            meter.forget()
            with meter.measure(InstrKind.F, _KEY), _clock(times["F"][i] if timed else None, device):
                xs = stage.forward(_KEY, tuple(x.detach() for x in xs), targets if stage.is_last else None)
        grads: tuple[Tensor, ...] = ()
        for i in reversed(range(n)):
            with meters[i].measure(InstrKind.B, _KEY), _clock(times["B"][i] if timed else None, device):
                grads = stages[i].backward(_KEY, grads, split=True)
        for i in range(n):
            with meters[i].measure(InstrKind.W, _KEY), _clock(times["W"][i] if timed else None, device):
                stages[i].backward_weight(_KEY)
            with _clock(times["STEP"][i] if timed else None, device):
                stages[i].step()
    activation, frees = [], []
    for i, (stage, meter) in enumerate(zip(stages, meters, strict=True)):  # one more F and B, measured for memory
        with meter.measure(InstrKind.F, _KEY):
            xs = stage.forward(_KEY, _inputs_of(model, i, first), targets if stage.is_last else None)
        held = meter.held
        with meter.measure(InstrKind.B, _KEY):
            stage.backward(_KEY, tuple(torch.ones_like(x) for x in xs) if not stage.is_last else (), split=True)
        activation.append(float(held))
        frees.append(min(1.0, max(0.0, 1.0 - meter.held / held)) if held > 0 else 0.5)
        stage.discard()
        stage.optimizer.zero_grad(set_to_none=True)
    return LayerProfile(
        forward=_medians(times["F"]), backward_input=_medians(times["B"]), backward_weight=_medians(times["W"]),
        optimizer=_medians(times["STEP"]), activation=tuple(activation), b_frees=tuple(frees),
        static=tuple(float(_static_bytes(stage)) for stage in stages), memory_unit="bytes")


def _inputs_of(model: nn.Sequential, layer: int, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """What layer `layer` receives for `inputs`: the layers before it, run without autograd."""
    xs = inputs
    with torch.no_grad():
        for i in range(layer):
            xs = as_tuple(model[i](*xs))
    return tuple(x.detach() for x in xs)


def _static_bytes(stage: Stage) -> int:
    """Parameters, their gradients (as large as the trainable ones, allocated whatever the schedule) and the
    optimizer's state tensors."""
    state = [t for s in stage.optimizer.state.values() for t in s.values() if isinstance(t, Tensor)]
    return storage_bytes(stage.module.parameters()) + storage_bytes(stage.params) + storage_bytes(state)


class _clock:
    """Append the block's wall time in milliseconds to `into` (None: do not time), the device synchronised."""

    def __init__(self, into: list[float] | None, device: torch.device) -> None:
        self.into, self.cuda = into, device.type == "cuda"
        self.device = device

    def __enter__(self) -> None:
        if self.into is not None:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.into is not None and exc[0] is None:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.into.append((time.perf_counter() - self.start) * 1e3)


def _medians(samples: Sequence[Sequence[float]]) -> tuple[float, ...]:
    return tuple(statistics.median(s) for s in samples)


def main(argv: Sequence[str] | None = None, out: Callable[[str], object] = print) -> int:
    """Profile the demo GPT's layers on this machine (`--device cuda` on a GPU) and write the layer costs."""
    from schedcomp.runtime.gpt import GPTConfig, gpt, lm_loss, synthetic_batch

    parser = argparse.ArgumentParser(prog="python -m schedcomp.runtime.layer_profile", description=main.__doc__)
    parser.add_argument("-o", "--output", required=True, help="the layer-cost JSON to write")
    parser.add_argument("--rows", type=int, default=8, help="rows of one micro-batch (default 8)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeats < 1:
        parser.error(f"--rows and --repeats must be positive, got {args.rows} and {args.repeats}")
    try:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeSetupError(f"--device {args.device}: no CUDA device is visible here")
    except RuntimeError as e:  # torch's own complaint about the device string
        parser.error(f"--device {args.device!r}: {str(e).splitlines()[0]}")
    config = GPTConfig()
    model = gpt(config, seed=0).to(device)
    inputs, targets = synthetic_batch(config, args.rows, seed=0)
    try:
        profile = profile_layers(model, inputs.to(device), targets.to(device), lm_loss,
                                 lambda p: torch.optim.AdamW(p, lr=3e-3), repeats=args.repeats)
        write_atomic(Path(args.output), profile.to_json(), RuntimeSetupError)
    except SchedcompError as e:
        print(f"layer_profile: {e}", file=sys.stderr)
        return 2
    out(f"{len(profile.forward)} layers -> {args.output}: F " + " ".join(f"{t:.2f}" for t in profile.forward) + " ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
