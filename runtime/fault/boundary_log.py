"""The log of logging-based recovery (SWIFT): the boundary tensors a worker sent, kept for replay.

    ResilientTrainer(..., checkpoint=CheckpointPolicy(dir, every=k),
                     logging=LoggingPolicy(where="memory", budget_bytes=1 << 30, boundaries="all"))

Each worker keeps, per receiving stage and iteration, the tensors it sent across a stage boundary
(activations to stage s + 1, gradients to stage s - 1), so that a stage that loses every replica
can be rebuilt from its checkpoint by replaying the iterations since (`fault.swift`). What is kept:

- `boundaries`: "all", or the boundaries to log (boundary b lies between stages b and b + 1).
  A stage whose boundaries are not both logged cannot be replayed: losing it restarts the job
  from its checkpoint (SWIFT's selective logging trades that for log size).
- `where`: "memory" (host memory) or a directory (local disk: one header and one byte file per
  receiving stage and iteration, under a folder of this worker's own).
- `budget_bytes`: the most this worker holds; past it the oldest iterations are dropped, and a
  stage whose log has such a gap restarts from its checkpoint instead.
- `helpers`: how many idle survivors may replay part of a lost stage beside its replacement
  (`fault.swift_parallel`; 0, the default: none; None: as many as the cost model finds faster).

Entries for receiving stage t are dropped once t has two complete checkpoints newer than them:
recovery restores t's newest checkpoint at or before the iteration the survivors roll back to,
and t's newest checkpoint may be one step ahead of that (t stepped and saved an iteration that a
slower stage had not stepped when t died), so the log must reach back to the one before.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from schedcomp.errors import RecoveryError
from schedcomp.runtime.fault.transfer import decode_header, encode_header, flatten, from_bytes, to_bytes, unflatten
from schedcomp.semantics import ACT
from schedcomp.topology import Worker

Key = tuple[int, int]  # (home pipeline, microbatch): one chunk of the global batch
MEMORY = "memory"


@dataclass(frozen=True)
class LoggingPolicy:
    """What each worker logs for logging-based recovery, where, and within how many bytes (see the module docstring)."""

    where: str | Path = MEMORY
    budget_bytes: int = 1 << 30
    boundaries: str | tuple[int, ...] = "all"
    helpers: int | None = 0  # idle survivors that may help replay a lost stage (None: any; `fault.swift_parallel`)

    def __post_init__(self) -> None:
        if self.helpers is not None and (isinstance(self.helpers, bool) or not isinstance(self.helpers, int)
                                         or self.helpers < 0):
            raise RecoveryError(f"helpers must be a whole number >= 0 or None, got {self.helpers!r}")
        if isinstance(self.budget_bytes, bool) or not isinstance(self.budget_bytes, int) or self.budget_bytes < 0:
            raise RecoveryError(f"logging budget must be a whole number of bytes >= 0, got {self.budget_bytes!r}")
        if isinstance(self.boundaries, str):
            if self.boundaries != "all":
                raise RecoveryError(f"boundaries must be 'all' or a list of boundary numbers, got {self.boundaries!r}")
        else:
            listed = tuple(self.boundaries)
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in listed):
                raise RecoveryError(f"boundaries must be numbers >= 0 (boundary b lies between stages b and b + 1), "
                                    f"got {self.boundaries!r}")
            object.__setattr__(self, "boundaries", tuple(sorted(set(listed))))
        if not isinstance(self.where, (str, Path)) or str(self.where) == "":
            raise RecoveryError(f"where must be 'memory' or a directory, got {self.where!r}")

    def logs(self, boundary: int) -> bool:
        return self.boundaries == "all" or boundary in self.boundaries

    def replayable(self, stage: int, pp: int) -> bool:
        """Whether a lost `stage` can be replayed: the boundaries it receives over are logged."""
        return (stage == 0 or self.logs(stage - 1)) and (stage == pp - 1 or self.logs(stage))


class BoundaryLog:
    """One worker's log: (receiving stage, iteration) -> {chunk: tensors sent}, within the budget."""

    def __init__(self, policy: LoggingPolicy, me: Worker) -> None:
        self.policy, self.me = policy, me
        self.sizes: dict[tuple[int, int], int] = {}  # (receiving stage, iteration) -> bytes held
        self.chunks: dict[tuple[int, int], list[Key]] = {}  # what each entry holds (read without loading it)
        self.memory: dict[tuple[int, int], dict[Key, tuple[Tensor, ...]]] = {}
        self.gaps: dict[int, int] = {}  # receiving stage -> the newest iteration dropped for the budget
        self.peak = 0
        self.folder = None if policy.where == MEMORY else Path(policy.where) / f"w{me.pipeline}_{me.stage}"
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)  # a previous incarnation's log is not this one's
            self.folder.mkdir(parents=True, exist_ok=True)

    @property
    def held(self) -> int:
        return sum(self.sizes.values())

    def add(self, iteration: int, sent: Mapping[tuple[int, int, Key], tuple[Tensor, ...]]) -> int:
        """Log what this worker sent in `iteration` (`Iteration.sent`: (channel, sending stage, micro-batch)
        -> tensors); returns the bytes logged."""
        by_stage: dict[int, dict[Key, tuple[Tensor, ...]]] = {}
        for (direction, stage, key), tensors in sent.items():
            to = stage + 1 if direction == ACT else stage - 1
            if self.policy.logs(min(to, stage)):
                by_stage.setdefault(to, {})[key] = tuple(t.detach().to("cpu") for t in tensors)
        logged = 0
        for to, entry in by_stage.items():
            self._forget(to, iteration)  # a re-run iteration replaces what it logged before
            size = sum(t.numel() * t.element_size() for ts in entry.values() for t in ts)
            self._make_room(size)
            if self.held + size > self.policy.budget_bytes:
                self.gaps[to] = max(self.gaps.get(to, -1), iteration)
                continue
            self._write(to, iteration, entry)
            self.sizes[(to, iteration)] = size
            self.chunks[(to, iteration)] = sorted(entry)
            logged += size
        self.peak = max(self.peak, self.held)
        return logged

    def prune(self, stage: int, through: int) -> None:
        """Drop what was sent to `stage` in iterations up to `through` (its checkpoints made them useless)."""
        for to, j in [k for k in self.sizes if k[0] == stage and k[1] <= through]:
            self._forget(to, j)

    def discard_from(self, iteration: int) -> None:
        """Drop iterations from `iteration` on: they are re-run, and logged again."""
        for to, j in [k for k in self.sizes if k[1] >= iteration]:
            self._forget(to, j)

    def coverage(self, stage: int, iterations: Iterable[int]) -> dict[int, list[Key]]:
        """The chunks logged for `stage`, per iteration asked for (an iteration lost to the budget: none)."""
        return {j: self.chunks.get((stage, j), []) for j in iterations}

    def entries(self, stage: int, iterations: Iterable[int]) -> list[list]:
        """What was sent to `stage` in `iterations`, as `[[iteration, pipeline, microbatch, [tensors]], ...]`."""
        out: list[list] = []
        for j in iterations:
            if (stage, j) in self.sizes:
                out += [[j, p, m, list(ts)] for (p, m), ts in sorted(self._read(stage, j).items())]
        return out

    def _make_room(self, size: int) -> None:
        while self.sizes and self.held + size > self.policy.budget_bytes:
            to, j = min(self.sizes, key=lambda k: k[1])
            self.gaps[to] = max(self.gaps.get(to, -1), j)
            self._forget(to, j)

    def _forget(self, stage: int, iteration: int) -> None:
        if self.sizes.pop((stage, iteration), None) is None:
            return
        self.memory.pop((stage, iteration), None)
        self.chunks.pop((stage, iteration), None)
        if self.folder is not None:
            for suffix in (".json", ".bin"):
                self._path(stage, iteration, suffix).unlink(missing_ok=True)

    def _path(self, stage: int, iteration: int, suffix: str) -> Path:
        assert self.folder is not None
        return self.folder / f"to{stage}_it{iteration:08d}{suffix}"

    def _write(self, stage: int, iteration: int, entry: dict[Key, tuple[Tensor, ...]]) -> None:
        if self.folder is None:
            self.memory[(stage, iteration)] = entry
            return
        skeleton, tensors = flatten([[p, m, list(ts)] for (p, m), ts in sorted(entry.items())])
        self._path(stage, iteration, ".bin").write_bytes(to_bytes(tensors, torch.device("cpu")).numpy().tobytes())
        self._path(stage, iteration, ".json").write_bytes(encode_header(skeleton, tensors))

    def _read(self, stage: int, iteration: int) -> dict[Key, tuple[Tensor, ...]]:
        if self.folder is None:
            return self.memory[(stage, iteration)]
        skeleton, specs, _ = decode_header(self._path(stage, iteration, ".json").read_bytes())
        payload = torch.frombuffer(bytearray(self._path(stage, iteration, ".bin").read_bytes()), dtype=torch.uint8)
        rows = unflatten(skeleton, from_bytes(payload, specs))
        return {(int(p), int(m)): tuple(ts) for p, m, ts in rows}

