"""The launcher's store across hosts (`fault.launch_hosts`), in-process: served or reached, the cut-off
watch's action, and serving other hosts' workers after ours. The whole stories (a host cut off, a signal
while serving) are `test_fault_hosts.py` and `test_fault_bounds.py`."""

from __future__ import annotations

import pytest

from schedcomp.runtime.fault import launch_hosts
from schedcomp.runtime.fault.launch_hosts import cut_off_watch, open_store, serve_other_hosts
from schedcomp.runtime.fault.store import Keys, get_int
from schedcomp.topology import Worker

pytestmark = pytest.mark.timeout(60)


def test_one_launcher_serves_the_store_and_another_reaches_it_at_its_address() -> None:
    server, address, root = open_store(None, None, timeout=5.0)
    assert server is not None and address.port > 0
    other_server, other_address, other_root = open_store(address, None, timeout=5.0)
    assert other_server is None and other_address == address
    root.set("seen", "yes")
    assert other_root.get("seen") == b"yes"  # one store, two clients


def test_a_cut_off_host_stops_its_workers_before_it_exits_fenced(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(launch_hosts, "exit_fenced", lambda message: events.append(f"exit: {message}"))
    watch = cut_off_watch(30.0, [Worker(0, 0), Worker(0, 1)], lambda: events.append("stop"))
    assert watch.what == "launcher of 0:0, 0:1" and watch.limit == 30.0
    watch.action("no answer")  # what the watch calls once the store is silent for the limit
    assert events == ["stop", "exit: no answer"]


def test_serving_other_hosts_ends_at_once_without_them_or_on_a_signal_and_once_they_are_quiet() -> None:
    server, _, root = open_store(None, None, timeout=5.0)
    assert server is not None
    others = [Worker(1, 0)]
    assert serve_other_hosts(root, [], linger=60.0, stop=[]) is None  # nobody else: no wait
    root.add(Keys.heartbeat(others[0]), 1)
    assert serve_other_hosts(root, others, linger=60.0, stop=[15]) == 15  # a signal: stop at once
    assert serve_other_hosts(root, others, linger=0.05, stop=[]) is None  # no new beat for `linger`: done
    assert get_int(root, Keys.heartbeat(others[0])) == 1  # only read
