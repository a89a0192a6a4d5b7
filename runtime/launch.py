"""Run a function in N local processes joined over gloo, with a hard timeout (tests and benchmarks).

`torchrun --standalone` is the way to launch real jobs (see `schedcomp.runtime.demo`); this is
the small in-process equivalent: spawned processes, a file store in a private temporary folder
(nothing listens on the network), and a deadline after which every process is killed, so a hang
fails instead of blocking.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from schedcomp.errors import RuntimeSetupError


def _child(rank: int, fn: Callable[..., Any], world: int, store: str, threads: int, args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), timeout: float = 120.0,
          threads: int = 1) -> None:
    """Run `fn(rank, *args)` in `nprocs` processes (gloo already joined); raise if one fails or time runs out.

    `fn` must be importable by name (defined at a module's top level).
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise RuntimeSetupError(f"nprocs must be a positive whole number of processes, got {nprocs!r}")
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise RuntimeSetupError(f"threads must be a positive whole number, got {threads!r}")
    if not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        # a NaN deadline is never passed: a hang would block instead of failing
        raise RuntimeSetupError(f"timeout must be a finite number of seconds above 0, got {timeout!r}")
    with tempfile.TemporaryDirectory(prefix="schedcomp-") as folder:
        store = os.path.join(folder, "store")
        context = mp.start_processes(_child, (fn, nprocs, store, threads, args), nprocs=nprocs, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise RuntimeSetupError(f"{nprocs} processes did not finish within {timeout:.0f} s (a hang?): "
                                            "they were killed; rerun with logging to see where they stopped")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
