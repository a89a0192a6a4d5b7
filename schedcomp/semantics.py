"""What each instruction kind means: one table that the IR, validator, simulator, runtime and tools read.

Every consumer asks this table, never an `if kind is ...` chain of its own, so a new kind is one
row here plus its runtime handler (`schedcomp.runtime.executor.HANDLERS`), and a kind nobody
registered is an error everywhere (`semantics_of` raises) instead of falling through to a guess.

A row says:
- `blocking`: the stream waits for it to finish (compute, ALLREDUCE, STEP); the others (LOAD,
  sends, receives) are posted and the stream moves on.
- `has_op` / `has_peer`: which fields an instruction of this kind carries.
- `direction`: SEND, RECV or NONE; `channel`: ACT (activations, forward) or GRAD (input gradients,
  backward) for a transfer; `peer_stage`: the stage offset of the other end (+1: the next stage).
- `op_kinds`: the op kinds its `op` may name (a compute kind names its own kind).
- `memory`: the op kind whose `CostModel.memory_delta` it applies when it runs (compute only).
- `cost`: what its duration is: COMPUTE (`costs.compute_time` of its op, times its micro-batch's size
  when the plan re-cuts it: `schedcomp.cut`), ALLREDUCE, OPTIMIZER, or NONE (it takes no time).
- `collective`: it meets the stage's other live workers (ALLREDUCE).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from schedcomp.errors import PlanFormatError

__all__ = [
    "ACT",
    "ALLREDUCE_COST",
    "COMPUTE",
    "GRAD",
    "NONE",
    "OPTIMIZER",
    "RECV",
    "ROLE_ALLREDUCE",
    "ROLE_COMPUTE",
    "ROLE_INERT",
    "ROLE_LOAD",
    "ROLE_RECV",
    "ROLE_SEND",
    "ROLE_STEP",
    "SEMANTICS",
    "SEND",
    "InstrKind",
    "OpKind",
    "Semantics",
    "kind_named",
    "kinds",
    "opless_kind",
    "register",
    "roles",
    "semantics_of",
    "unregister",
]


class OpKind(str, Enum):
    """Compute kinds: forward, input-gradient backward, weight-gradient backward, fused backward."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"

    # Enum hashes in Python (hash of the name); each name equals its value, so the str hash is the same
    # number, computed in C: the compiler hashes kinds hundreds of thousands of times per plan.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value


class InstrKind(str, Enum):
    """Every kind of step in a worker's instruction stream (what each means: `SEMANTICS`)."""

    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    LOAD = "LOAD"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"

    __hash__ = str.__hash__  # as for OpKind: names equal values, so the same hash, in C

    def __str__(self) -> str:
        return self.value


# Plain ints and strings, not enums: the validator reads these per instruction of million-row plans.
NONE, SEND, RECV = "", "send", "recv"  # direction
ACT, GRAD = 0, 1  # channel: also the low bit of a tensor id (see `schedcomp.planindex`)
COMPUTE, ALLREDUCE_COST, OPTIMIZER = "compute", "allreduce", "optimizer"  # cost (or NONE)


@dataclass(frozen=True, slots=True)
class Semantics:
    """One instruction kind's meaning (see the module docstring)."""

    kind: Any  # an InstrKind, or a kind a test registered
    blocking: bool
    has_op: bool
    has_peer: bool = False
    direction: str = NONE
    channel: int = -1
    peer_stage: int = 0
    op_kinds: frozenset[OpKind] = frozenset()
    memory: OpKind | None = None
    reads: int = -1  # compute: the channel whose received tensor it consumes (F: ACT; B, BW: GRAD; W: none)
    cost: str = NONE
    collective: bool = False
    loads: bool = False  # it reads its op's inputs (first stage) or targets (last stage) from the batch
    rule: str = ""  # what its op must be, said when a plan breaks it

    @property
    def is_compute(self) -> bool:
        return self.cost == COMPUTE

    @property
    def is_transfer(self) -> bool:
        return self.direction != NONE

    @property
    def role(self) -> int:
        """What the validator and the simulator do with it, as one small int (see `ROLE_*`)."""
        if self.cost == COMPUTE:
            return ROLE_COMPUTE
        if self.loads:
            return ROLE_LOAD
        if self.direction != NONE:
            return ROLE_SEND if self.direction == SEND else ROLE_RECV
        if self.collective:
            return ROLE_ALLREDUCE
        return ROLE_STEP if self.blocking else ROLE_INERT


# Roles: compute; load; send; receive; the stage's all-reduce; a blocking op-less step (STEP: it takes
# `cost`); an inert marker (non-blocking, no transfer: the stream passes it, nothing else happens).
ROLE_COMPUTE, ROLE_LOAD, ROLE_SEND, ROLE_RECV, ROLE_ALLREDUCE, ROLE_STEP, ROLE_INERT = range(7)


def roles() -> dict[Any, int]:
    """kind -> role for every registered kind (hot loops look roles up in this dict, not the rows)."""
    return {k: sem.role for k, sem in _SEMANTICS.items()}


def _compute(kind: InstrKind, reads: int) -> Semantics:
    op = OpKind(kind.value)
    return Semantics(kind, blocking=True, has_op=True, op_kinds=frozenset({op}), memory=op, cost=COMPUTE, reads=reads)


def _transfer(kind: InstrKind, direction: str, channel: int, rule: str) -> Semantics:
    forward = channel == ACT
    return Semantics(kind, blocking=False, has_op=True, has_peer=True, direction=direction, channel=channel,
                     peer_stage=(1 if forward else -1) * (1 if direction == SEND else -1),
                     op_kinds=frozenset({OpKind.F}) if forward else frozenset({OpKind.B, OpKind.BW}), rule=rule)


_SEMANTICS: dict[Any, Semantics] = {
    InstrKind.F: _compute(InstrKind.F, ACT),
    InstrKind.B: _compute(InstrKind.B, GRAD),
    InstrKind.W: _compute(InstrKind.W, -1),
    InstrKind.BW: _compute(InstrKind.BW, GRAD),
    InstrKind.LOAD: Semantics(InstrKind.LOAD, blocking=False, has_op=True, op_kinds=frozenset({OpKind.F}), loads=True,
                              rule="LOAD only feeds a forward at the first or last stage"),
    InstrKind.SEND_ACT: _transfer(InstrKind.SEND_ACT, SEND, ACT,
                                  "SEND_ACT names the F whose output goes to the next stage (none at the last stage)"),
    InstrKind.RECV_ACT: _transfer(InstrKind.RECV_ACT, RECV, ACT, "RECV_ACT names the F that consumes the previous "
                                  "stage's output (none at stage 0)"),
    InstrKind.SEND_GRAD: _transfer(InstrKind.SEND_GRAD, SEND, GRAD, "SEND_GRAD names the B or BW whose input "
                                   "gradient goes back (none at stage 0)"),
    InstrKind.RECV_GRAD: _transfer(InstrKind.RECV_GRAD, RECV, GRAD, "RECV_GRAD names the B or BW that consumes the "
                                   "next stage's gradient (none last)"),
    InstrKind.ALLREDUCE: Semantics(InstrKind.ALLREDUCE, blocking=True, has_op=False, cost=ALLREDUCE_COST,
                                   collective=True),
    InstrKind.STEP: Semantics(InstrKind.STEP, blocking=True, has_op=False, cost=OPTIMIZER),
}
_BY_NAME: dict[str, Any] = {str(k.value): k for k in _SEMANTICS}

SEMANTICS: Mapping[Any, Semantics] = _SEMANTICS  # read-only view for consumers; `register` adds to it


def semantics_of(kind: Any) -> Semantics:
    """The row of `kind`; a kind nobody registered is a `PlanFormatError`, never a silent default."""
    try:
        return _SEMANTICS[kind]
    except (KeyError, TypeError):
        raise PlanFormatError(f"unknown instruction kind {kind!r}: known kinds are {', '.join(_BY_NAME)}") from None


def kind_named(text: str) -> Any:
    """The kind whose text form is `text` (`PlanFormatError` if none)."""
    kind = _BY_NAME.get(text)
    if kind is None:
        raise PlanFormatError(f"unknown instruction kind {text!r}: known kinds are {', '.join(_BY_NAME)}")
    return kind


def opless_kind(text: str) -> Any | None:
    """The op-less kind (ALLREDUCE, STEP, ...) whose text form is `text`, or None."""
    kind = _BY_NAME.get(text)
    return kind if kind is not None and not _SEMANTICS[kind].has_op else None


def kinds(**where: Any) -> frozenset[Any]:
    """The registered kinds whose rows have every field given, e.g. `kinds(direction=SEND)`."""
    return frozenset(k for k, sem in _SEMANTICS.items() if all(getattr(sem, f) == v for f, v in where.items()))


def register(sem: Semantics) -> None:
    """Add a kind (a `str` enum member whose value is its text form). Consumers that cache derived
    sets (`schedcomp.ir`'s text forms) read the table at call time, so a kind added here is seen
    everywhere; the runtime needs a handler for it too (`runtime.executor.HANDLERS`)."""
    name = str(sem.kind.value)
    if sem.kind in _SEMANTICS or name in _BY_NAME:
        raise PlanFormatError(f"instruction kind {name!r} is registered already")
    if sem.cost == COMPUTE:
        raise PlanFormatError("a new compute kind needs an op kind (OpKind) too: add it to the enums here")
    _SEMANTICS[sem.kind] = sem
    _BY_NAME[name] = sem.kind


def unregister(kind: Any) -> None:
    """Remove a kind `register` added (tests clean up after themselves)."""
    if isinstance(kind, InstrKind):
        raise PlanFormatError(f"{kind} is a built-in kind")
    sem = _SEMANTICS.pop(kind)
    del _BY_NAME[str(sem.kind.value)]
