"""The small job whose failure plans re-cut micro-batches (pp 2, dp 3, M 3: a failed worker's 3 micro-batches
go to its place's 2 peers as 1.5 each), precompiled with `recut=True` into a directory; copies of such a
cache with an edited index."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from schedcomp.cache import precompile

PP, DP, M = 2, 3, 3


def precompile_recut(directory: Path) -> Path:
    """The job's cache of every failure set of one worker, re-cut where that is faster, in `directory`."""
    precompile(PP, DP, M, 1, time_limit=1.0, recut=True, directory=directory)
    return directory


def copy_cache(source: Path, target: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of the cache in `source` (its plan files as they are) whose index `edit` changed in place."""
    index = json.loads((source / "index.json").read_text())
    edit(index)
    for entry in index["scenarios"]:
        (target / entry["file"]).write_bytes((source / entry["file"]).read_bytes())
    (target / "index.json").write_text(json.dumps(index))
    return target


def as_whole(index: dict) -> None:
    """Edit an index to say its plans keep whole micro-batches, as every index before `recut` did."""
    del index["recut"]
    for entry in index["scenarios"]:
        entry.pop("cut", None)
