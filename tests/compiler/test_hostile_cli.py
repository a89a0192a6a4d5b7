"""Issue 17 regressions, command line: every bad input is one line and exit 2, work is bounded, writes
are atomic, JSON output is valid. Each test names the issue's case it pins down."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from hostile_helpers import assert_refused, cli, snapshot, strict_json

from schedcomp.cli.common import print_json
from schedcomp.errors import SchedcompError

COSTS = {"forward": [1, 1], "backward_input": [1, 1], "backward_weight": [1, 1]}


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _costs(work: Path, text: str | bytes, name: str = "costs.json") -> str:
    path = work / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def test_unknown_subcommand_names_the_program_once():
    assert_refused(cli("bogus"), "invalid choice: 'bogus'")
    assert_refused(cli("compile", "--pp", "x", "-m", "1"), "compile: argument --pp")


@pytest.mark.parametrize(("argv", "limit"), [
    (["compile", "--pp", "2", "--dp", "1000000", "-m", "2"], "SCHEDCOMP_MAX_WORKERS"),
    (["show", "--schedule", "1f1b", "--pp", "2", "-m", "1000000000"], "SCHEDCOMP_MAX_MICROBATCHES"),
    (["show", "--schedule", "1f1b", "--pp", "64", "--dp", "64", "-m", "4096"], "SCHEDCOMP_MAX_SLOTS"),
    (["show", "--schedule", "1f1b", "--pp", "2", "-m", "2", "--iterations", "100000000"], "SCHEDCOMP_MAX_ITERATIONS"),
    (["precompile", "--pp", "8", "--dp", "16", "-m", "2", "-k", "1000000", "-o", "cache", "-q"],
     "SCHEDCOMP_MAX_SCENARIOS"),
])
def test_oversized_jobs_are_refused_at_once_naming_the_limit(work, argv, limit):
    assert_refused(cli(*argv), limit)
    assert not (work / "cache" / "index.json").exists()


def test_a_limit_is_raised_by_its_environment_variable(work, monkeypatch):
    monkeypatch.setenv("SCHEDCOMP_MAX_MICROBATCHES", "8")
    assert_refused(cli("show", "--schedule", "1f1b", "--pp", "2", "-m", "9", "--json"), "over the limit of 8")
    monkeypatch.setenv("SCHEDCOMP_MAX_MICROBATCHES", "9")
    assert cli("show", "--schedule", "1f1b", "--pp", "2", "-m", "9", "--json").code == 0
    monkeypatch.setenv("SCHEDCOMP_MAX_MICROBATCHES", "lots")
    assert_refused(cli("show", "--schedule", "1f1b", "--pp", "2", "-m", "9"), "SCHEDCOMP_MAX_MICROBATCHES='lots'")


def test_precompile_with_a_huge_k_covers_every_recoverable_scenario(work):
    run = cli("precompile", "--pp", "2", "--dp", "2", "-m", "2", "-k", "1000000", "-o", "cache", "-q")
    assert run.code == 0, run.err
    assert len(json.loads((work / "cache" / "index.json").read_text())["scenarios"]) == 5  # every orbit of 2x2


def test_import_torch_with_a_huge_dp_is_refused(work):
    (work / "s.csv").write_text("0F0,0B0\n1F0,1B0\n")
    assert_refused(cli("import-torch", "s.csv", "--dp", "100000000"), "200,000,000 workers")


def test_a_small_plan_declaring_a_billion_pipelines_is_refused(work):
    assert cli("compile", "--pp", "2", "-m", "2", "--schedule", "1f1b", "-o", "p.json").code == 0
    text = (work / "p.json").read_text().replace('"dp": 1,', '"dp": 1000000000,')
    (work / "p9.json").write_text(text)
    assert len(text) < 2000
    assert_refused(cli("show", "p9.json"), "2,000,000,000 workers", "SCHEDCOMP_MAX_WORKERS")


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null", "."])
def test_show_of_a_device_or_directory_is_refused(path):
    assert_refused(cli("show", path), path)


def test_show_of_a_fifo_does_not_wait_for_a_writer(work):
    os.mkfifo(work / "fifo")
    assert_refused(cli("show", "fifo"), "not a regular file")


def test_a_file_over_the_size_limit_is_refused_unread(work, monkeypatch):
    assert cli("compile", "--pp", "2", "-m", "2", "--schedule", "1f1b", "-o", "p.json").code == 0
    monkeypatch.setenv("SCHEDCOMP_MAX_FILE_BYTES", "100")
    assert_refused(cli("show", "p.json"), "p.json", "SCHEDCOMP_MAX_FILE_BYTES")


@pytest.mark.parametrize(("content", "says"), [
    (json.dumps(COSTS).encode("utf-16"), "not UTF-8"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
    (b"[" * 100_000, "levels deep"),
    (json.dumps({**COSTS, "forward": [1e308, 1]}).encode(), "from 0 to 1e+15"),
    (json.dumps({**COSTS, "forward": [1, 1]}).replace("[1, 1]", "[1e400, 1]", 1).encode(), "too large"),
    (json.dumps({**COSTS, "forward": [1, 1]}).replace("[1, 1]", "[Infinity, 1]", 1).encode(), "Infinity"),
    (json.dumps({**COSTS, "forward": [1, 1]}).replace("[1, 1]", "[NaN, 1]", 1).encode(), "NaN"),
    (json.dumps({**COSTS, "forward": [1, 1]}).replace("[1, 1]", "[" + "9" * 401 + ", 1]", 1).encode(), "401 digits"),
    (json.dumps({**COSTS, "speed": {"0:0": 1e-320}}).encode(), "speed factor for 0:0"),
    (json.dumps({**COSTS, "speed": {"5:0": 0.5}}).encode(), "outside the job"),
    (json.dumps({**COSTS, "speed": [1]}).encode(), "speed must be an object"),
])
@pytest.mark.parametrize("command", ["compile", "precompile"])
def test_bad_cost_files_are_one_line(work, content, says, command):
    extra = ["-k", "1", "-o", "cache", "-q"] if command == "precompile" else ["--json"]
    costs = _costs(work, content)
    before = snapshot(work)
    assert_refused(cli(command, "--pp", "2", "--dp", "2", "-m", "2", "--costs", costs, *extra), says)
    assert snapshot(work) == before  # nothing written


def test_huge_costs_no_longer_overflow_the_solvers(work):
    """1e15 is the largest cost: cpsat._scale and greedy_tables.default_windows stay finite with it."""
    big = _costs(work, json.dumps({**COSTS, "forward": [1e15, 1]}))
    for solver in ("greedy", "cpsat"):
        run = cli("compile", "--pp", "2", "--dp", "2", "-m", "2", "--fail", "1:1", "--costs", big, "--solver",
                  solver, "--time-limit", "5", "--json")
        assert run.code == 0, run.err
        assert strict_json(run.out)["period"] >= 1e15


def test_import_torch_of_a_csv_missing_a_backward_is_one_line(work):
    (work / "s.csv").write_text("0F0,0B0\n1F0\n")  # stage 1 never sends stage 0 its gradient (was a KeyError)
    assert_refused(cli("import-torch", "s.csv"), "0:0 runs BW0.0 of stage 0")


def test_a_4300_digit_number_in_a_plan_or_csv_is_one_line(work):
    assert cli("compile", "--pp", "2", "-m", "2", "--schedule", "1f1b", "-o", "p.json").code == 0
    text = (work / "p.json").read_text()
    (work / "digits.json").write_text(text.replace("F0.0", "F" + "7" * 4300 + ".0", 1))
    assert_refused(cli("show", "digits.json"), "digits.json")
    (work / "s.csv").write_text("0F" + "7" * 4300 + ",0B0\n")
    assert_refused(cli("import-torch", "s.csv"), "s.csv")
    (work / "s2.csv").write_text("7" * 4300 + "F0\n")
    assert_refused(cli("import-torch", "s2.csv"), "s2.csv")


def _trace(work: Path) -> dict:
    assert cli("show", "--schedule", "1f1b", "--pp", "2", "-m", "2", "--trace", "t.json", "--json").code == 0
    return json.loads((work / "t.json").read_text())


def test_profile_reads_a_json_array_trace(work):
    (work / "array.json").write_text(json.dumps(_trace(work)["traceEvents"]))
    run = cli("profile", "array.json")
    assert run.code == 0, run.err
    assert strict_json(run.out)["forward"] == [1000.0, 1000.0]  # unit spans, read as seconds, in ms


@pytest.mark.parametrize("command", ["profile", "show"])
def test_a_trace_at_iteration_10_to_the_18_is_refused(work, command):
    data = _trace(work)
    next(e for e in data["traceEvents"] if e["ph"] == "X")["args"]["iteration"] = 10**18
    (work / "far.json").write_text(json.dumps(data))
    argv = ["profile", "far.json"] if command == "profile" else [
        "show", "--schedule", "1f1b", "--pp", "2", "-m", "2", "--measured", "far.json"]
    assert_refused(cli(*argv), "far.json", "SCHEDCOMP_MAX_ITERATIONS")


def test_compile_output_is_atomic_on_a_full_disk(work, monkeypatch):
    assert cli("compile", "--pp", "2", "-m", "2", "--schedule", "1f1b", "-o", "plan.json").code == 0
    before = snapshot(work)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert_refused(cli("compile", "--pp", "2", "-m", "4", "--schedule", "1f1b", "-o", "plan.json"),
                   "plan.json", "No space left", "unchanged")
    assert snapshot(work) == before  # the old plan whole, no temporary file left


def test_precompile_on_a_full_disk_leaves_no_empty_index(work, monkeypatch):
    assert cli("precompile", "--pp", "2", "--dp", "2", "-m", "2", "-k", "1", "-o", "cache", "-q").code == 0
    before = snapshot(work)
    real = os.fsync
    calls = []

    def full_at_index(fd: int) -> None:  # the plans fit, the index does not
        calls.append(fd)
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(".index.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", full_at_index)
    assert_refused(cli("precompile", "--pp", "2", "--dp", "2", "-m", "2", "-k", "1", "-o", "cache", "-q", "-j", "1"),
                   "index.json", "No space left")
    assert calls
    assert (work / "cache" / "index.json").read_bytes() == before["cache/index.json"][1]
    assert not [p for p in (work / "cache").iterdir() if p.name.endswith(".tmp")]


def test_json_output_is_always_valid_json(work):
    for argv in (["compile", "--pp", "2", "--dp", "2", "-m", "2", "--fail", "1:1", "--json"],
                 ["show", "--schedule", "zb-h1", "--pp", "3", "-m", "6", "--json"],
                 ["compare", "--pp", "2", "--dp", "2", "-m", "2", "--fail", "1:0", "--json"]):
        run = cli(*argv)
        assert run.code == 0, run.err
        strict_json(run.out)
    with pytest.raises(SchedcompError, match="Out of range float"):
        print_json({"period": float("nan")})


def test_output_to_a_device_or_fifo_is_written_in_place_never_replaced(work):
    """Renaming over a non-regular file would replace it (`-o /dev/full` once replaced the device): a device
    or a FIFO is written in place (`-o /dev/null`, `-o /dev/stdout | jq`), a FIFO nobody reads is refused at
    once instead of hanging, and a directory is refused."""
    import stat
    import threading

    compile_to = ("compile", "--pp", "2", "-m", "2", "--schedule", "1f1b", "-o")
    os.mkfifo(work / "fifo")
    (work / "dir").mkdir()
    assert_refused(cli(*compile_to, "dir"), "dir", "not a regular file")
    assert_refused(cli(*compile_to, "fifo"), "fifo", "nobody is reading that FIFO")
    assert_refused(cli(*compile_to, "/dev/full"), "/dev/full", "No space left on device")
    assert cli(*compile_to, "/dev/null").code == 0
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append((work / "fifo").read_bytes()))
    reader.start()
    while not got and reader.is_alive():  # the writer may only open once the reader has
        if cli(*compile_to, "fifo").code == 0:
            break
    reader.join(timeout=30)
    assert json.loads(got[0])["microbatches"] == 2
    assert stat.S_ISFIFO(os.stat(work / "fifo").st_mode) and (work / "dir").is_dir()
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_output_through_a_symlink_replaces_its_target_not_the_link(work):
    (work / "real.json").write_text("old")
    (work / "link.json").symlink_to("real.json")
    assert cli("compile", "--pp", "2", "-m", "2", "--schedule", "1f1b", "-o", "link.json").code == 0
    assert (work / "link.json").is_symlink() and json.loads((work / "real.json").read_text())["microbatches"] == 2
