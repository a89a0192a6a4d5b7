"""The launcher's part in a job spread over hosts: the job's store, served here or reached elsewhere.

One launcher serves the store (`--serve-store`, or loopback on a free port by default); the others reach
it (`--store`), waiting for it at most `--store-timeout` seconds, so they may start first (`open_store`).
A launcher that reaches the store over the network can lose it: with no answer for `--store-timeout`
seconds its host is cut off, and it stops its workers and exits 75 (`cut_off_watch`; the workers fence
themselves too, `fault.fence`). The serving launcher outlives its own workers while other hosts' workers
still beat (`serve_other_hosts`), so the store does not vanish under workers still leaving the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from torch.distributed import Store, TCPStore

from schedcomp.runtime.fault.fence import Fence, exit_fenced
from schedcomp.runtime.fault.store import LOOPBACK, Keys, StoreAddress, get_int, serve_store
from schedcomp.topology import Worker

log = logging.getLogger(__name__)


def open_store(store: StoreAddress | None, serve: StoreAddress | None,
               timeout: float) -> tuple[TCPStore | None, StoreAddress, Store]:
    """The job's store: served here (on `serve`, else loopback on a free port) unless `store` names another
    launcher's, reached within `timeout` seconds. Returns the server (None when reached), the store's address
    and a client of its root (every run's keys, under `run{k}/`: `store.run_store`)."""
    server = None
    if store is None:  # this launcher serves the job's store
        server, store = serve_store(*((serve.host, serve.port) if serve else (LOOPBACK, 0)))
    # another launcher's store may still be starting
    return server, store, store.connect() if server else store.reach(timeout)


def cut_off_watch(timeout: float, workers: Sequence[Worker], stop_workers: Callable[[], None]) -> Fence:
    """A watch (started by the caller, fed `contact()` on each answer from the store) that, after `timeout`
    seconds without one, calls `stop_workers` and exits 75: this host is cut off from the job."""
    def cut_off(message: str) -> None:
        stop_workers()  # they fence themselves too
        exit_fenced(message)

    return Fence(timeout, f"launcher of {', '.join(str(w) for w in workers)}",
                 "this host is cut off from the job: stopping its workers", action=cut_off)


def serve_other_hosts(store: Store, others: Sequence[Worker], linger: float, stop: list[int]) -> int | None:
    """Keep serving the store while `others` (other hosts' workers) still beat (at most 20 x `linger` s),
    unless a signal asks us to stop (`stop`, filled by the launcher's handlers): returns that signal.

    Without this, the store would vanish under workers of other hosts still leaving the job
    (closing their groups), and they would fence themselves instead of exiting cleanly. On a
    signal the user asked for exactly that: they lose the store, fence themselves (status 75)
    and their launchers, with no answer for `--store-timeout`, stop what is left and exit 75.
    """
    if not others:
        return None
    beats, quiet_since, deadline = None, time.monotonic(), time.monotonic() + 20 * linger
    while time.monotonic() < deadline:
        if stop:
            log.warning("signal %d: no longer serving the store to the workers of other hosts", stop[0])
            return stop[0]
        now = [get_int(store, Keys.heartbeat(w), 0) for w in others]
        if now != beats:
            beats, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since > linger:
            return None
        time.sleep(min(0.5, linger / 4))
    return None
