"""Atomic writes and bounded reads: the old file survives a failed write; hostile files are one clear error."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from schedcomp.errors import PlanFormatError, SchedcompError
from schedcomp.fileio import dumps_json, load_json, read_bytes, read_text, write_atomic


def test_write_atomic_replaces_and_keeps_permissions(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text("old")
    target.chmod(0o640)
    write_atomic(target, "new")
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary left behind


def test_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "plan.json"
    target.write_text("valid")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(PlanFormatError, match=r"cannot write .*plan\.json: No space left on device"):
        write_atomic(target, "x" * 4096, PlanFormatError)
    assert target.read_text() == "valid"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_write_into_a_missing_directory_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(SchedcompError, match=r"cannot write .*nope/plan\.json"):
        write_atomic(tmp_path / "nope" / "plan.json", "x")


def test_reads_are_bounded(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b"x" * 100)
    with pytest.raises(SchedcompError, match="100 bytes, over the limit of 10"):
        read_bytes(big, "plan", limit=10)
    with pytest.raises(SchedcompError, match="not a regular file"):
        read_bytes("/dev/zero", "plan")
    with pytest.raises(SchedcompError, match=r"cannot read plan .*missing"):
        read_bytes(tmp_path / "missing", "plan")
    utf16 = tmp_path / "costs.json"
    utf16.write_text("{}", encoding="utf-16")
    with pytest.raises(SchedcompError, match="not UTF-8"):
        read_text(utf16, "cost model")


def test_json_is_bounded_and_always_valid() -> None:
    with pytest.raises(SchedcompError, match="nests 100 levels"):
        load_json("[" * 100 + "]" * 100, "plan")
    assert load_json('["[[[["]', "plan") == ["[[[["]  # brackets inside strings do not count
    with pytest.raises(SchedcompError, match="NaN"):
        load_json('{"f": NaN}', "costs")
    with pytest.raises(SchedcompError, match="too large"):
        load_json("1" * 401, "costs")
    with pytest.raises(SchedcompError, match="not valid JSON"):
        load_json("{", "costs")
    with pytest.raises(SchedcompError, match="Out of range float values"):
        dumps_json({"period": float("inf")})
    assert dumps_json({"a": 1}) == '{"a": 1}'


def test_write_atomic_writes_text_in_pieces(tmp_path: Path) -> None:
    """A text given in pieces (a large plan's JSON, `serialize.plan_json_pieces`) is written whole; a piece that
    fails half-way leaves the old file and no temporary file."""
    path = tmp_path / "plan.json"
    write_atomic(path, iter(["{", '"a": ', "1}"]))
    assert path.read_text() == '{"a": 1}'

    def failing() -> Iterator[str]:
        yield "half"
        raise ValueError("a bad piece")

    with pytest.raises(ValueError, match="a bad piece"):
        write_atomic(path, failing())
    assert path.read_text() == '{"a": 1}' and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_a_write_that_fails_ends_its_generator_of_pieces_at_once(tmp_path: Path) -> None:
    """A generator of pieces holds things open while suspended (`plan_json_pieces` pauses the collector):
    a failed write closes it, on a regular file and on a device, rather than leaving it to the exception."""
    import gc

    from schedcomp.compiler import compile
    from schedcomp.serialize import plan_json_pieces

    plan = compile(2, 1, 2, schedule="1f1b")
    ended = []

    def pieces() -> Iterator[str]:
        try:
            yield "half"
            raise OSError(28, "No space left on device")
        finally:
            ended.append(True)

    with pytest.raises(SchedcompError, match="No space left on device") as info:
        write_atomic(tmp_path / "plan.json", pieces())
    assert ended == [True] and info.value is not None
    if Path("/dev/full").exists():  # a device: written in place, where every write fails
        assert gc.isenabled()
        with pytest.raises(SchedcompError, match="cannot write /dev/full") as info:
            write_atomic("/dev/full", plan_json_pieces(plan))
        assert gc.isenabled()  # while the exception (and the generator's frame in it) is still held
    write_atomic(tmp_path / "bytes.bin", bytearray(b"\x00\x01"))  # bytes-like payloads are written as they are
    assert (tmp_path / "bytes.bin").read_bytes() == b"\x00\x01"
