"""Start Python workers by forking one process that has already imported torch (`launch --preload`).

Every worker of a job, and every replacement, pays for `import torch` (about 2 s of CPU) before
it can do anything; on a small machine running many workers that is most of a short job, and for
a replacement it is time the survivors wait. With `--preload torch,schedcomp.runtime` the launcher
starts one *zygote* (`python -m schedcomp.runtime.fault.zygote`) that imports those modules once
and then forks a worker per request: the worker runs its script (`python script.py ...` or
`python -m module ...`) as the interpreter would, with its own environment, `sys.argv` and
`sys.path[0]`, and ends as a forked `multiprocessing` child does (`become`).

Why a separate process rather than forking the launcher: the launcher runs threads (the store's
server, its fence) and a fork copies only the forking thread, with whatever locks the others held;
the zygote forks while single-threaded, right after its imports. Why a double fork: the worker must
be the launcher's child so that the launcher can wait for it, see its exit status or the signal
that killed it, and kill it, exactly as with a process it started itself. The zygote forks a
short-lived middle process, which forks the worker and exits; the worker is re-parented to the
launcher, which made itself a child subreaper (Linux `prctl(PR_SET_CHILD_SUBREAPER)`).

The preloaded modules must not read a worker's environment at import time: they are imported
once, before any worker's environment exists (torch reads its thread and device settings when
first used, not when imported). `TORCH_LAZY`, preloaded with torch, does read a few debugging
switches at import (`TORCHDYNAMO_*` translation validation and extended debug, sympy's
`SYMPY_GROUND_TYPES`): a worker sees the launcher's values of those (the fault launcher passes its
own environment on, so they agree), not ones set for it alone.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from schedcomp.errors import RecoveryError

_PR_SET_CHILD_SUBREAPER = 36
# What torch imports on first use rather than with `import torch`, that every training worker
# uses: preloaded along with torch. `torch.autograd.backward` with gradients (every pipeline stage
# but the last) imports symbolic_shapes and sympy, ~0.5 s of CPU per worker otherwise.
TORCH_LAZY = ("torch.fx.experimental.symbolic_shapes",)


@dataclass(frozen=True)
class Request:
    """One worker to start: what to run (`script` or `module`), its arguments and environment."""

    script: str | None
    module: str | None
    args: list[str]
    env: dict[str, str]


def python_target(command: Sequence[str]) -> tuple[str | None, str | None, list[str]] | None:
    """(script, module, args) when `command` runs this interpreter on a script or a module, else None."""
    if len(command) < 2 or os.path.realpath(command[0]) != os.path.realpath(sys.executable):
        return None
    if command[1] == "-m" and len(command) > 2:
        return None, command[2], list(command[3:])
    if command[1].startswith("-"):  # interpreter options: only a real interpreter honours them
        return None
    return command[1], None, list(command[2:])


class ForkedProcess:
    """A worker started by the zygote, seen by the launcher as a `subprocess.Popen` (the calls it uses)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # the subreaper should have made it ours
                raise RecoveryError(f"worker process {self.pid} is not the launcher's child: "
                                    "launch without --preload") from None
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N for signal N, as Popen
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a pid that was reaped (it may be reused)
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The launcher's side: start the zygote with `modules` imported; `spawn` forks a worker from it."""

    def __init__(self, modules: Sequence[str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise RecoveryError(f"--preload needs Linux's child subreapers (prctl failed: "
                                f"{os.strerror(ctypes.get_errno())}): launch without --preload")
        request_r, self._requests = os.pipe()
        self._replies, reply_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-m", "schedcomp.runtime.fault.zygote", str(request_r),
                                      str(reply_w), ",".join(modules)], pass_fds=(request_r, reply_w))
        os.close(request_r)
        os.close(reply_w)
        self._reader = os.fdopen(self._replies, "r")

    def spawn(self, command: Sequence[str], env: dict[str, str]) -> ForkedProcess:
        target = python_target(command)
        assert target is not None, command
        line = json.dumps(asdict(Request(*target, env))) + "\n"
        os.write(self._requests, line.encode())
        pid = self._reader.readline().strip()
        done = self._reader.readline().strip()  # the zygote reaped the middle process: the worker is ours
        if not pid or done != "ok":
            code = self.proc.poll()
            raise RecoveryError(f"the preloading zygote did not start a worker (it exited with {code}; see its "
                                "error above): launch without --preload, or preload fewer modules")
        return ForkedProcess(int(pid))

    def close(self) -> None:
        os.close(self._requests)  # the zygote exits at the end of its requests
        self._reader.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- the zygote's side --------------------------------------------------------------------------


def serve(requests: int, replies: int) -> Request:
    """Fork a worker per request; returns only in a worker (the zygote itself exits when the launcher closes)."""
    reader = os.fdopen(requests, "r")
    while line := reader.readline():
        request = Request(**json.loads(line))
        middle = os.fork()
        if middle == 0:
            worker = os.fork()
            if worker == 0:
                reader.close()
                os.close(replies)
                return request
            os.write(replies, f"{worker}\n".encode())
            os._exit(0)
        os.waitpid(middle, 0)  # once it is gone, the worker is the launcher's (the subreaper's) child
        os.write(replies, b"ok\n")
    # The zygote holds nothing to save: skip the interpreter's teardown of torch (seconds of CPU
    # that the launcher, closing us, would wait for while the job is over).
    flush_streams()
    os._exit(0)


def flush_streams() -> None:
    """Flush stdout and stderr, as the interpreter would at exit, before an `os._exit`."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to flush
            stream.flush()


def preload(modules: Sequence[str]) -> None:
    """Import `modules` (and, with torch, what torch would import lazily in every worker: `TORCH_LAZY`)."""
    for name in filter(None, modules):
        importlib.import_module(name)
    if "torch" in sys.modules:
        for name in TORCH_LAZY:
            importlib.import_module(name)


def take_over(env: dict[str, str], cwd: str | None = None) -> None:
    """Make a forked process start as a fresh interpreter would: with `env` (and `cwd`) and a fresh random
    seed, not the state of the process it was forked from (this zygote, or a multiprocessing fork server)."""
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    random.seed()


def become(request: Request) -> int:
    """Turn this forked process into the worker `request` describes and run it; its exit status.

    Started as the interpreter would start it; it ends as a forked `multiprocessing` child does:
    non-daemon threads joined, `atexit` handlers run, streams flushed, then `os._exit`. Not through
    the interpreter's own shutdown: that would tear down every module the zygote imported, touching
    (and so copying) each page the worker shares with it, seconds of CPU per worker.
    """
    take_over(request.env)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the zygote ignores ^C; a worker takes it as usual
    code = 0
    try:
        if request.module is not None:
            sys.argv = [request.module, *request.args]
            sys.path[0] = os.getcwd()
            runpy.run_module(request.module, run_name="__main__", alter_sys=True)
        else:
            assert request.script is not None
            sys.argv = [request.script, *request.args]
            sys.path[0] = os.path.dirname(os.path.abspath(request.script))
            runpy.run_path(request.script, run_name="__main__")
    except SystemExit as e:  # as the interpreter reads it: None is 0, a number is the status, else print it
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # the interpreter then dies by SIGINT itself, so its parent sees the signal
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter (and multiprocessing) do
        atexit._run_exitfuncs()
        flush_streams()
    return code


if __name__ == "__main__":
    # ^C in a terminal reaches the whole process group: the launcher stops the workers, and the
    # zygote ends when the launcher closes its requests (not with a KeyboardInterrupt traceback)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _requests, _replies, _modules = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    preload(_modules.split(","))
    _code = become(serve(_requests, _replies))
    if _code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(_code)
