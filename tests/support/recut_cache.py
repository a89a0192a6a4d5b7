"""The small job whose failure plans re-cut micro-batches (pp 2, dp 3, M 3: a failed worker's 3 micro-batches
go to its place's 2 peers as 1.5 each), precompiled with `recut=True` into a directory."""

from __future__ import annotations

from pathlib import Path

from schedcomp.cache import precompile

PP, DP, M = 2, 3, 3


def precompile_recut(directory: Path) -> Path:
    """The job's cache of every failure set of one worker, re-cut where that is faster, in `directory`."""
    precompile(PP, DP, M, 1, time_limit=1.0, recut=True, directory=directory)
    return directory
