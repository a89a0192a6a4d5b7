"""The plan cache's files: index entries checked field by field, plan files confined to the cache
directory and matched against their SHA-256, plans written atomically with their digest.

`schedcomp.cache` decides what a scenario is; this module decides whether a file may be trusted.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from schedcomp import fileio, limits
from schedcomp.cut import NO_CUT, Cut
from schedcomp.errors import PlanFormatError, SchedcompTypeError
from schedcomp.ir import Plan
from schedcomp.scenarios import Key, key_name, legacy_key_name
from schedcomp.topology import Topology

_DIGEST = re.compile(r"[0-9a-f]{64}")


def count(data: dict[str, Any], name: str) -> int:
    """The index's integer `name` (pp, dp, microbatches: positive; max_failures: non-negative)."""
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_failures" else 1):
        raise PlanFormatError(f"{name!r} must be a {'non-negative' if name == 'max_failures' else 'positive'} "
                              f"integer, got {value!r}")
    return value


def entry(item: Any, n: int, pp: int, dp: int) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...], Any, str]:
    """Index scenario `n`: its sorted failed (pipeline, stage) pairs, speed classes, file field and digest."""
    if not isinstance(item, dict) or not isinstance(item.get("failed"), list) or not isinstance(
            item.get("classes", []), list):
        raise PlanFormatError(f"scenario {n} must be an object with lists 'failed' and 'classes'")
    topo = Topology.of(pp, dp, item["failed"])
    classes = item.get("classes", [])
    if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < dp for c in classes) or len(
            classes) not in (0, dp):
        raise PlanFormatError(f"scenario {n}: 'classes' must be empty or {dp} speed classes")
    digest = item.get("sha256")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise PlanFormatError(f"scenario {n}: 'sha256' must be the 64-hex-digit digest of its plan file")
    failed = tuple(sorted((w.pipeline, w.stage) for w in topo.failed))
    return failed, tuple(classes), item.get("file"), digest


def scenario_entries(data: dict[str, Any], root: Path, pp: int, dp: int, microbatches: int
                     ) -> tuple[bool, dict[Key, Path], dict[Key, str], dict[Key, Cut]]:
    """The index's scenarios: whether its plans may re-cut micro-batches (`"recut"`), and by scenario its plan
    file, its digest and (for a plan that re-cuts) its cut."""
    recut = data.get("recut", False)
    if not isinstance(recut, bool):
        raise PlanFormatError(f"'recut' must be true or false, got {recut!r}")
    entries = data["scenarios"]
    if not isinstance(entries, list):
        raise PlanFormatError("'scenarios' must be a list")
    limits.SCENARIOS.check(len(entries), "the index")
    files, digests, cuts = {}, {}, {}
    for n, item in enumerate(entries):
        failed, classes, file, digest = entry(item, n, pp, dp)
        key: Key = (failed, classes)
        # Only the scenario's own name is taken: no '..', no absolute path, no other directory.
        if file not in (key_name(key) + ".json", legacy_key_name(key) + ".json"):
            raise PlanFormatError(f"scenario {n}: its file must be {key_name(key) + '.json'!r}, not {file!r}")
        files[key], digests[key] = root / file, digest
        cut = entry_cut(item, n, dp, microbatches, recut)
        if not cut.shares and not {p for p, _ in cut.bounds} <= {d for d, _ in failed}:
            raise PlanFormatError(f"scenario {n}: its 'cut' re-cuts a pipeline that lost no worker there (a plan "
                                  "re-cuts only the failed workers' pipelines): re-run schedcomp precompile")
        if cut:
            cuts[key] = cut
    return recut, files, digests, cuts


def entry_cut(item: dict[str, Any], n: int, dp: int, microbatches: int, recut: bool) -> Cut:
    """Index scenario `n`'s cut of micro-batches (`"cut"`, written for a plan that re-cuts; none: whole ones;
    `"shares"`: a re-formed plan's), which must fit the job, and may be there only in an index that says its
    plans re-cut."""
    if "cut" not in item:
        return NO_CUT
    if not recut:
        raise PlanFormatError(f"scenario {n} has a 'cut' but the index does not say \"recut\": true")
    shares = item.get("shares", False)  # (a re-formed plan: every pipeline's share of the batch re-balanced)
    if not isinstance(shares, bool):
        raise PlanFormatError(f"scenario {n}: 'shares' must be true or false, got {shares!r}")
    try:
        cut = Cut.from_json(item["cut"], shares)
    except PlanFormatError as exc:
        raise PlanFormatError(f"scenario {n}: {exc}") from None
    problem = cut.problem(dp, microbatches) or ("its 'cut' is empty" if not cut else None)
    if problem:
        raise PlanFormatError(f"scenario {n}: {problem}")
    return cut


def read_verified(path: Path, root: Path | None, digest: str | None) -> bytes:
    """The bytes of a cached plan: a regular file directly inside `root` (no symlink out, no device or
    FIFO, within the size limit) whose SHA-256 is `digest`."""
    if root is not None:
        real, home = path.resolve(), root.resolve()
        if real.parent != home:
            raise PlanFormatError(f"cached plan {path} leads outside the cache directory {root} (to {real}): "
                                  "re-run schedcomp precompile")
    data = fileio.read_bytes(path, "cached plan", PlanFormatError)
    if digest is None or hashlib.sha256(data).hexdigest() != digest:
        raise PlanFormatError(f"cached plan {path} does not match the SHA-256 in its index: it was changed or "
                              "replaced after precompile; re-run schedcomp precompile")
    return data


def directory_path(directory: object) -> Path:
    if not isinstance(directory, (str, os.PathLike)):
        raise SchedcompTypeError(f"a plan cache is a directory path, not {type(directory).__name__}")
    return Path(directory)


def make_directory(directory: object) -> Path:
    """The cache directory, created if missing."""
    root = directory_path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlanFormatError(f"cannot create plan cache directory {root}: {exc.strerror or exc}") from None
    return root


def write_plan(path: Path, plan: Plan) -> str:
    """Write a plan atomically; its SHA-256, for the index."""
    data = plan.to_json().encode()
    fileio.write_atomic(path, data, PlanFormatError)
    return hashlib.sha256(data).hexdigest()
