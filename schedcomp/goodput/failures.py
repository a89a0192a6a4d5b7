"""Failure processes for the goodput simulator: a Poisson model, or a trace read from CSV.

A failure takes one or more workers down at `time` for `down` seconds (then they are repaired and
may rejoin). With `gpus_per_node` G > 1 a failure takes a whole node: node n holds the global
ranks n*G .. n*G+G-1 (rank = pipeline * pp + stage, so a node is G consecutive stages of one
pipeline when G divides pp).

The model: every GPU fails at rate 1 / MTBF (exponential), a failure of any of a node's GPUs takes
the node, so failures arrive as a Poisson process of rate N / MTBF over the N GPUs and hit a node
drawn uniformly. A failure of a worker that is already down is kept (it extends the outage: with
spares, the replacement failed).
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from schedcomp.errors import PlanFormatError, TopologyError
from schedcomp.fileio import read_text
from schedcomp.topology import Worker

HOUR = 3600.0
MAX_FAILURES = 1_000_000


@dataclass(frozen=True)
class Failure:
    """Workers lost at `time` (seconds from the start), back after `down` seconds."""

    time: float
    workers: tuple[Worker, ...]
    down: float


def node_workers(node: int, pp: int, dp: int, gpus_per_node: int) -> tuple[Worker, ...]:
    """The workers of node `node` (ranks node*G .. node*G+G-1, cut at the job's end)."""
    first = node * gpus_per_node
    last = min(first + gpus_per_node, pp * dp)
    return tuple(Worker(*divmod(rank, pp)) for rank in range(first, last))


def node_count(pp: int, dp: int, gpus_per_node: int) -> int:
    return -(-pp * dp // gpus_per_node)


def system_mtbf(pp: int, dp: int, gpu_mtbf_hours: float) -> float:
    """Mean seconds between failures of the job's pp * dp GPUs."""
    return gpu_mtbf_hours * HOUR / (pp * dp)


def poisson_failures(pp: int, dp: int, duration_s: float, gpu_mtbf_hours: float, repair_s: float, *,
                     gpus_per_node: int = 1, seed: int = 0) -> tuple[Failure, ...]:
    """Failures over `duration_s` seconds under the model of the module docstring (seeded)."""
    _check_nodes(pp, dp, gpus_per_node)
    if not (gpu_mtbf_hours > 0 and math.isfinite(gpu_mtbf_hours)):
        raise TopologyError(f"the per-GPU MTBF must be a positive number of hours, got {gpu_mtbf_hours}")
    rng = random.Random(seed)
    mean_gap = system_mtbf(pp, dp, gpu_mtbf_hours)
    if duration_s / mean_gap > MAX_FAILURES:
        raise TopologyError(f"{duration_s / mean_gap:.3g} failures expected, more than the {MAX_FAILURES} this "
                            "simulator handles: shorten the run or raise the MTBF")
    nodes = node_count(pp, dp, gpus_per_node)
    out, t = [], rng.expovariate(1.0 / mean_gap)
    while t < duration_s:
        out.append(Failure(t, node_workers(rng.randrange(nodes), pp, dp, gpus_per_node), repair_s))
        t += rng.expovariate(1.0 / mean_gap)
    return tuple(out)


def parse_trace(text: str, pp: int, dp: int, *, gpus_per_node: int = 1, duration_s: float = math.inf,
                name: str = "trace") -> tuple[Failure, ...]:
    """Rows `time_s, node or d:s, down_s` (a header row and `#` comments are allowed), sorted by time.

    A malformed row, an unknown node or worker, a negative or non-finite time, or a time past the
    run's end raises `PlanFormatError` naming the row."""
    _check_nodes(pp, dp, gpus_per_node)
    nodes = node_count(pp, dp, gpus_per_node)
    out = []
    for row_no, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [c.strip() for c in row]
        if not cells or not any(cells) or cells[0].startswith("#"):
            continue
        if row_no == 1 and cells[0].lower().startswith("time"):
            continue  # header
        where = f"{name} row {row_no}"
        if len(cells) != 3:
            raise PlanFormatError(f"{where}: expected 3 fields (time_s, node or d:s, down_s), got {len(cells)}")
        time_s, down_s = (_seconds(cells[i], what, where) for i, what in ((0, "time_s"), (2, "down_s")))
        if time_s > duration_s:
            raise PlanFormatError(f"{where}: time {time_s:g} s is after the run's end ({duration_s:g} s): "
                                  "raise --days or drop the row")
        who = cells[1]
        if ":" in who:
            try:
                worker = Worker.parse(who)
            except TopologyError as exc:
                raise PlanFormatError(f"{where}: {exc}") from None
            if not (0 <= worker.pipeline < dp and 0 <= worker.stage < pp):
                raise PlanFormatError(f"{where}: unknown worker {who}: pipelines are 0..{dp - 1}, stages 0..{pp - 1}")
            workers: tuple[Worker, ...] = (worker,)
        else:
            try:
                node = int(who)
            except ValueError:
                raise PlanFormatError(f"{where}: {who!r} is neither a node number nor a worker d:s") from None
            if not 0 <= node < nodes:
                raise PlanFormatError(f"{where}: unknown node {node}: the job has nodes 0..{nodes - 1} "
                                      f"({gpus_per_node} GPU{'s' if gpus_per_node > 1 else ''} each)")
            workers = node_workers(node, pp, dp, gpus_per_node)
        out.append(Failure(time_s, workers, down_s))
    return tuple(sorted(out, key=lambda f: f.time))


def load_trace(path: str, pp: int, dp: int, *, gpus_per_node: int = 1, duration_s: float = math.inf
               ) -> tuple[Failure, ...]:
    """`parse_trace` of the CSV file at `path`."""
    return parse_trace(read_text(path, "failure trace", PlanFormatError), pp, dp, gpus_per_node=gpus_per_node,
                       duration_s=duration_s, name=str(path))


def observed_mtbf(failures: Sequence[Failure], duration_s: float) -> float:
    """Mean seconds between the failures of a trace (inf without failures)."""
    return duration_s / len(failures) if failures else math.inf


def _seconds(text: str, what: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PlanFormatError(f"{where}: {what} {text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise PlanFormatError(f"{where}: {what} must be a finite number of seconds, at least 0, got {text}")
    return value


def _check_nodes(pp: int, dp: int, gpus_per_node: int) -> None:
    if gpus_per_node < 1 or gpus_per_node > pp * dp:
        raise TopologyError(f"gpus per node must be between 1 and the job's {pp * dp} GPUs, got {gpus_per_node}")
