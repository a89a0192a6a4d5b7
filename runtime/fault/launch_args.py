"""The launcher's command line, checked whole at parse time: a bad argument is one line, exit status 2.

Every value is checked by its argparse type (a number that is finite and in range, an address
with a port in 1..65535, workers and pipelines inside the job) and the combination by
`_check_together` (one store option, one way to name this host's workers, no worker twice, a
worker command after `--`), before anything listens, connects or starts. How many worker
processes one launcher may start is bounded (`--max-local-workers`), so `--pp 1000000` is a
quick refusal instead of a million processes.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from schedcomp.cli.common import ArgumentError, Parser
from schedcomp.errors import RecoveryError, SchedcompError
from schedcomp.runtime.fault.store import LOOPBACK, StoreAddress
from schedcomp.runtime.fault.zygote import python_target
from schedcomp.topology import Worker

PROG = "python -m schedcomp.runtime.fault.launch"
MAX_LOCAL_WORKERS = 1024  # worker processes one launcher starts; raise it with --max-local-workers
HOST_PROCESS_LIMIT = 1 << 16  # ... up to this: the workers are listed before they start, one process each
DEFAULT_STORE_TIMEOUT = 30.0  # seconds to wait for another launcher's store to answer (--store-timeout)

T = TypeVar("T")


def count(text: str, least: int = 0) -> int:
    """A whole number >= `least` (a count of workers, restarts, replacements...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive(text: str) -> int:
    return count(text, least=1)


def local_limit(text: str) -> int:
    value = positive(text)
    if value > HOST_PROCESS_LIMIT:
        raise argparse.ArgumentTypeError(f"at most {HOST_PROCESS_LIMIT} worker processes fit on one host, "
                                         f"got {value}")
    return value


def seconds(value: float | str, what: str = "a duration", least: float = 0.0,
            error: type[SchedcompError] = RecoveryError) -> float:
    """A finite number of seconds >= `least` (NaN never compares true: a NaN delay would never expire)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise error(f"{what} must be a number of seconds, got {str(value)[:40]!r}") from None
    if not math.isfinite(number) or number < least:
        raise error(f"{what} must be a finite number of seconds, at least {least:g}, got {str(value)[:40]}")
    return number


def _arg(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser raising our errors (argparse turns only its own into messages)."""
    def convert(text: str) -> T:
        try:
            return parse(text)
        except SchedcompError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _address(text: str, any_port: bool) -> StoreAddress:
    address = StoreAddress.parse(text)
    if address.port == 0 and not any_port:
        raise ArgumentError(f"store address {text!r} has port 0: give the port the store listens on")
    return address


def _host(text: str) -> str:
    if not text or text != text.strip() or any(c.isspace() or not c.isprintable() for c in text) or len(text) > 253:
        raise ArgumentError(f"bad host {text[:40]!r}: give an address such as {LOOPBACK} or a host name")
    return text


def _workers(text: str) -> list[Worker]:
    return [Worker.parse(w) for w in text.split(",") if w.strip()]


def _modules(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ArgumentError(f"--preload: {name[:60]!r} is not a module name: "
                                "give names such as torch,schedcomp.runtime")
    return names


def _pipelines(text: str) -> list[int]:
    return [count(d.strip()) for d in text.split(",") if d.strip()]


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Start a resilient job: one process per worker; survivors live on.")
    p.add_argument("--pp", type=positive, required=True, help="pipeline stages")
    p.add_argument("--dp", type=positive, default=1, help="data-parallel pipelines")
    p.add_argument("--workers", type=_arg(_workers), help="the workers this host runs, e.g. 0:0,0:1 (default: all)")
    p.add_argument("--pipelines", type=_pipelines, help="run every stage of these pipelines here, e.g. 0,1")
    p.add_argument("--store", type=_arg(lambda t: _address(t, any_port=False)),
                   help="HOST:PORT of a store another launcher serves")
    p.add_argument("--serve-store", type=_arg(lambda t: _address(t, any_port=True)),
                   help=f"serve the job's store on HOST:PORT (default: {LOOPBACK} on a free port)")
    p.add_argument("--store-timeout", type=_arg(lambda t: seconds(t, "--store-timeout", least=0.1)),
                   default=DEFAULT_STORE_TIMEOUT,
                   help=f"seconds to wait for the store of --store to answer at start; later, seconds without "
                        f"an answer before this host counts itself cut off: it stops its workers and exits 75 "
                        f"(default {DEFAULT_STORE_TIMEOUT:g})")
    p.add_argument("--bind", type=_arg(_host), default=LOOPBACK, help="address this host's workers listen on")
    p.add_argument("--respawn", type=count, default=0, help="replacements per worker (default 0)")
    p.add_argument("--respawn-delay", type=_arg(lambda t: seconds(t, "--respawn-delay")), default=0.0,
                   help="seconds before starting a replacement")
    p.add_argument("--max-restarts", type=count, default=3,
                   help="restarts of the whole job from its latest checkpoint when a stage is lost (default 3)")
    p.add_argument("--incarnation", type=count, default=0, help="first incarnation (1+: these are replacements)")
    p.add_argument("--max-local-workers", type=local_limit, default=MAX_LOCAL_WORKERS,
                   help=f"refuse to start more worker processes than this here (default {MAX_LOCAL_WORKERS})")
    p.add_argument("--no-fence", action="store_true", help="do not kill workers the others declared failed")
    p.add_argument("--preload", type=_arg(_modules), default=[],
                   help="import these modules once (e.g. torch,schedcomp.runtime) and fork Python workers from "
                        "that process instead of starting each interpreter afresh (see runtime/fault/zygote.py)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options and the worker command (after `--`); ArgumentError (one line) if bad.

    Pure: nothing listens, connects, starts or touches the file system. `args.workers` is the list
    of workers this host runs (all of the job's by default).
    """
    argv = [str(a) for a in argv]
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    options = argv[: argv.index("--")] if "--" in argv else argv
    args = _parser().parse_args(options)
    args.workers = _check_together(args, command)
    return args, command


def _check_together(args: argparse.Namespace, command: list[str]) -> list[Worker]:
    """Checks across options; returns the workers this launcher starts."""
    def fail(message: str) -> ArgumentError:
        return ArgumentError(f"{PROG}: {message}")

    if not command:
        raise fail("no worker command given: put it after `--`, e.g. -- python train.py")
    if args.preload and python_target(command) is None:
        raise fail("--preload forks Python workers: the worker command must be this interpreter "
                   f"({sys.executable}) with a script or -m module")
    if args.store is not None and args.serve_store is not None:
        raise fail("give --store (join a store) or --serve-store (serve it), not both")
    if args.workers is not None and args.pipelines is not None:
        raise fail("give --workers or --pipelines, not both")
    pp, dp = args.pp, args.dp
    named: list[Any] = args.workers if args.workers is not None else args.pipelines
    if named is not None and not named:
        raise fail(f"--{'workers' if args.workers is not None else 'pipelines'} names nobody")
    if named is not None and len(set(named)) != len(named):
        raise fail(f"{_first_repeat(named)} is named twice: each worker runs in one process")
    for d in args.pipelines or ():
        if d >= dp:
            raise fail(f"pipeline {d} is outside a job with dp={dp}: pipelines are 0..{dp - 1}")
    for w in args.workers or ():
        if not (0 <= w.pipeline < dp and 0 <= w.stage < pp):
            raise fail(f"worker {w} is outside a pp={pp}, dp={dp} job: pipelines 0..{dp - 1}, stages 0..{pp - 1}")
    local = len(args.workers) if args.workers is not None else pp * len(args.pipelines or range(dp))
    if local > args.max_local_workers:
        raise fail(f"this launcher would start {local} worker processes, more than {args.max_local_workers}: "
                   "name this host's share with --workers or --pipelines, or raise --max-local-workers")
    if args.workers is not None:
        return args.workers
    return [Worker(d, s) for d in (args.pipelines if args.pipelines is not None else range(dp)) for s in range(pp)]


def _first_repeat(items: list[Any]) -> str:
    seen: set[Any] = set()
    for x in items:
        if x in seen:
            return f"{'worker' if isinstance(x, Worker) else 'pipeline'} {x}"
        seen.add(x)
    return ""
