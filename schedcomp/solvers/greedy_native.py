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

from schedcomp.solvers.greedy_loop import TOLERANCE, LoopInputs

try:
    from schedcomp.solvers import _listloop
except ImportError:  # not built: the Python loop runs
    _listloop = None  # type: ignore[assignment]

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
    """Lists as one column and where each begins (and the last ends)."""
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists])
    return ptr, _ints([v for x in lists for v in x])


@dataclass(frozen=True)
class LoopTables:
    """The columns of `LoopInputs` as the compiled loop reads them (its sizes and switches it reads from the
    inputs themselves): flat int64 and float64 columns, lists of lists as one column with where each begins
    (`held_ptr`, `peers_ptr`), the op-time rows workers share once each (`dur`, `dur_row`: -1 for a dead
    worker); `runner` and `log` are written."""

    eps: float
    limits: np.ndarray
    window_open: np.ndarray
    admit: np.ndarray
    dur_row: np.ndarray
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
    home: np.ndarray
    size: np.ndarray
    starts: np.ndarray
    dur: np.ndarray
    log: np.ndarray

    @classmethod
    def of(cls, t: LoopInputs) -> LoopTables:
        rows: dict[int, int] = {}
        distinct: list[list[float]] = []
        dur_row = []
        for row in t.dur:  # workers alike share one list (`Problem.op_times`): one row each here too
            k = -1 if not row else rows.setdefault(id(row), len(distinct))
            if k == len(distinct):
                distinct.append(row)
            dur_row.append(k)
        held_ptr, held = _csr(t.held)
        peers_ptr, peers = _csr(t.peers)
        return cls(
            eps=TOLERANCE, limits=_floats(t.limits), window_open=_floats(t.window_open),
            admit=_floats(t.admit), dur_row=_ints(dur_row), cap=_ints(t.cap), left_f=_ints(t.left_f),
            live=_ints(t.live), first=_ints(t.first), reserve=_floats(t.reserve), d_f=_floats(t.d_f),
            d_b=_floats(t.d_b), d_w=_floats(t.d_w), place=_ints(t.place), unit=_floats(t.unit),
            room=_floats(t.room), held_ptr=held_ptr, held=held, peers_ptr=peers_ptr, peers=peers,
            runner=_ints(t.runner), home=_ints(t.home), size=_floats(t.size if t.size is not None else []),
            starts=_ints(t.starts), dur=_floats([x for row in distinct for x in row]),
            log=np.empty(t.n_ops, dtype=np.int64))


def native_loop(inputs: LoopInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`greedy_loop.python_loop`, compiled: the op log, the steps and every slot's runner after the loop."""
    return run_tables(inputs, LoopTables.of(inputs))


def run_tables(inputs: LoopInputs, tables: LoopTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compiled loop over `inputs`' sizes and `tables` (it checks every index it follows first: a
    ValueError, not a crash)."""
    if _listloop is None:
        raise ImportError("the compiled list loop (schedcomp.solvers._listloop) was not built")
    logged, steps = _listloop.run(inputs, tables)
    return tables.log[:logged], np.frombuffer(steps, dtype=np.int64), tables.runner
