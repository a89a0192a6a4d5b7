"""The fence: a worker (or a launcher) that has no answer from the store for too long stops itself.

In-process, with the action replaced by a recorder (the real one ends the process); the whole
story, a host cut off by a network partition, is `test_fault_hosts.py`.
"""

from __future__ import annotations

import threading
import time

import pytest

from schedcomp.runtime.fault.fence import WORKER_FENCED, Fence
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


class ManualClock:
    """A clock the test advances: a fence's silence is then what the test says, however late its threads run."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_contact_keeps_a_fence_from_firing() -> None:
    seen, clock = Recorder(), ManualClock()
    fence = Fence(0.3, "worker 1:0", action=seen, clock=clock).start()
    try:
        for _ in range(24):  # four limits pass, with contact every 0.05 s of them
            clock.now += 0.05
            fence.contact()
            time.sleep(0.005)  # the fence's thread checks in between
        assert not seen.fired.is_set()
        clock.now += 0.31  # then a limit without contact
        assert seen.fired.wait(10.0)  # and it fires
    finally:
        fence.stop()
    assert seen.messages == ["worker 1:0: no answer from the job's store for 0.3 s (limit 0.3 s): " + WORKER_FENCED]


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
    # Each poll the store answers is a contact: the fence's silence restarts with every one. Once the
    # store is gone, no poll answers and the fence fires. The fence's clock is the test's.
    server, address = serve_store()
    seen, clock = Recorder(), ManualClock()
    detector = FailureDetector(address, Worker(0, 0), detection_time=0.5, poll=0.01)
    fence = detector._fence
    fence.action, fence.clock = seen, clock  # the real action ends the process
    contacts = threading.Semaphore(0)
    answered = fence.contact

    def contact() -> None:
        answered()
        contacts.release()

    fence.contact = contact
    detector.start()
    try:
        for _ in range(15):  # three detection times pass, and after each 0.1 s a poll is answered
            clock.now += 0.1
            while contacts.acquire(blocking=False):  # contacts from before this step
                pass
            assert contacts.acquire(timeout=20.0)
        assert not seen.fired.is_set()
        del server  # the store goes away
        assert detector.signal.wait(20.0)  # its poll failed: the detector stopped polling, no contact comes now
        clock.now += 0.6
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
