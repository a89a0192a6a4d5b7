"""Several hosts on one machine: network namespaces joined by a bridge, for the multi-host fault tests.

`Hosts(n)` makes n+1 namespaces, all named after this process and a counter (unique per run):
a "switch" holding a bridge, and n hosts, each with one veth into the bridge and the address
10.213.0.(i+1)/24. The addresses exist only inside these namespaces (the machine's own network is
never touched), so every run has the same ones. Cutting a host off sets its switch-side link down:
its packets and the others' packets to it are dropped, no connection is closed or reset, as when
a cable is pulled. `close()` kills every process left in the namespaces and deletes them.

`unavailable()` says why namespaces cannot be made here (no `ip`, not root, no permission), or None.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence

SUBNET = "10.213.0"
_counter = itertools.count()


def _ip(*args: str, netns: str | None = None) -> str:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why network namespaces cannot be created on this machine (None: they can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (ip netns add): run the tests as root"
    probe = f"scprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as e:
        return f"cannot create a network namespace here ({e})"
    try:
        _ip("link", "add", "br0", "type", "bridge", netns=probe)
    except RuntimeError as e:
        return f"cannot create a bridge inside a network namespace ({e})"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Hosts:
    """n hosts (network namespaces) on one bridge; see the module docstring."""

    def __init__(self, n: int) -> None:
        tag = f"sc{os.getpid()}x{next(_counter)}"
        self.switch = f"{tag}sw"
        self.names = [f"{tag}h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", name)
            self._made.append(name)
            # both ends are created inside our namespaces: nothing appears in the machine's own
            _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
            _ip("link", "set", f"port{i}", "master", "br0", netns=self.switch)
            _ip("link", "set", f"port{i}", "up", netns=self.switch)
            _ip("link", "set", "lo", "up", netns=name)
            _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=name)
            _ip("link", "set", "eth0", "up", netns=name)

    def popen(self, host: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `argv` inside host `host`'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[host], *argv], env=env, **kwargs)

    def cut(self, host: int) -> None:
        """Drop every packet to and from `host` (its switch port goes down; no connection is closed)."""
        _ip("link", "set", f"port{host}", "down", netns=self.switch)

    def heal(self, host: int) -> None:
        _ip("link", "set", f"port{host}", "up", netns=self.switch)

    def pids(self, host: int) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.names[host]).split()]

    def kill_all(self, host: int) -> int:
        """SIGKILL every process of `host` (the host is lost); returns how many there were."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def close(self) -> None:
        """Kill what is left in every namespace and delete them (safe to call twice)."""
        for name in reversed(self._made):
            if name in self.names:
                with contextlib.suppress(RuntimeError):
                    self.kill_all(self.names.index(name))
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
