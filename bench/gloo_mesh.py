"""Gloo group construction on the loopback, with torch alone: how often `connectFullMesh` fails.

A diagnostic, not a benchmark (not in `run_all.py`). Under heavy load (load average 10-20 on 2 cores)
tests that build many gloo groups failed now and then with "Gloo connectFullMesh failed ... Connection
closed by peer" (tests/runtime/test_runtime_devices.py). This script takes schedcomp out of the
picture: 4 processes each build N process groups directly on `ProcessGroupGloo` (as
`runtime/fault/groups.py` does), on a FileStore or a TCPStore, one gloo device per group or one shared
device, and counts the trials that failed.

    python bench/gloo_mesh.py --backends cpu,cuda --groups 12 --store file --trials 6
    python bench/gloo_mesh.py --backends cpu --groups 24 --store tcp --trials 10 --shared-device

Seen here (torch 2.13 CPU, 2 cores, load 5-20 from other jobs): one device per group failed 2 of 6
(cpu,cuda x 12, file), 1 of 6 (cpu x 24, file), 1 of 6 (cpu x 24, tcp); one shared device 0 of 10.
A shared device is not an option for schedcomp: gloo's listener keeps the callback of a pair whose
construction was abandoned (`groups._make_group_abortably`), and a late peer would reach it.
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

_DEVICES: list = []


def _device(shared: bool):
    if shared and _DEVICES:
        return _DEVICES[0]
    _DEVICES.append(dist.ProcessGroupGloo.create_device(hostname="127.0.0.1"))
    return _DEVICES[-1]


def _group(store, rank: int, size: int, backends: list[str], shared: bool) -> ProcessGroup:
    pg = ProcessGroup(store, rank, size)
    for device in backends:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=60)
        options._devices = [_device(shared)]
        sub = PrefixStore(device, store) if len(backends) > 1 else store
        pg._register_backend(torch.device(device), ProcessGroup.BackendType.GLOO,
                             dist.ProcessGroupGloo(sub, rank, size, options))
    return pg


def _child(rank: int, where: str, args: argparse.Namespace) -> None:
    if args.store == "file":
        store = dist.FileStore(where, 4)
    else:
        store = dist.TCPStore("127.0.0.1", int(where), 4, rank == 0, timeout=datetime.timedelta(seconds=60))
    keep = [_group(PrefixStore(f"g{i}", store), rank, 4, args.backends, args.shared_device) for i in range(args.groups)]
    assert len(keep) == args.groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", type=lambda s: s.split(","), default=["cpu"])
    ap.add_argument("--groups", type=int, default=24)
    ap.add_argument("--store", choices=("file", "tcp"), default="file")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--shared-device", action="store_true")
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
    print(f"{args.backends} x {args.groups} groups, {args.store} store, "
          f"{'one shared device' if args.shared_device else 'a device per group'}: {failed} of {args.trials} failed")


if __name__ == "__main__":
    main()
