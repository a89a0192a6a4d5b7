"""Random streams per micro-batch: a forward draws the same numbers wherever and whenever it runs.

    with drawing(stream_seed(seed, iteration, stage, pipeline, microbatch), device):
        out = module(*inputs)          # dropout masks from that micro-batch's own stream

Random layers (dropout) draw from torch's global generators. If a worker's forwards shared one
stream, a micro-batch's mask would depend on which micro-batches ran before it on that worker:
on the schedule's order, on a re-route to another pipeline's worker, on a replay that splits the
micro-batches differently (`fault.swift`). So each forward of a stage on a micro-batch draws
from a stream of its own, seeded by (job seed, iteration, virtual stage, home pipeline,
micro-batch), and the global state is restored after it (a fork, as `torch.random.fork_rng`,
without its checks: this runs around every forward). On a GPU job the current device's CUDA
generator is forked and seeded alike; the CPU one always is (CPU ops draw from it).
A single-process reference draws the same way by running each micro-batch's forward under
the same `drawing`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """SplitMix64's finaliser: every input bit changes about half the output bits."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def stream_seed(seed: int, iteration: int, stage: int, pipeline: int, microbatch: int) -> int:
    """The seed of one micro-batch's forward on one (virtual) stage in one iteration (63 bits, for torch)."""
    x = seed & _MASK
    for part in (iteration, stage, pipeline, microbatch):  # mixed before the next part: (1, 0) and (0, 1) differ
        x = _mix(_mix((x + 0x9E3779B97F4A7C15) & _MASK) ^ (part & _MASK))
    return x >> 1


@contextmanager
def drawing(seed: int | None, device: torch.device) -> Iterator[None]:
    """Run the body on the random stream `seed` (None: on the global streams, as they are), then restore them."""
    if seed is None:
        yield
        return
    cpu = torch.default_generator
    saved = cpu.get_state()
    cuda = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None
    saved_cuda = cuda.get_state() if cuda is not None else None
    cpu.manual_seed(seed)
    if cuda is not None:
        cuda.manual_seed(seed)
    try:
        yield
    finally:
        cpu.set_state(saved)
        if cuda is not None:
            cuda.set_state(saved_cuda)
