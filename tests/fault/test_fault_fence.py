"""The fence: a worker (or a launcher) that has no answer from the store for too long stops itself.

In-process, with the action replaced by a recorder (the real one ends the process); the whole
story, a host cut off by a network partition, is `test_fault_hosts.py`.
"""

from __future__ import annotations

import threading
import time

import pytest

from schedcomp.runtime.fault.fence import Fence
from schedcomp.runtime.fault.launch import main
from schedcomp.runtime.fault.membership import FailureDetector
from schedcomp.runtime.fault.store import serve_store
from schedcomp.topology import Worker

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self) -> None:
        self.messages: list[str] = []
        self.fired = threading.Event()

    def __call__(self, message: str) -> None:
        self.messages.append(message)
        self.fired.set()


def test_a_fence_fires_once_after_the_limit_without_contact() -> None:
    seen = Recorder()
    fence = Fence(0.3, "worker 1:0", "it stops", action=seen).start()
    try:
        assert seen.fired.wait(10.0)
        time.sleep(0.2)  # it does not fire again
    finally:
        fence.stop()
    assert len(seen.messages) == 1
    assert seen.messages[0].startswith("worker 1:0: no answer from the job's store for ")
    assert seen.messages[0].endswith("(limit 0.3 s): it stops")


def test_contact_keeps_a_fence_from_firing() -> None:
    seen = Recorder()
    fence = Fence(0.3, "worker 1:0", action=seen).start()
    try:
        until = time.monotonic() + 1.2  # four limits, with contact all along
        while time.monotonic() < until:
            fence.contact()
            time.sleep(0.01)
        assert not seen.fired.is_set()
        assert seen.fired.wait(10.0)  # and it fires once contact stops
    finally:
        fence.stop()


def test_a_stopped_fence_never_fires() -> None:
    seen = Recorder()
    fence = Fence(0.2, "worker 1:0", action=seen).start()
    fence.stop()
    time.sleep(0.5)
    assert not seen.fired.is_set()


def test_a_fence_needs_a_positive_limit() -> None:
    with pytest.raises(ValueError, match="positive limit"):
        Fence(0.0, "worker 1:0")


def test_the_detector_polls_are_the_contact_and_a_dead_store_fences() -> None:
    # A detector whose store answers keeps its fence quiet; once the store is gone, it fires.
    server, address = serve_store()
    seen = Recorder()
    detector = FailureDetector(address, Worker(0, 0), detection_time=0.5, poll=0.01)
    detector._fence.action = seen  # the real action ends the process
    detector.start()
    try:
        time.sleep(1.5)  # three detection times with a live store
        assert not seen.fired.is_set()
        del server  # the store goes away
        assert seen.fired.wait(20.0)
        assert "worker 0:0: no answer from the job's store" in seen.messages[0]
    finally:
        detector.stop()


def test_a_detector_with_fence_off_only_trips() -> None:
    server, address = serve_store()
    detector = FailureDetector(address, Worker(0, 0), detection_time=0.2, poll=0.01, fence=False).start()
    try:
        time.sleep(1.0)  # it connects and polls
        assert not detector.signal.is_set()
        del server
        assert detector.signal.wait(20.0)
        assert detector.reason.startswith("store unreachable"), detector.reason
        time.sleep(0.5)  # more than the detection time: this process is still here
    finally:
        detector.stop()


def test_the_launcher_refuses_a_store_timeout_that_is_not_positive(capsys) -> None:
    assert main(["--pp", "2", "--store", "127.0.0.1:9", "--store-timeout", "0", "--", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--store-timeout must be a finite number of seconds, at least 0.1, got 0" in err
