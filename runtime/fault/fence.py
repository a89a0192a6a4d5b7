"""Fencing: a worker cut off from the job's store stops itself instead of training on alone.

The survivors declare a worker failed when its heartbeat counter in the store has not moved for
`detection_time` (`membership.FailureDetector`). The mirror image, on the worker's side: when
this worker has had no answer from the store for `detection_time`, the others have declared it
failed, or are about to, and re-planned without it. Whatever it computes from now on belongs to
a generation nobody else runs, and once the network heals it could feed stale tensors to
groups the survivors still hold. So it stops: the `Fence` watchdog logs one line saying why and
ends the process with `FENCED_EXIT`.

It ends the process with `os._exit`, not an exception: on a cut network the main thread is
typically blocked inside a store call or a gloo wait that nothing interrupts, and a normal
interpreter exit with daemon threads inside C++ calls aborts anyway. The launcher on the
worker's host sees the exit status and knows the host lost the store (see `launch`).

The worker's "contact" with the store is its failure detector's poll: one `add` every `poll`
seconds on its own client, which is what the detector does anyway, so fencing costs nothing
on a healthy network.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

FENCED_EXIT = 75  # exit status of a worker that fenced itself (EX_TEMPFAIL: a replacement may rejoin)
WORKER_FENCED = ("the others have declared this worker failed by now (the limit is their detection time), so it "
                 "stops here instead of training on alone; a replacement started by its launcher rejoins")


def exit_fenced(message: str) -> None:
    """The default action: say why on stderr (logging's last resort handler if none is set up) and exit."""
    log.critical("%s", message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(FENCED_EXIT)


class Fence:
    """Calls `action` once when no `contact()` came for `limit` seconds (by this host's clock).

    Checked `checks` times per `limit`, so it fires between `limit` and `limit * (1 + 1/checks)`
    after the last contact. `clock` measures the silence (tests pass one they advance by hand, so
    what they prove does not depend on how fast a loaded machine schedules their threads).
    """

    def __init__(self, limit: float, what: str, consequence: str = WORKER_FENCED,
                 action: Callable[[str], None] = exit_fenced, checks: int = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if limit <= 0:
            raise ValueError(f"a fence needs a positive limit, got {limit}")
        self.limit, self.what, self.consequence, self.action, self.checks = limit, what, consequence, action, checks
        self.clock = clock
        self._last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def contact(self) -> None:
        """The store answered just now."""
        self._last = self.clock()  # a float store is atomic under the GIL: no lock needed

    def start(self) -> Fence:
        self._last = self.clock()
        self._thread = threading.Thread(target=self._run, name="schedcomp-fence", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.limit / self.checks):
            silent = self.clock() - self._last
            if silent > self.limit:
                self.action(f"{self.what}: no answer from the job's store for {silent:.1f} s (limit {self.limit:g} s): "
                            f"{self.consequence}")
                return
