"""Gloo groups serving two devices on the loopback, with torch alone: one gloo object per device type fails.

A diagnostic, not a benchmark (not in `run_all.py`). Tests that built "cpu:gloo,cuda:gloo" groups failed
now and then under load with "Gloo connectFullMesh failed ... Connection closed by peer"
(tests/runtime/test_runtime_devices.py, and CI once). The cause, seen with strace: a `ProcessGroup`
keeps the first backend object registered for a backend type and silently drops a later one of the
same type ("reuse the existing backend"). So a second gloo object built for cuda was destroyed as soon
as it was registered, closing the connections of a context that slower members were still
connecting to: they read EOF. `runtime/fault/groups._make_group` builds one object per backend and
registers it for every device it serves; `--per-device` builds one per device type, as it used to.

    python bench/gloo_mesh.py --groups 12 --trials 4              # one object per backend: 0 failures
    python bench/gloo_mesh.py --groups 12 --trials 4 --per-device # fails under load

Seen here (torch 2.13 CPU, 2 cores, 24 busy loops beside it, load 13-28, 12 groups x 4 processes,
FileStore): one object per device type failed 8 of 8 trials; one object per backend 0 of 4; gloo on
the cpu alone 0 of 4. On a quiet machine both passed (0 of 6): the dropped context must close before
a peer finishes connecting to it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import PrefixStore, ProcessGroup


def _group(store, rank: int, size: int, per_device: bool) -> ProcessGroup:
    """A group serving cpu and cuda with gloo: one gloo object for both, or (`per_device`) one each."""
    pg = ProcessGroup(store, rank, size)
    made = None
    for device in ("cpu", "cuda"):
        if made is None or per_device:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=60)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            made = dist.ProcessGroupGloo(PrefixStore(device, store), rank, size, options)
        pg._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO, made)
    return pg


def _child(rank: int, where: str, args: argparse.Namespace) -> None:
    if args.store == "file":
        store = dist.FileStore(where, 4)
    else:
        store = dist.TCPStore("127.0.0.1", int(where), 4, rank == 0, timeout=datetime.timedelta(seconds=60))
    keep = [_group(PrefixStore(f"g{i}", store), rank, 4, args.per_device) for i in range(args.groups)]
    assert len(keep) == args.groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--store", choices=("file", "tcp"), default="file")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--per-device", action="store_true", help="one gloo object per device type (the old way)")
    args = ap.parse_args()
    failed = 0
    for trial in range(args.trials):
        with tempfile.TemporaryDirectory() as folder:
            if args.store == "file":
                where = os.path.join(folder, "store")
            else:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    where = str(s.getsockname()[1])
            try:
                mp.start_processes(_child, (where, args), nprocs=4, start_method="spawn")
            except Exception as e:  # one process's failure, as torch reports it
                failed += 1
                print(f"trial {trial}: {str(e).strip().splitlines()[-1][:160]}", flush=True)
    print(f"{args.groups} groups, {args.store} store, one gloo object "
          f"{'per device type' if args.per_device else 'per backend'}: {failed} of {args.trials} failed")


if __name__ == "__main__":
    main()
