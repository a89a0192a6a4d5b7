"""The list scheduler's loop, compiled (`_listloop.c`): its tables as flat columns, and the call.

`solvers.greedy.list_schedule_steps` prepares the scheduler's tables once for either loop; where the compiled
module was built (`pip install` builds it; a machine without a C compiler keeps the Python loop), the loop runs
there, one C iteration per op instead of one Python one, with the same choices and the same floats (the tests
compare the two op for op). `SCHEDCOMP_LIST_LOOP=python` picks the Python loop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

try:
    from schedcomp.solvers import _listloop
except ImportError:  # not built: the Python loop runs
    _listloop = None

ENGINES = ("native", "python")


def engine(asked: str | None = None) -> str:
    """The loop that runs: `asked`, else `SCHEDCOMP_LIST_LOOP`, else the compiled one where it was built."""
    name = asked or os.environ.get("SCHEDCOMP_LIST_LOOP") or ("native" if _listloop is not None else "python")
    if name not in ENGINES:
        raise ValueError(f"list loop {name!r}: pick one of {', '.join(ENGINES)} (SCHEDCOMP_LIST_LOOP)")
    if name == "native" and _listloop is None:
        raise ImportError("the compiled list loop (schedcomp.solvers._listloop) was not built: reinstall schedcomp "
                          "with a C compiler (pip install -e .), or set SCHEDCOMP_LIST_LOOP=python")
    return name


def _ints(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _floats(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


def _csr(lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    return ptr, _ints([v for x in lists for v in x])


@dataclass(frozen=True)
class LoopTables:
    """What the compiled loop reads, named as the Python loop's variables (`greedy.list_schedule_steps`)."""

    n_workers: int
    pp: int
    stages: int
    nk: int
    n_slots: int
    split: int
    eager: int
    idle: int
    use_pool: int
    capped: int
    fill: int
    ahead: int
    cut: int
    p2p: float
    eps: float
    limits: np.ndarray
    window_open: np.ndarray
    admit: np.ndarray
    dur_row: np.ndarray
    """Per worker, its row of `dur` (-1 for a dead worker)."""
    cap: np.ndarray
    left_f: np.ndarray
    live: np.ndarray
    first: np.ndarray
    reserve: np.ndarray
    d_f: np.ndarray
    d_b: np.ndarray
    d_w: np.ndarray
    place: np.ndarray
    unit: np.ndarray
    room: np.ndarray
    held_ptr: np.ndarray
    held: np.ndarray
    peers_ptr: np.ndarray
    peers: np.ndarray
    runner: np.ndarray
    """Written: a pool-routed slot's runner is the worker that takes it."""
    home: np.ndarray
    size: np.ndarray
    starts: np.ndarray
    """The slots delivered at time 0, in order."""
    dur: np.ndarray
    """The distinct op-time rows (index stage * nk + kind), one after another."""
    log: np.ndarray
    """Written: slot number * nk + kind position of every op, in scheduling order."""


def run_native(*, dur: Sequence[Sequence[float]], held: Sequence[Sequence[int]], peers: Sequence[Sequence[int]],
               runner: Sequence[int], home: Sequence[int], size: Sequence[float] | None, cap: Sequence[int],
               left_f: Sequence[int], room: Sequence[float], d_w: Sequence[float], n_ops: int,
               **scalars_and_columns: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the compiled loop: the op log, the steps (where each time of the clock begins in the log) and the
    runner of every slot after it (pool routing hands re-routed slots out as it goes)."""
    rows: dict[int, int] = {}
    distinct: list[Sequence[float]] = []
    dur_row = []
    for row in dur:  # workers alike share one list (`Problem.op_times`): one row each here too
        if not row:
            dur_row.append(-1)
            continue
        k = rows.get(id(row))
        if k is None:
            k = rows[id(row)] = len(distinct)
            distinct.append(row)
        dur_row.append(k)
    held_ptr, held_flat = _csr(held)
    peers_ptr, peers_flat = _csr(peers)
    runner_col = _ints(runner)
    columns = {k: (_floats(v) if k in ("limits", "window_open", "admit", "reserve", "d_f", "d_b", "unit")
                   else _ints(v) if k in ("live", "first", "place", "starts") else v)
               for k, v in scalars_and_columns.items()}
    tables = LoopTables(
        **columns,  # type: ignore[arg-type]
        dur_row=_ints(dur_row), cap=_ints(cap), left_f=_ints(left_f), d_w=_floats(d_w), room=_floats(room),
        held_ptr=held_ptr, held=held_flat, peers_ptr=peers_ptr, peers=peers_flat, runner=runner_col,
        home=_ints(home), size=_floats(size if size is not None else []),
        dur=_floats([t for row in distinct for t in row]), log=np.empty(n_ops, dtype=np.int64),
    )
    logged, steps = _listloop.run(tables)
    return tables.log[:logged], np.frombuffer(steps, dtype=np.int64), runner_col
