"""Helpers for the hostile-input tests: run the CLI in-process and snapshot directories."""

from __future__ import annotations

import contextlib
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

from schedcomp.cli import main


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str


def cli(*argv: str) -> Run:
    """`schedcomp ARGV` in this process: exit code, stdout, stderr (no subprocess: fuzzing stays fast)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's --help/--version; anything else is a bug the caller sees
            code = exc.code if isinstance(exc.code, int) else 0
    return Run(code, out.getvalue(), err.getvalue())


def assert_refused(run: Run, *fragments: str) -> str:
    """Exit 2, nothing on stdout, exactly one `schedcomp: error:` line naming every fragment; the line."""
    assert run.code == 2, (run.code, run.out[-300:], run.err[-600:])
    assert "Traceback" not in run.err
    lines = run.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("schedcomp: error: "), run.err
    assert "schedcomp: error: schedcomp" not in lines[0], lines[0]  # the program name once
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def strict_json(text: str) -> object:
    """Parse JSON as the spec has it: NaN / Infinity are errors, not numbers."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def snapshot(directory: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `directory` (relative name -> mode, bytes), to show a failure changed nothing."""
    out = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(directory))] = (os.stat(path).st_mode, path.read_bytes())
    return out
