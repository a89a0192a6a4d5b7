"""The launchers refuse bad arguments in one line, exit status 2, in bounded time (issue 17).

Parsing is checked in process; the cases of the issue also end to end through `python -m
schedcomp.runtime.fault.launch`, which must print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import threading

import pytest

from schedcomp.errors import RecoveryError, RuntimeSetupError, SchedcompError
from schedcomp.runtime.fault.launch import Launcher, main, parse_args
from schedcomp.runtime.fault.store import StoreAddress, serve_store
from schedcomp.runtime.launch import spawn
from schedcomp.topology import Worker

pytestmark = pytest.mark.timeout(120)

OK = ["--pp", "2", "--dp", "2"]
COMMAND = ["--", sys.executable, "-c", "pass"]


@pytest.mark.parametrize(("options", "match"), [
    (["--respawn-delay", "nan"], "--respawn-delay must be a finite number of seconds"),
    (["--respawn-delay", "inf"], "--respawn-delay must be a finite number"),
    (["--respawn-delay", "-1"], "at least 0, got -1"),
    (["--respawn-delay", "1e999"], "must be a finite number"),
    (["--store-timeout", "0"], "--store-timeout must be a finite number of seconds, at least 0.1"),
    (["--store", "foo"], "bad store address 'foo': write it as HOST:PORT"),
    (["--store", "127.0.0.1:0"], "has port 0"),
    (["--store", ":29400"], "bad store address"),
    (["--serve-store", "127.0.0.1:99999"], "with a port up to 65535"),
    (["--serve-store", "127.0.0.1:٣"], "bad store address"),  # a digit, but not an ASCII one
    (["--store", "a:1", "--serve-store", "b:2"], "not both"),
    (["--pipelines", "a"], "argument --pipelines: expected a whole number, got 'a'"),
    (["--pipelines", "2"], "pipeline 2 is outside a job with dp=2"),
    (["--pipelines", "1,1"], "pipeline 1 is named twice"),
    (["--pipelines", ","], "--pipelines names nobody"),
    (["--workers", "x"], "bad worker 'x'"),
    (["--workers", "0:2"], "worker 0:2 is outside a pp=2, dp=2 job"),
    (["--workers=-1:0"], "worker -1:0 is outside"),
    (["--workers", "0:0,0:0"], "worker 0:0 is named twice"),
    (["--workers", "0:0", "--pipelines", "0"], "--workers or --pipelines, not both"),
    (["--pp", "0"], "argument --pp: must be at least 1, got 0"),
    (["--dp", "-3"], "argument --dp: must be at least 1"),
    (["--pp", "1" * 5000], "argument --pp: expected a whole number"),
    (["--pp", "1000000"], "would start 2000000 worker processes, more than 1024"),
    (["--respawn", "-1"], "argument --respawn: must be at least 0"),
    (["--max-restarts", "two"], "argument --max-restarts: expected a whole number"),
    (["--incarnation", "1.5"], "argument --incarnation: expected a whole number"),
    (["--bind", ""], "bad host ''"),
    (["--bind", "a b"], "bad host 'a b'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_are_refused_at_parse_time_in_one_line(options: list[str], match: str) -> None:
    with pytest.raises(SchedcompError, match=match) as info:
        parse_args(["--pp", "2", "--dp", "2", *options, *COMMAND])
    assert "\n" not in str(info.value)


def test_the_limit_on_local_workers_can_be_raised_or_avoided() -> None:
    args, _ = parse_args(["--pp", "2000", "--max-local-workers", "2000", *COMMAND])
    assert len(args.workers) == 2000
    with pytest.raises(SchedcompError, match="at most 65536 worker processes fit on one host"):
        parse_args(["--pp", "10" + "0" * 30, "--max-local-workers", "10" + "0" * 30, *COMMAND])
    args, _ = parse_args(["--pp", "4", "--dp", "1000", "--pipelines", "7,3", *COMMAND])
    assert args.workers == [Worker(d, s) for d in (7, 3) for s in range(4)]  # this host's share only


def test_no_worker_command_is_refused() -> None:
    for argv in (OK, [*OK, "--"]):
        with pytest.raises(SchedcompError, match="no worker command given"):
            parse_args(argv)


def test_the_launcher_api_refuses_what_the_command_line_refuses() -> None:
    command = [sys.executable, "-c", "pass"]
    with pytest.raises(RecoveryError, match="respawn_delay must be a finite number of seconds"):
        Launcher(command, 1, 1, respawn_delay=math.nan)  # would never respawn, and never end
    with pytest.raises(RecoveryError, match="poll must be a finite number"):
        Launcher(command, 1, 1, poll=math.inf)
    with pytest.raises(RecoveryError, match="'/nonexistent/python' is not an executable file or on PATH"):
        Launcher(["/nonexistent/python"], 1, 1)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_a_store_that_never_answers_is_one_line_within_the_timeout() -> None:
    address = StoreAddress("127.0.0.1", _closed_port())
    with pytest.raises(RecoveryError, match=f"cannot reach the job's store at {address} within 0.5 s "
                                            "\\(Connection refused\\).*--store-timeout"):
        address.reach(0.5)


def test_a_launcher_may_start_before_the_store_it_joins() -> None:
    port = _closed_port()
    server: list[object] = []
    late = threading.Timer(0.3, lambda: server.append(serve_store("127.0.0.1", port)[0]))
    late.start()
    store = StoreAddress("127.0.0.1", port).reach(30.0)  # refused at first, then served
    store.set("k", "v")
    late.join()
    assert server[0].get("k") == b"v"


@pytest.mark.parametrize("argv", [
    ["--pp", "1", "--respawn-delay", "nan", *COMMAND],
    ["--pp", "1", "--store", "foo", *COMMAND],
    ["--pp", "1", "--serve-store", "127.0.0.1:99999", *COMMAND],
    ["--pp", "1", "--pipelines", "a", *COMMAND],
    ["--pp", "1", "--", "/nonexistent/worker-binary"],
    ["--pp", "1", "--store", "127.0.0.1:{closed}", "--store-timeout", "0.5", *COMMAND],
])
def test_the_launcher_exits_2_with_one_line(argv: list[str], capfd: pytest.CaptureFixture[str]) -> None:
    assert main([a.format(closed=_closed_port()) for a in argv]) == 2
    lines = capfd.readouterr().err.strip().splitlines()  # file-descriptor level: C++ output would show
    assert len(lines) == 1 and lines[0].startswith("error: "), lines


def test_the_launcher_command_exits_2_with_one_line_when_its_store_is_not_there() -> None:
    done = subprocess.run([sys.executable, "-m", "schedcomp.runtime.fault.launch", "--pp", "1", "--store",
                           f"127.0.0.1:{_closed_port()}", "--store-timeout", "0.5", *COMMAND],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 2
    assert done.stderr.startswith("error: cannot reach the job's store") and done.stderr.count("\n") == 1, done.stderr


def test_spawn_refuses_settings_that_would_never_end() -> None:
    with pytest.raises(RuntimeSetupError, match="timeout must be a finite number"):
        spawn(print, 2, timeout=math.nan)
    with pytest.raises(RuntimeSetupError, match="nprocs must be a positive whole number"):
        spawn(print, 0)
    with pytest.raises(RuntimeSetupError, match="threads must be a positive whole number"):
        spawn(print, 1, threads=0)
