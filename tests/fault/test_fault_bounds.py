"""Every wait of a change of generation ends: the agreement's and the meetings' deadlines, and the
launcher's lingering for other hosts on a signal. Single process: fake stores, fake detectors, a fake clock."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import SimpleNamespace

import pytest

from schedcomp.runtime.fault import agreement
from schedcomp.runtime.fault import launch as launch_module
from schedcomp.runtime.fault import session as session_module
from schedcomp.runtime.fault.agreement import AgreementTimeout, agree
from schedcomp.runtime.fault.launch import Launcher
from schedcomp.runtime.fault.membership import GenerationAborted, View
from schedcomp.runtime.fault.protocol import MeetingTimeout, RecoveryTimeout, await_keys, meet
from schedcomp.runtime.fault.restart import CheckpointPolicy, LastResort
from schedcomp.runtime.fault.store import SUPERSEDED, Keys
from schedcomp.topology import Topology, Worker

pytestmark = pytest.mark.timeout(60)

ME = Worker(0, 0)
STEPS_WITHOUT_END = 20_000  # store operations after which an agreement clearly never looks at its deadline


class Clock:
    """A fake `time` for `agreement`: every store operation takes a second (see `LivelockStore`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class LivelockStore:
    """A store in which every step of an agreement changes something, forever.

    `superseding`: another proposer retires every generation as soon as it is proposed (what workers
    failing one after another, or a bug, look like to a survivor). Otherwise every view proposed
    counts `ME` failed, so a replacement for it moves on to the next one (never admitted).
    """

    def __init__(self, clock: Clock, superseding: bool) -> None:
        self.d: dict[str, bytes] = {}
        self.clock, self.superseding, self.operations = clock, superseding, 0

    def _tick(self) -> None:
        self.clock.now += 1.0
        self.operations += 1
        if self.operations > STEPS_WITHOUT_END:
            raise AssertionError(f"agree still running after {self.operations} store operations: no deadline")

    def _value(self, key: str) -> bytes | None:
        _, generation, what = [*key.split("/"), "", ""][:3]
        if self.superseding and what == "outcome":
            return SUPERSEDED.encode()
        if not self.superseding and what == "view":
            return View(int(generation), Topology.of(1, 2, [ME])).to_json().encode()
        return self.d.get(key)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._tick()
        current = self._value(key)
        if current is None and expected == "":
            self.d[key] = current = desired.encode()
        assert current is not None
        return current

    def add(self, key: str, amount: int) -> int:
        self._tick()
        value = int(self.d.get(key, b"0")) + amount
        self.d[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        self._tick()
        return all(self._value(k) is not None for k in keys)

    def get(self, key: str) -> bytes:
        self._tick()
        value = self._value(key)
        assert value is not None, key
        return value


class QuietDetector:
    """A failure detector that never sees anyone fail (the stuck-but-alive case)."""

    def __init__(self) -> None:
        self.signal = threading.Event()

    def watch(self, view: View) -> None:
        pass

    def failed(self) -> frozenset[Worker]:
        return frozenset()


@pytest.mark.parametrize("superseding", [True, False], ids=["survivor-superseded-forever", "replacement-not-admitted"])
def test_the_agreement_timeout_bounds_the_whole_call_even_when_every_step_changes_something(
        monkeypatch, superseding: bool) -> None:
    clock = Clock()
    monkeypatch.setattr(agreement, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    store = LivelockStore(clock, superseding)
    with pytest.raises(AgreementTimeout) as caught:
        agree(store, View.initial(1, 2), ME, QuietDetector(), propose=superseding, timeout=100.0)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and "came and went" in message and "within 100 s" in message, message
    assert clock.now < 200  # it gave up at its deadline (plus one step), not thousands of steps later
    assert store.operations < STEPS_WITHOUT_END


def test_a_meeting_nobody_else_reaches_ends_at_its_deadline_naming_the_key_and_the_count() -> None:
    store = LivelockStore(Clock(), superseding=True)
    store.add("gen4/arrived", 1)  # one other member arrived; the third is alive but stuck, so no signal
    with pytest.raises(MeetingTimeout) as caught:
        meet(store, "gen4/arrived", 3, QuietDetector().signal, timeout=0.05)
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and "only 2 of 3 members arrived at gen4/arrived" in message, message


def test_a_meeting_still_ends_on_the_signal_and_when_everyone_arrived() -> None:
    store, detector = LivelockStore(Clock(), superseding=True), QuietDetector()
    store.add("gen1/arrived", 1)
    meet(store, "gen1/arrived", 2, detector.signal, timeout=0.05)  # we are the last: met, no timeout
    detector.signal.set()
    with pytest.raises(GenerationAborted):
        meet(store, "gen2/arrived", 2, detector.signal, timeout=60.0)


def test_the_final_meeting_waits_for_a_slow_member_past_the_agreement_timeout(monkeypatch) -> None:
    # An arrival cannot be taken back: a worker giving up at the final meeting would restart (or fail) a job
    # that then finishes everywhere. So `finish` waits with no deadline; only the signal ends it early.
    store, detector = LivelockStore(Clock(), superseding=True), QuietDetector()
    deadlines: list[object] = []

    def recording_meet(*args, **kwargs):
        deadlines.append(kwargs.get("timeout", "the default"))
        meet(*args, **kwargs)

    monkeypatch.setattr(session_module, "meet", recording_meet)
    fake = SimpleNamespace(view=View.initial(1, 2), store=store, signal=detector.signal, agree_timeout=0.05,
                           _finals=[])
    fake.finished = lambda: session_module.FaultSession.finished(fake)
    late = threading.Timer(0.3, lambda: store.add("gen0/final", 1))  # the other member arrives after 6 timeouts
    late.start()
    session_module.FaultSession.finish(fake)  # returns once met, no MeetingTimeout
    late.join()
    assert deadlines == [None] and fake.finished()


def test_waiting_for_members_records_ends_on_the_signal_at_the_deadline_or_once_all_are_there() -> None:
    store, detector = LivelockStore(Clock(), superseding=True), QuietDetector()
    keys = ["gen3/progress/0:0", "gen3/progress/1:0"]
    store.compare_set(keys[0], "", "{}")
    with pytest.raises(MeetingTimeout) as caught:
        await_keys(store, keys, detector.signal, timeout=0.05, what="every member's record at gen3/progress")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and "1 of 2 keys missing" in message and keys[1] in message, message
    store.compare_set(keys[1], "", "{}")
    await_keys(store, keys, detector.signal, timeout=0.05, what="records")  # all there: returns
    detector.signal.set()
    with pytest.raises(GenerationAborted):
        await_keys(store, ["gen3/never"], detector.signal, timeout=60.0, what="records")


def test_timeouts_are_never_taken_for_a_failure_to_recover_from() -> None:
    # The trainer's recovery loops retry GenerationAborted and RuntimeError; a timeout is neither, so it
    # goes to the last resort (`ResilientTrainer.run`: restart from checkpoints, or exit with status 1).
    for timeout in (AgreementTimeout, MeetingTimeout):
        assert issubclass(timeout, RecoveryTimeout)
        assert not issubclass(timeout, (GenerationAborted, RuntimeError))


@pytest.mark.slow  # starts a worker process (a bare interpreter: about a second)
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_signal_stops_the_launcher_while_it_serves_the_store_to_other_hosts(monkeypatch) -> None:
    # This host runs 0:0 only; 1:0 runs elsewhere and keeps beating. Once 0:0 finished, the launcher
    # serves the store to it while it beats (up to 20 x linger s); a Ctrl-C must end that at once.
    launcher = Launcher([sys.executable, "-c", "pass"], pp=1, dp=2, workers=[Worker(0, 0)], poll=0.01,
                        linger=2.5)  # alone, it stops only after 2.5 s without a beat
    remote = launcher.address.connect()
    done, serving = threading.Event(), launch_module.serve_other_hosts

    def interrupted_serving(*args, **kwargs) -> int | None:  # the Ctrl-C comes once 0:0 is done and it serves 1:0
        os.kill(os.getpid(), signal.SIGINT)  # run's handler records it; the serving loop must see it
        return serving(*args, **kwargs)

    monkeypatch.setattr(launch_module, "serve_other_hosts", interrupted_serving)

    def other_host() -> None:  # without the signal, these beats would keep the store served 20 x linger s
        while not done.is_set():
            remote.add(Keys.heartbeat(Worker(1, 0)), 1)
            done.wait(0.01)

    beating = threading.Thread(target=other_host, daemon=True)
    beating.start()
    try:
        code = launcher.run()
    finally:
        done.set()
        beating.join()
    assert code == 128 + signal.SIGINT
    assert launcher.slots[0].returncode == 0


def test_a_timeout_before_joining_leaves_with_one_line_and_status_1(tmp_path, caplog) -> None:
    # A worker whose join timed out has no generation to restart from: it ends with one line, not a traceback
    # (and not an assertion about a view it never had), even with checkpoints configured.

    class Left(Exception):
        pass

    def leave(code: int):
        raise Left(code)

    session = SimpleNamespace(me=ME, view=None)
    with pytest.raises(Left) as left:
        LastResort(CheckpointPolicy(tmp_path), session, leave=leave).give_up(  # type: ignore[arg-type]
            AgreementTimeout("no generation admitted 0:0 within 1 s: raise the agreement timeout"))
    assert left.value.args == (1,)
    assert any("before joining the job" in r.getMessage() and "\n" not in r.getMessage() for r in caplog.records)
