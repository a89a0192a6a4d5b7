"""The job's store: where it listens, how workers reach it, and the names of the keys we keep in it.

The store is a `torch.distributed.TCPStore`. Its server binds to 127.0.0.1 unless the user names
another address: torch's own server listens on every interface, so `serve_store` binds the
listening socket itself and hands it over (`master_listen_fd`).

Every thread that talks to the store opens its own client (`StoreAddress.connect`): a heartbeat
thread must not queue behind a main thread blocked in a long `wait`.

Runs: a job restarted from a checkpoint (`launch --max-restarts`) is a new run of every worker,
and run k > 0 keeps its keys under `run{k}/` (`run_store`), so nothing of an older run (its
generations, commit records, death notices) is ever seen by a newer one. Run 0 uses the bare
names. A worker learns its run from SCHEDCOMP_RUN; `WorkerEnv` scopes its store address to it,
so every client it opens (`StoreAddress.connect`) is already in the run's namespace.

Keys (one namespace per run, all written through `Keys`, so the layout is in one place):
- `hb/W`        heartbeat counter of worker W (`add`: no clocks are compared across hosts)
- `inc/W`       the incarnation of W that is running now (the launcher numbers them 0, 1, ...)
- `dead/W`      the highest incarnation of W known dead (written by the launcher that reaped it)
- `events`      bumped on every death notice and generation proposal, so watchers poll one key
- `gen/G/view`  the view proposed for generation G (first writer wins, by `compare_set`)
- `gen/G/ack`   how many members of view G acknowledged it; `gen/G/outcome`: sealed or superseded
- `join/W`      a replacement for W asks to be admitted (its incarnation)
- `commit/W`    the last iteration whose optimizer step W applied
- `restart/request`   a worker asks the launchers to restart the job from its checkpoint (JSON,
  first writer wins, see `restart`); `restart/previous`: the request that ended the run before
  (copied there by the launcher); `restart/restored`: the checkpoint this run resumed from
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from torch.distributed import PrefixStore, Store, TCPStore

from schedcomp.errors import RecoveryError
from schedcomp.topology import Worker

LOOPBACK = "127.0.0.1"
SEALED, SUPERSEDED = "sealed", "superseded"  # the outcomes of a generation (`gen/G/outcome`)
ENV_STORE = "SCHEDCOMP_STORE"  # host:port of the job's store
ENV_WORKER = "SCHEDCOMP_WORKER"  # d:s
ENV_SHAPE = "SCHEDCOMP_SHAPE"  # pp,dp
ENV_INCARNATION = "SCHEDCOMP_INCARNATION"  # 0 for the first process of a worker, then 1, 2, ...
ENV_BIND = "SCHEDCOMP_BIND"  # the address this worker's process groups listen on
ENV_RUN = "SCHEDCOMP_RUN"  # 0 for the job's first run, then 1, 2, ... after each restart from a checkpoint


def run_store(store: Store, run: int) -> Store:
    """`store` seen from inside run `run`'s namespace (`run{run}/`; run 0 keeps the bare names, so a
    job that never restarts has the same keys as without restarts)."""
    return PrefixStore(f"run{run}", store) if run > 0 else store


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's store listens."""

    host: str
    port: int
    run: int = 0  # clients land in this run's namespace (`run_store`); not part of the address's text

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> StoreAddress:
        host, sep, port = text.strip().rpartition(":")
        if not sep or not host or not port.isascii() or not port.isdigit() or int(port) > 65535:
            raise RecoveryError(f"bad store address {text[:60]!r}: write it as HOST:PORT with a port up to 65535, "
                                "e.g. 127.0.0.1:29400")
        return cls(host, int(port))

    def connect(self, timeout: float = 30.0) -> Store:
        """A new client of the store (one per thread that uses it), inside this address's run namespace."""
        return run_store(TCPStore(self.host, self.port, None, False, timeout=datetime.timedelta(seconds=timeout)),
                         self.run)

    def reach(self, timeout: float) -> Store:
        """`connect`, once the store accepts connections, waiting at most `timeout` seconds for that.

        TCPStore's own client retries a refused connection for about twice its timeout and then
        raises with a C++ stack dump; probing with a plain socket first gives one clear line, in
        bounded time, and still lets a launcher start a little before the one serving the store.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                socket.create_connection((self.host, self.port), timeout=max(left, 0.05)).close()
                break
            except socket.gaierror as e:
                raise RecoveryError(f"cannot resolve the store's host {self.host!r} ({e.strerror}): "
                                    "fix --store") from None
            except (OSError, OverflowError) as e:
                if left <= 0:
                    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or "timed out"
                    raise RecoveryError(f"cannot reach the job's store at {self} within {timeout:g} s ({reason}): "
                                        "start the launcher that serves it (--serve-store) or fix --store; "
                                        "wait longer with --store-timeout") from None
                time.sleep(min(0.1, max(left, 0.0)))
        try:
            return self.connect()
        except RuntimeError as e:  # torch.distributed's DistNetworkError / DistStoreError
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise RecoveryError(f"{self} accepts connections but is not the job's store ({first}): "
                                "fix --store") from None

    def scoped(self, run: int) -> StoreAddress:
        """The same store, with clients inside run `run`'s namespace."""
        return StoreAddress(self.host, self.port, run)


def serve_store(host: str = LOOPBACK, port: int = 0, timeout: float = 30.0) -> tuple[TCPStore, StoreAddress]:
    """Start the store's server on `host:port` (port 0: any free port); return it and its address.

    The server lives as long as the returned object; keep it referenced for the whole job.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except (OSError, OverflowError) as e:  # OverflowError: a port past 65535
        sock.close()
        raise RecoveryError(f"cannot listen on {host}:{port} for the job's store ({e}): pick a free port") from None
    bound = sock.getsockname()[1]
    # detach: the store's server owns the descriptor from now on and closes it.
    server = TCPStore(host, bound, None, True, timeout=datetime.timedelta(seconds=timeout),
                      wait_for_workers=False, master_listen_fd=sock.detach())
    server.add(Keys.events(), 0)
    return server, StoreAddress(host, bound)


class Keys:
    """Names of the keys the fault-tolerance layer keeps in the store (see the module docstring)."""

    @staticmethod
    def heartbeat(w: Worker) -> str:
        return f"hb/{w}"

    @staticmethod
    def incarnation(w: Worker) -> str:
        return f"inc/{w}"

    @staticmethod
    def dead(w: Worker) -> str:
        return f"dead/{w}"

    @staticmethod
    def events() -> str:
        return "events"

    @staticmethod
    def view(generation: int) -> str:
        return f"gen/{generation}/view"

    @staticmethod
    def ack(generation: int) -> str:
        return f"gen/{generation}/ack"

    @staticmethod
    def outcome(generation: int) -> str:
        return f"gen/{generation}/outcome"

    @staticmethod
    def join(w: Worker) -> str:
        return f"join/{w}"

    @staticmethod
    def better(generation: int, what: str) -> str:
        """A better plan for the generation (`fault.better`): "digest", "ready", "off" or "at"."""
        return f"gen/{generation}/better/{what}"

    @staticmethod
    def commit(w: Worker) -> str:
        return f"commit/{w}"

    @staticmethod
    def restart() -> str:
        return "restart/request"

    @staticmethod
    def previous_run() -> str:
        return "restart/previous"

    @staticmethod
    def restored() -> str:
        return "restart/restored"


def backoff(first: float, most: float) -> Iterator[float]:
    """Sleeps between polls (of the store, of a work item): `first`, doubling up to `most`, then `most` forever.

    A wait that ends soon is seen soon; a long one (a meeting whose last member is still
    importing torch, 8 workers on 2 cores) stops costing a store round trip every few ms, CPU
    that the member being waited for would otherwise have to share. Start a new one after progress.
    """
    delay = first
    while True:
        yield delay
        delay = min(2 * delay, most)


def get_int(store: Store, key: str, default: int = -1) -> int:
    """An integer key's value, or `default` when it is not set (never blocks)."""
    if not store.check([key]):
        return default
    return int(store.get(key))


@dataclass(frozen=True)
class WorkerEnv:
    """What the launcher tells a worker process (see `schedcomp.runtime.fault.launch`)."""

    store: StoreAddress
    worker: Worker
    pp: int
    dp: int
    incarnation: int
    bind: str = LOOPBACK
    run: int = 0  # restarts from a checkpoint so far: the store namespace is this run's

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", self.store.scoped(self.run))  # every client lands in the run's keys

    @property
    def rejoining(self) -> bool:
        """A replacement for a worker that died: it must be admitted and receive its stage's state."""
        return self.incarnation > 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WorkerEnv:
        env = dict(os.environ if env is None else env)
        missing = [k for k in (ENV_STORE, ENV_WORKER, ENV_SHAPE) if k not in env]
        if missing:
            raise RecoveryError(f"{', '.join(missing)} not set: start workers with "
                                "`python -m schedcomp.runtime.fault.launch`")
        pp, _, dp = env[ENV_SHAPE].partition(",")
        return cls(StoreAddress.parse(env[ENV_STORE]), Worker.parse(env[ENV_WORKER]), int(pp), int(dp),
                   int(env.get(ENV_INCARNATION, "0")), env.get(ENV_BIND, LOOPBACK), int(env.get(ENV_RUN, "0")))

    def to_env(self) -> dict[str, str]:
        return {ENV_STORE: str(self.store), ENV_WORKER: str(self.worker), ENV_SHAPE: f"{self.pp},{self.dp}",
                ENV_INCARNATION: str(self.incarnation), ENV_BIND: self.bind, ENV_RUN: str(self.run)}
