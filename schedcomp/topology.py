"""Workers and the job's topology: pipeline depth, data-parallel width, failed workers, virtual stages.

With virtual stages (`chunks` > 1) a worker holds several model chunks: the model has `pp * chunks`
stages, an op's `stage` is its virtual stage, and `Worker.stage` stays the worker's place in its
pipeline (0..pp-1). Which place holds virtual stage s is the topology's `placement`, as PyTorch's
`stage_to_rank`: "loop" (interleaved 1F1B: s mod pp) or "v" (the V shape of ZB-V, two chunks:
s for s < pp, 2pp-1-s after). With `chunks` = 1 both are the identity and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from schedcomp import limits
from schedcomp.errors import PlanFormatError, SchedcompTypeError, TopologyError

T = TypeVar("T")

LOOP, V = "loop", "v"
PLACEMENTS = (LOOP, V)


@dataclass(frozen=True, order=True, slots=True)
class Worker:
    """One process of the job: stage `stage` of data-parallel pipeline `pipeline`."""

    pipeline: int
    stage: int

    def __str__(self) -> str:
        return f"{self.pipeline}:{self.stage}"

    def rank(self, pp: int) -> int:
        """Global rank in the fault-free job: `pipeline * pp + stage`."""
        return self.pipeline * pp + self.stage

    @classmethod
    def parse(cls, text: str) -> Worker:
        """Parse `d:s` (pipeline d, stage s)."""
        if not isinstance(text, str):
            raise SchedcompTypeError(f"a worker is written PIPELINE:STAGE, e.g. '1:3', not {type(text).__name__}")
        numbers = [_signed(part.strip()) for part in text.strip().split(":")]
        if len(numbers) != 2 or None in numbers:
            raise TopologyError(f"bad worker {_shown(text)}: write it as PIPELINE:STAGE, e.g. 1:3")
        return cls(*numbers)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Topology:
    """`pp` workers per pipeline, `dp` pipelines holding the same weights, the failed workers, and how
    many model chunks (virtual stages) each worker holds, placed by `placement` (see the module docstring)."""

    pp: int
    dp: int = 1
    failed: frozenset[Worker] = field(default_factory=frozenset)
    chunks: int = 1
    placement: str = LOOP

    def __post_init__(self) -> None:
        if isinstance(self.pp, bool) or not isinstance(self.pp, int) or self.pp < 1:
            raise TopologyError(f"pp must be a positive integer, got {self.pp!r}")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise TopologyError(f"dp must be a positive integer, got {self.dp!r}")
        limits.check_job(self.pp, self.dp)  # before anything sized by the job is built
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise TopologyError(f"chunks must be a positive integer, got {self.chunks!r}")
        if self.placement not in PLACEMENTS:
            raise TopologyError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.placement == V and self.chunks != 2:
            raise TopologyError(f"the V placement holds exactly 2 chunks per worker, got chunks={self.chunks}")
        limits.check_job(self.pp * self.chunks, self.dp)
        failed = frozenset(self.failed)
        object.__setattr__(self, "failed", failed)
        for w in failed:
            if not isinstance(w, Worker) or not all(_is_int(x) for x in (w.pipeline, w.stage)):
                raise SchedcompTypeError(f"failed worker {w!r} must be a Worker of two integers, e.g. Worker(1, 3)")
            if not (0 <= w.pipeline < self.dp and 0 <= w.stage < self.pp):
                raise TopologyError(
                    f"failed worker {w} is outside the job: pipelines are 0..{self.dp - 1}, stages 0..{self.pp - 1}"
                )

    @classmethod
    def of(cls, pp: int, dp: int = 1, failed: Iterable[Worker | tuple[int, int]] = (), chunks: int = 1,
           placement: str = LOOP) -> Topology:
        """Build a topology, accepting failed workers as `Worker`s, `(pipeline, stage)` pairs or "d:s" strings."""
        return cls(pp, dp, frozenset(as_workers(failed)), chunks, placement)

    @property
    def stages(self) -> int:
        """Virtual stages per pipeline (model chunks): `pp * chunks`; `pp` without virtual stages."""
        return self.pp * self.chunks

    def place_of(self, stage: int) -> int:
        """The place in the pipeline (`Worker.stage`) of the worker holding virtual stage `stage`."""
        pp = self.pp
        if self.placement == V and stage >= pp:
            return 2 * pp - 1 - stage
        return stage % pp

    def chunks_of(self, place: int) -> tuple[int, ...]:
        """The virtual stages the worker at `place` holds, in model order (the inverse of `place_of`)."""
        if self.placement == V:
            return (place, 2 * self.pp - 1 - place)
        return tuple(place + k * self.pp for k in range(self.chunks))

    @property
    def workers(self) -> tuple[Worker, ...]:
        """Every worker of the fault-free job, in rank order."""
        return tuple(Worker(d, s) for d in range(self.dp) for s in range(self.pp))

    @property
    def live_workers(self) -> tuple[Worker, ...]:
        """Workers that are not failed, in rank order."""
        return tuple(w for w in self.workers if w not in self.failed)

    def is_live(self, worker: Worker) -> bool:
        return 0 <= worker.pipeline < self.dp and 0 <= worker.stage < self.pp and worker not in self.failed

    def stage_group(self, stage: int) -> tuple[Worker, ...]:
        """Live workers of `stage`: the group that all-reduces its gradients."""
        return tuple(Worker(d, stage) for d in range(self.dp) if Worker(d, stage) not in self.failed)

    def rank(self, worker: Worker) -> int:
        return worker.rank(self.pp)

    def worker_of_rank(self, rank: int) -> Worker:
        return Worker(rank // self.pp, rank % self.pp)


def ascii_number(text: object) -> int | None:
    """The number `text` writes in ASCII digits (at most 18 of them), else None. Not `str.isdigit` alone:
    "²" passes it and int() refuses it, and int() reads "١" (Arabic-Indic one) as 1, an alias of "1"."""
    if isinstance(text, str) and text.isascii() and text.isdigit() and len(text) < 19:
        return int(text)
    return None


def _signed(text: str) -> int | None:
    """`ascii_number`, or minus one (so "-1:0" reads, and is refused as outside the job where it is used)."""
    return -n if text.startswith("-") and (n := ascii_number(text[1:])) is not None else ascii_number(text)


def by_pipeline(data: Mapping[str, T], what: str) -> dict[int, T]:
    """A JSON object keyed by pipeline number ("3"), keyed by int; one-line `PlanFormatError` for a key that
    is not a number in ASCII digits, or for two keys naming one pipeline ("1" and "01": one would silently
    override the other)."""
    out: dict[int, T] = {}
    for key, value in data.items():
        number = ascii_number(key)
        if number is None:
            raise PlanFormatError(f"{what} is keyed by pipeline numbers (\"3\"), got {_shown(key)}")
        if number in out:
            raise PlanFormatError(f"{what} names pipeline {number} twice (key {_shown(key)} and another): give "
                                  "each pipeline once")
        out[number] = value
    return out


def _shown(text: object) -> str:
    """`text` for a message, bounded (a hostile key may be megabytes long)."""
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def as_workers(failed: object) -> list[Worker]:
    """Failed workers given as `Worker`s, `(pipeline, stage)` pairs of integers or "d:s" strings.

    Anything else (a bare string, None, a pair of floats) is refused with one line saying how to write it."""
    how = 'give a list of workers, e.g. [(1, 3)], [Worker(1, 3)] or ["1:3"]'
    if isinstance(failed, (str, bytes)) or failed is None or not hasattr(failed, "__iter__"):
        raise SchedcompTypeError(f"failed must be a list of workers, not {type(failed).__name__} {failed!r}: {how}")
    out = []
    for w in failed:  # type: ignore[attr-defined]
        if isinstance(w, Worker):
            out.append(w)
        elif isinstance(w, str):
            out.append(Worker.parse(w))
        elif isinstance(w, (tuple, list)) and len(w) == 2 and all(_is_int(x) for x in w):
            out.append(Worker(w[0], w[1]))
        else:
            raise SchedcompTypeError(f"bad failed worker {w!r}: {how}")
    return out
