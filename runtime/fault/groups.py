"""Process groups for one generation, built without the dead: `regroup(store, view, me) -> Groups`.

Each generation gets a fresh key space (`gen{G}/...` in the job's store), and its groups are
backend objects (`ProcessGroupGloo`, `ProcessGroupNCCL`) constructed directly on it by their
members only: nothing waits for a rank that is gone, and no `init_process_group` /
`new_group` over the old world is needed (there may be no default group at all).

The groups are registered with `torch.distributed` under this generation's ranks (a member's
rank is its index in `view.members`), so the usual calls work on them: `dist.all_reduce(t,
group=g)`, `dist.isend(t, dst=rank, group=g)`, `dist.broadcast(t, src=rank, group=g)`,
`dist.batch_isend_irecv`, `dist.get_backend(g)`, `dist.destroy_process_group(g)`.

Leaving a broken generation: its groups may still run operations that wait on a hung peer, and
gloo cannot cancel them (`abort()` and `shutdown()` do not wake them); destroying such a group
blocks, with the GIL held, until the operation times out. So `Generation.close(graveyard)` buries
the groups instead, and `Graveyard.sweep()` destroys them once their operations' timeout has
passed. (When the launcher fences a failed worker, i.e. kills it, its sockets close and the
pending operations fail at once; the graveyard is for hosts that vanish without a word.)

Devices: `backend="gloo"` builds CPU groups; `"nccl"` (or `"cpu:gloo,cuda:nccl"`) builds groups
that serve both, gloo for the CPU (control tensors, plain-data transfers) and NCCL for the GPU.
NCCL, unlike gloo, can cancel: a broken generation's NCCL communicators are aborted when it is
left (their kernels, waiting on a dead peer, would otherwise hold the GPU's streams), and they
are built with blocking waits and without the watchdog's process teardown (`_nccl_env`), so a
wait on a dead peer can be given up (`membership.wait_abortable`) and the survivor lives on.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, ProcessGroup, Store

from schedcomp.errors import RecoveryError, RuntimeSetupError
from schedcomp.runtime.comm import backend_config, backend_spec, served_devices
from schedcomp.runtime.fault.membership import WAITER_THREAD, GenerationAborted, View
from schedcomp.runtime.fault.store import LOOPBACK
from schedcomp.topology import Worker

log = logging.getLogger(__name__)

NON_MEMBER = dist.GroupMember.NON_GROUP_MEMBER


class Generation:
    """Builds this worker's process groups for one generation; a drop-in for `dist.new_group`.

    `new_group(ranks)` has `dist.new_group`'s contract (every rank of the generation calls it, in
    the same order, non-members get `NON_MEMBER`) but only members touch the store, so it never
    waits on a worker that is not in `ranks`. This matches the runtime's `GroupFactory`.
    """

    def __init__(self, store: Store, view: View, me: Worker, *, backend: str = "gloo", host: str = LOOPBACK,
                 timeout: float = 60.0, device: torch.device | None = None,
                 abort: Abort | None = None) -> None:
        try:
            self.spec = backend_spec(backend)
        except RuntimeSetupError as e:
            raise RecoveryError(f"cannot rebuild groups per generation: {e}") from None
        if "cpu" not in self.spec:  # commit records, ledgers and state headers travel as CPU tensors
            raise RecoveryError(f"backend {backend!r} has no CPU backend, which a resilient job needs: use nccl "
                                "(it means cpu:gloo,cuda:nccl) or gloo")
        self.view, self.me, self.backend, self.host = view, me, backend, host
        self.rank, self.size = view.rank(me), len(view.members)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if self.spec.get("cuda") == "nccl"
                                 else torch.device("cpu"))
        self._store = store  # the job's store: each group gets the keys gen{G}/{call}:{members}/
        self.abort = abort
        self._calls = 0
        self._groups: list[ProcessGroup] = []

    @property
    def generation(self) -> int:
        return self.view.generation

    def new_group(self, ranks: Sequence[int]) -> ProcessGroup:
        """A group over these generation ranks (collective in call order, like `dist.new_group`)."""
        members = sorted(set(ranks))
        call, self._calls = self._calls, self._calls + 1
        if not members or members[0] < 0 or members[-1] >= self.size:
            raise RecoveryError(f"group ranks {members} are outside generation {self.generation}'s "
                                f"0..{self.size - 1}")
        if self.rank not in members:
            return NON_MEMBER
        name = f"schedcomp.gen{self.generation}.{call}"
        # The prefix names the call *and* its members: workers of different stages make their own
        # stage's group at the same call index, and must not share keys.
        prefix = f"gen{self.generation}/{call}:{'-'.join(map(str, members))}"
        args = (members.index(self.rank), len(members), self.spec, self.host, self.timeout, name)
        if self.abort is None:
            store = PrefixStore(prefix, self._store)
            pg = _make_group(store, *args)
        else:
            pg, store = _make_group_abortably(prefix, args, self.device, self.abort)
        # One backend: its plain name (what `dist.get_backend` says of a `new_group`); both: torch's list form.
        config = backend_config(self.spec) if len(self.spec) > 1 else self.backend
        _register(pg, name, config, store, {r: i for i, r in enumerate(members)})
        self._groups.append(pg)
        return pg

    def group_of(self, workers: Iterable[Worker]) -> ProcessGroup:
        """`new_group` over these members of the view."""
        return self.new_group([self.view.rank(w) for w in workers])

    def close(self, graveyard: Graveyard | None = None) -> None:
        """Leave this generation: destroy its groups now, or bury them in `graveyard` (after a failure)."""
        groups, self._groups = self._groups, []
        if graveyard is not None:
            _abort_nccl(groups)  # frees kernels stuck on a dead peer now; gloo's pending ops must time out
            graveyard.bury(groups, self.timeout.total_seconds())
        else:
            _destroy(groups)


class Graveyard:
    """Groups of broken generations, kept alive until every operation they may still run has timed out."""

    def __init__(self) -> None:
        self._graves: list[tuple[float, list[ProcessGroup]]] = []

    def bury(self, groups: list[ProcessGroup], timeout: float) -> None:
        self._graves.append((time.monotonic() + timeout, groups))

    def sweep(self, now: float | None = None) -> int:
        """Destroy the groups whose operations have all timed out by now; return how many remain buried."""
        now = time.monotonic() if now is None else now
        keep = []
        for deadline, groups in self._graves:
            if deadline <= now:
                _destroy(groups)
            else:
                keep.append((deadline, groups))
        self._graves = keep
        return sum(len(groups) for _, groups in keep)


def _destroy(groups: list[ProcessGroup]) -> None:
    for pg in reversed(groups):
        try:
            dist.destroy_process_group(pg)
        except Exception as e:  # a broken group may fail to shut down cleanly; it is gone either way
            log.debug("destroying a broken group: %s", e)


@dataclass(frozen=True)
class Groups:
    """One generation's groups for this worker: the world of survivors and its stage's group."""

    generation: Generation
    world: ProcessGroup
    stage: ProcessGroup | None  # None when this worker is its stage's only live worker

    @property
    def view(self) -> View:
        return self.generation.view

    @property
    def rank(self) -> int:
        return self.generation.rank

    def rank_of(self, worker: Worker) -> int:
        """A member's rank in this generation (in `world` and in `dist.*` calls on these groups)."""
        return self.view.rank(worker)

    def close(self, graveyard: Graveyard | None = None) -> None:
        """See `Generation.close`: pass a graveyard when leaving a broken generation."""
        self.generation.close(graveyard)


def regroup(store: Store, view: View, me: Worker, *, backend: str = "gloo", host: str = LOOPBACK,
            timeout: float = 60.0, device: torch.device | None = None, abort: Abort | None = None,
            graveyard: Graveyard | None = None) -> Groups:
    """Build this worker's groups for the (sealed) `view`: the world over its members, and its stage.

    Every member of the view calls it; it returns once the groups this worker belongs to are
    connected (the stage groups of other stages are built by their own members only). With
    `abort`, it raises `GenerationAborted` as soon as the generation breaks (the groups built so
    far go to `graveyard`).
    """
    gen = Generation(store, view, me, backend=backend, host=host, timeout=timeout, device=device, abort=abort)
    try:
        world = gen.new_group(range(gen.size))
        stage = None
        for s in range(view.topology.pp):
            members = view.topology.stage_group(s)
            if len(members) > 1:
                group = gen.group_of(members)
                if s == me.stage:
                    stage = group
    except BaseException:
        gen.close(graveyard)
        raise
    return Groups(gen, world, stage)


@dataclass(frozen=True)
class Abort:
    """How a group construction gives up: a fresh store client for its thread, and the generation's signal."""

    connect: Callable[[], Store]  # a new client of the job's store (`StoreAddress.connect`)
    signal: threading.Event  # set when the generation breaks (`FailureDetector.signal`)


def _make_group_abortably(prefix: str, args: tuple, device: torch.device,
                          abort: Abort) -> tuple[ProcessGroup, Store]:
    """`_make_group` in a thread of its own, given up (`GenerationAborted`) as soon as `abort.signal` trips.

    Gloo's construction waits for every member's address in the store and for its connections,
    and nothing interrupts it but the group timeout: a member that died after the agreement
    would hold everyone there. So a thread builds the group, on a store client of its own (a
    client serves one call at a time, and the agreement that follows an abort needs ours), and
    this thread watches it and the signal. An abandoned construction ends when its timeout passes.
    """
    done, out = threading.Event(), []

    def build() -> None:
        try:
            if device.type == "cuda":  # a new thread starts on device 0: build on the caller's device
                torch.cuda.set_device(device)
            store = PrefixStore(prefix, abort.connect())
            out.append((_make_group(store, *args), store))
        except BaseException as e:  # handed to the caller below, unless it gave up
            out.append(e)
        finally:
            done.set()

    threading.Thread(target=build, name=WAITER_THREAD, daemon=True).start()
    delay = 1e-4
    while not done.wait(delay):
        if abort.signal.is_set() and not done.is_set():
            raise GenerationAborted("the generation broke while its groups were built: agree on the next one")
        delay = min(2 * delay, 5e-3)
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _make_group(store: Store, rank: int, size: int, spec: dict[str, str], host: str,
                timeout: datetime.timedelta, name: str) -> ProcessGroup:
    """A `ProcessGroup` with one backend object per backend of `spec`, built directly on `store` (what
    `new_group` does inside), each in its own key space of the store.

    One object per backend, not per device type: a `ProcessGroup` keeps the first object registered
    for a backend type and silently drops any later one ("cpu:gloo,cuda:gloo" would build a second
    gloo context for cuda and destroy it at once). The dropped context closes its connections while
    slower members are still connecting to them, and they fail with "Connection closed by peer"."""
    pg = ProcessGroup(store, rank, size)
    built: dict[str, tuple[ProcessGroup.BackendType, object]] = {}
    for device, impl_name in spec.items():
        if impl_name not in built:
            sub = PrefixStore(impl_name, store) if len(set(spec.values())) > 1 else store
            built[impl_name] = _make_backend(sub, rank, size, impl_name, host, timeout, name)
        kind, impl = built[impl_name]
        if device == "cuda" or len(spec) == 1:
            pg._set_default_backend(kind)  # the GPU's backend answers `get_backend` on a GPU job
        pg._register_backend(torch.device(device), kind, impl)
    pg._set_group_name(name)
    return pg


def _make_backend(store: Store, rank: int, size: int, impl_name: str, host: str, timeout: datetime.timedelta,
                  name: str) -> tuple[ProcessGroup.BackendType, object]:
    if impl_name == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # listen where the user said
        return ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, rank, size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.group_name = name
    with _nccl_env():
        return ProcessGroup.BackendType.NCCL, dist.ProcessGroupNCCL(store, rank, size, options)


@contextlib.contextmanager
def _nccl_env() -> Iterator[None]:
    """Read by `ProcessGroupNCCL` when built: waits block the host, so an abandoned wait is on a thread we
    can leave (`wait_abortable`), and an NCCL error aborts the communicator without killing the process
    (the default tears it down: a survivor would die with its dead peer). Set only while building ours."""
    wanted = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _abort_nccl(groups: list[ProcessGroup]) -> None:
    """Abort the NCCL communicators of a broken generation's groups (gloo ones are left to time out)."""
    cuda = torch.device("cuda")
    for pg in groups:
        if "cuda" not in served_devices(pg):
            continue
        try:
            backend = pg._get_backend(cuda)
            if isinstance(backend, getattr(dist, "ProcessGroupNCCL", ())):
                backend.abort()
        except Exception as e:  # already aborted by its watchdog, or never connected: gone either way
            log.debug("aborting a broken NCCL group: %s", e)


def _register(pg: ProcessGroup, name: str, backend: str, store: Store, ranks: dict[int, int]) -> None:
    """Tell `torch.distributed` about the group, as `new_group` would (and `destroy_process_group` undoes).

    Without it `dist.isend(dst=...)`, `dist.broadcast(src=...)` and `batch_isend_irecv` cannot map
    ranks, and `dist.get_backend(group)` fails. These are torch's private tables (torch 2.4 - 2.13).
    """
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    world.pg_map[pg] = (backend, store)
    world.pg_names[pg] = name
    world.pg_backend_config[pg] = backend
    world.pg_group_ranks[pg] = ranks
    tag = f"ptd:{name}"
    world.pg_to_tag[pg] = tag
    world.tags_to_pg.setdefault(tag, []).append(pg)
    world.tags_to_pg.setdefault("", []).append(pg)
    c10d._register_process_group(name, pg)
