"""Fuzzing the launcher's argument space (issue 17), in process and parse only.

`parse_args` must either return a job that can start (a worker command, every count in range,
finite delays, this host's workers inside the job, none twice, at most --max-local-workers) or
raise one line of SchedcompError; `--help` may exit 0. Never another exception, never a hang (the
suite's pytest-timeout ends a test that hangs; a per-example deadline would be a timed assertion that
fails on a loaded machine). `pytest --hypothesis-show-statistics` prints the example counts.
"""

from __future__ import annotations

import contextlib
import io
import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from schedcomp.errors import SchedcompError
from schedcomp.runtime.fault.launch import parse_args

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

OPTIONS = ["--pp", "--dp", "--workers", "--pipelines", "--store", "--serve-store", "--store-timeout", "--bind",
           "--respawn", "--respawn-delay", "--max-restarts", "--incarnation", "--max-local-workers", "--no-fence",
           "-v", "--help", "--st", "--pp=2", "--workers=-1:0"]
VALUES = st.one_of(
    st.sampled_from(["0", "1", "2", "3", "-1", "1.5", "nan", "inf", "-inf", "1e999", "1e-320", "99999999999999999999",
                     "1" * 5000, "", " ", "a", "٣", "0x10", "1_000", "127.0.0.1:29400", "127.0.0.1:0",
                     "127.0.0.1:99999", "foo", ":1", "[::1]:80", "::1:80", "a:b", "0:0", "0:0,0:1", "1:1,0:0",
                     "0:0,0:0", "0,1", "1,1", "0,", ",", "5", "9:9", "a b", "\x00", "x" * 300]),
    st.text(max_size=12))
TOKENS = st.lists(st.one_of(st.sampled_from(OPTIONS), VALUES), max_size=10)
COMMANDS = st.sampled_from([[], ["--"], ["--", "python", "train.py"], ["--", "x", "--pp", "9"]])


def _check_job(argv: list[str]) -> str:
    """Parse `argv`; assert the outcome is one of the allowed ones; return which."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            args, command = parse_args(argv)
    except SchedcompError as e:
        assert "\n" not in str(e) and str(e), repr(str(e))
        return "refused"
    except SystemExit as e:
        assert e.code == 0 and "usage:" in out.getvalue(), e.code  # --help
        return "help"
    assert command and args.pp >= 1 and args.dp >= 1
    assert min(args.respawn, args.max_restarts, args.incarnation) >= 0
    assert math.isfinite(args.respawn_delay) and args.respawn_delay >= 0
    assert math.isfinite(args.store_timeout) and args.store_timeout > 0
    assert args.store is None or args.serve_store is None
    assert args.store is None or 0 < args.store.port <= 65535
    assert args.serve_store is None or 0 <= args.serve_store.port <= 65535
    assert len(set(args.workers)) == len(args.workers) <= args.max_local_workers and args.workers
    assert all(0 <= w.pipeline < args.dp and 0 <= w.stage < args.pp for w in args.workers)
    return "accepted"


@FUZZ
@given(tokens=TOKENS, command=COMMANDS)
def test_fuzz_launcher_arguments(tokens: list[str], command: list[str]) -> None:
    event(_check_job(tokens + command))


# Plausible values per option, drawn half of the time, so that many examples get past the
# per-value checks to the checks across options (and some are accepted).
PLAUSIBLE = {"--pp": ["1", "2", "4"], "--dp": ["1", "2", "3"], "--workers": ["0:0", "0:1,1:0", "1:1", "0:0,0:0"],
             "--pipelines": ["0", "1", "0,1", "2"], "--store": ["127.0.0.1:29400", "h:1"],
             "--serve-store": ["127.0.0.1:0", "0.0.0.0:29400"], "--store-timeout": ["0.5", "30"],
             "--bind": ["127.0.0.1", "10.0.0.2"], "--respawn": ["0", "2"], "--respawn-delay": ["0", "0.5"],
             "--max-restarts": ["0", "3"], "--incarnation": ["0", "1"], "--max-local-workers": ["1", "4", "64"]}
PAIRS = st.sampled_from(sorted(PLAUSIBLE)).flatmap(
    lambda option: st.tuples(st.just(option), st.one_of(st.sampled_from(PLAUSIBLE[option]), VALUES)))


@FUZZ
@given(options=st.lists(PAIRS, max_size=4), pp=st.one_of(st.sampled_from(PLAUSIBLE["--pp"]), VALUES))
def test_fuzz_launcher_option_values(options: list[tuple[str, str]], pp: str) -> None:
    """Well-formed option/value pairs, so that most examples reach the checks across options."""
    argv = ["--pp", pp] + [token for pair in options for token in pair] + ["--", "python", "train.py"]
    event(_check_job(argv))
