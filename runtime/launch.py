"""Run a function in N local processes joined over gloo (or NCCL), with a hard timeout (tests and benchmarks).

`torchrun --standalone` is the way to launch real jobs (see `schedcomp.runtime.demo`); this is
the small in-process equivalent: fresh processes, a file store in a private temporary folder
(nothing listens on the network), and a deadline after which every process is killed, so a hang
fails instead of blocking.

The processes come from multiprocessing's fork server with torch and the runtime preloaded: each
skips its own ~2 s `import torch` (most of a small test job on a 2-core machine). A fork server's
children inherit *its* environment, working directory and random state, not ours at the time of
the call, so `_child` takes ours over first: as with a freshly spawned interpreter.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from schedcomp.errors import RuntimeSetupError
from schedcomp.runtime.comm import backend_config, backend_spec, local_device
from schedcomp.runtime.fault.store import LOOPBACK
from schedcomp.runtime.fault.zygote import TORCH_LAZY, take_over


def _child(rank: int, fn: Callable[..., Any], world: int, store: str, threads: int, args: tuple[Any, ...],
           backend: str | None, port: int, env: dict[str, str], cwd: str) -> None:
    take_over(env, cwd)
    torch.set_num_threads(threads)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    os.environ["LOCAL_RANK"] = str(rank)  # one host: the rank is the local rank (its GPU under NCCL)
    if backend is None:  # what torchrun sets: the function joins (`comm.init_distributed`) on its own
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port))
    else:
        spec = backend_spec(backend)
        local_device(spec)
        dist.init_process_group(backend_config(spec), init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on the loopback right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), timeout: float = 120.0,
          threads: int = 1, backend: str | None = "gloo") -> None:
    """Run `fn(rank, *args)` in `nprocs` processes (joined over `backend`, see `comm.backend_spec`; under
    NCCL rank r runs on GPU r); raise if one fails or time runs out. `backend=None`: not joined, but
    given torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT on the loopback).

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
        port = free_port() if backend is None else 0
        # before its first use; torch's lazy imports too, or each process pays for them in its first backward
        mp.set_forkserver_preload(["torch", "torch.distributed", *TORCH_LAZY, "schedcomp.runtime"])
        context = mp.start_processes(_child, (fn, nprocs, store, threads, args, backend, port, dict(os.environ),
                                              os.getcwd()), nprocs=nprocs, join=False, start_method="forkserver")
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
