"""The schedule IR: compute ops, instructions, compute orders and plans.

Text forms (they round-trip through `parse`):
- an op: `F3.1` = forward of micro-batch 3 of (home) pipeline 1; also `B`, `W`, `BW`.
  The stage is the stage of the worker whose stream holds it.
- an instruction: a compute op as above; `LOAD[F3.1]` (load inputs/targets for F3.1);
  `SEND_ACT[F3.1>0:2]` (send F3.1's output to worker 0:2); `RECV_ACT[F3.1<1:0]`
  (receive the input of F3.1 from worker 1:0); `SEND_GRAD[B3.1>0:0]`,
  `RECV_GRAD[BW3.1<0:2]` likewise for input gradients; `ALLREDUCE`; `STEP`.
  A transfer names the op *on this worker* that produces (send) or consumes (recv) it.
- with virtual stages (a worker holds several chunks), an op carries its virtual stage:
  `F3.1@5`, `SEND_ACT[F3.1@5>0:2]` (`staged_text`); without `@` it is the worker's stage.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from schedcomp.cut import NO_CUT, Cut
from schedcomp.errors import PlanFormatError
from schedcomp.partition import Partition
from schedcomp.partitions import Partitions
from schedcomp.semantics import COMPUTE, RECV, SEND, InstrKind, OpKind, kind_named, kinds, opless_kind, semantics_of
from schedcomp.topology import Topology, Worker

if TYPE_CHECKING:
    from schedcomp.costs import CostModel


@dataclass(frozen=True, order=True, slots=True)
class Op:
    """One unit of compute, named by the micro-batch's home pipeline, whoever runs it."""

    kind: OpKind
    pipeline: int
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{_TEXT[self.kind]}{self.microbatch}.{self.pipeline}"  # `.value` on an enum is slow

    @property
    def key(self) -> tuple[int, int, int]:
        """(pipeline, microbatch, stage): the slot this op fills, whatever its kind."""
        return (self.pipeline, self.microbatch, self.stage)

    @classmethod
    def trusted(cls, kind: OpKind, pipeline: int, microbatch: int, stage: int) -> Op:
        """Build without the dataclass constructor, for loaders that checked the fields already."""
        op = _new(cls)
        _OP_KIND(op, kind)
        _OP_PIPELINE(op, pipeline)
        _OP_MICROBATCH(op, microbatch)
        _OP_STAGE(op, stage)
        return op

    def with_kind(self, kind: OpKind) -> Op:
        return Op(kind, self.pipeline, self.microbatch, self.stage)

    def at_stage(self, stage: int) -> Op:
        return Op(self.kind, self.pipeline, self.microbatch, stage)

    @classmethod
    def parse(cls, text: str, stage: int) -> Op:
        m = _OP_RE.fullmatch(text.strip())
        if not m:
            raise PlanFormatError(f"bad op {text!r}: write KIND MICROBATCH.PIPELINE, e.g. F3.1 or BW0.0")
        given = m["stage"]
        return cls(OpKind(m["kind"]), int(m["pipeline"]), int(m["mb"]), stage if given is None else int(given))


_OP_RE = re.compile(r"(?P<kind>BW|F|B|W)(?P<mb>[0-9]{1,18})\.(?P<pipeline>[0-9]{1,18})(?:@(?P<stage>[0-9]{1,18}))?")


# The built-in kinds' classes, read off the semantics table (a registered kind is looked up there).
COMPUTE_KINDS = kinds(cost=COMPUTE)
SEND_KINDS = kinds(direction=SEND)
RECV_KINDS = kinds(direction=RECV)
_TEXT: dict[Any, str] = {k: k.value for k in (*OpKind, *InstrKind)}  # enum -> its text (OpKind.F == InstrKind.F)


def _form(kind: Any) -> int:
    """How an instruction of `kind` prints: 0 bare op, 1 KIND[op] or KIND, 2 a send, 3 a receive."""
    sem = semantics_of(kind)
    return 0 if sem.is_compute else 2 if sem.direction == SEND else 3 if sem.direction == RECV else 1


_FORM = {k: _form(k) for k in InstrKind}  # cached for the built-in kinds: a plan's JSON prints millions


@dataclass(frozen=True, slots=True)
class Instruction:
    """One step of a worker's stream.

    - compute (F/B/W/BW): `op` is the op to run.
    - LOAD: `op` is the forward that needs the micro-batch (inputs at stage 0, targets at the last stage).
    - SEND_*/RECV_*: `op` is the op on this worker that produces / consumes the tensor; `peer` the other end.
    - ALLREDUCE / STEP: gradient reduction over the stage's live workers, then the optimizer step.
    """

    kind: InstrKind
    op: Op | None = None
    peer: Worker | None = None

    def __post_init__(self) -> None:
        sem = semantics_of(self.kind)
        if sem.has_op != (self.op is not None) or sem.has_peer != (self.peer is not None):
            raise PlanFormatError(f"instruction {self.kind} has the wrong fields: op={self.op}, peer={self.peer}")
        if sem.is_compute and self.op is not None and self.op.kind not in sem.op_kinds:
            raise PlanFormatError(f"compute instruction {self.kind} carries op {self.op} of another kind")

    @classmethod
    def trusted(cls, kind: InstrKind, op: Op | None, peer: Worker | None) -> Instruction:
        """Build without `__post_init__`'s checks, for code that makes well-formed instructions by
        construction (`lower` makes hundreds of thousands); anything parsed or user-made goes through
        the checked constructor."""
        ins = _new(cls)
        _INSTR_KIND(ins, kind)
        _INSTR_OP(ins, op)
        _INSTR_PEER(ins, peer)
        return ins

    @classmethod
    def compute(cls, op: Op) -> Instruction:
        return cls(InstrKind(op.kind.value), op)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS or (self.kind not in _FORM and semantics_of(self.kind).is_compute)

    def __str__(self) -> str:
        op = self.op
        return instruction_text(self.kind, None if op is None else str(op), self.peer)

    @classmethod
    def parse(cls, text: str, stage: int) -> Instruction:
        """Parse the text form of an instruction in the stream of a worker at `stage`."""
        text = text.strip()
        opless = opless_kind(text)
        if opless is not None:
            return cls(opless)  # ALLREDUCE, STEP (or a registered op-less kind)
        m = _INSTR_RE.fullmatch(text)
        if m:
            try:
                kind = kind_named(m["kind"])
            except PlanFormatError:
                raise PlanFormatError(f"unknown instruction kind {m['kind']!r} in {text!r}") from None
            op = Op.parse(m["op"], stage)
            peer = Worker.parse(m["peer"]) if m["peer"] else None
            direction = semantics_of(kind).direction
            if (m["dir"] == ">") != (direction == SEND) or (m["dir"] == "<") != (direction == RECV):
                raise PlanFormatError(f"bad instruction {text!r}: sends use '>PEER', receives '<PEER', LOAD no peer")
            return cls(kind, op, peer)
        return cls.compute(Op.parse(text, stage))


def instruction_text(kind: Any, op_text: str | None, peer: Worker | None) -> str:
    """The text of an instruction given its op's (`F3.1`): the one format, for `str` and `stream_texts`."""
    # Plain dict lookups, not enum `.value` (a Python-level descriptor): a plan's JSON is millions of these.
    if op_text is None:
        return _TEXT[kind] if kind in _TEXT else str(getattr(kind, "value", kind))
    form = _FORM[kind] if kind in _FORM else _form(kind)
    if form == 0:
        return op_text
    if peer:
        return f"{_TEXT[kind]}[{op_text}{'>' if form == 2 else '<'}{peer.pipeline}:{peer.stage}]"
    return f"{_TEXT[kind]}[{op_text}]"


def stream_texts(stream: Sequence[Instruction]) -> list[str]:
    """`[str(ins) for ins in stream]`, for writers of whole plans: a lowered stream names an op in neighbouring
    instructions (LOAD, compute, SEND), so each run of them formats the op's text once."""
    texts: list[str] = []
    append, text, bare, wrap_of, name = texts.append, instruction_text, _BARE, _WRAP.get, _TEXT
    last: Op | None = None
    op_text: str | None = None
    for ins in stream:
        op = ins.op
        if op is not last:
            last = op
            # `Op.__str__` inlined for plain ops (a Python call each, 2.6 million at pp = 32, dp = 256).
            op_text = None if op is None else \
                f"{name[op.kind]}{op.microbatch}.{op.pipeline}" if type(op) is Op else str(op)
        # `instruction_text` inlined for the bare ops and transfers (3.6 million at pp = 32, dp = 256).
        kind = ins.kind
        if kind in bare and op_text is not None:
            append(op_text)
            continue
        wrap, peer = wrap_of(kind), ins.peer
        if wrap is not None and peer and op_text is not None:
            append(f"{wrap[0]}{op_text}{wrap[1]}{peer.pipeline}:{peer.stage}]")
        else:
            append(text(kind, op_text, peer))
    return texts


_BARE = frozenset(k for k, form in _FORM.items() if form == 0)  # the built-in kinds written as their op alone
_WRAP = {k: (f"{_TEXT[k]}[", ">" if form == 2 else "<") for k, form in _FORM.items() if form >= 2}  # transfers


def staged_text(ins: Instruction) -> str:
    """The text of `ins` with its op's virtual stage (`F3.1@5`, `SEND_ACT[F3.1@5>0:2]`): the form of
    plans whose workers hold several chunks, where the worker alone does not say the op's stage."""
    text = str(ins)
    op = ins.op
    if op is None:
        return text
    bare = f"{_TEXT[op.kind]}{op.microbatch}.{op.pipeline}"
    at = text.index(bare) + len(bare)  # the op is the first thing after the kind (or all of it)
    return f"{text[:at]}@{op.stage}{text[at:]}"


_new = object.__new__  # bound once: `trusted` builds millions of ops and instructions
# The slots' own setters, for `trusted`: a C call each, five times faster than `object.__setattr__` by
# name (what a frozen dataclass's `__init__` does), which was a third of `lower`'s time on big plans.
_OP_KIND, _OP_PIPELINE, _OP_MICROBATCH, _OP_STAGE = (
    getattr(Op, f).__set__ for f in ("kind", "pipeline", "microbatch", "stage"))
_INSTR_KIND, _INSTR_OP, _INSTR_PEER = INSTRUCTION_SETTERS = tuple(
    getattr(Instruction, f).__set__ for f in ("kind", "op", "peer"))
OP_SETTERS = (_OP_KIND, _OP_PIPELINE, _OP_MICROBATCH, _OP_STAGE)
"""The slots' setters, for builders of millions of ops or instructions that inline `trusted` (`lower`,
`adaptive.Solution.order`): set every field, in this order."""
# ASCII digits (\d also takes "١", which int() reads as 1: an alias), bounded: int() of a 4300-digit number
# raises, and no count needs more than 18 digits.
_N = r"[0-9]{1,18}"
_INSTR_RE = re.compile(rf"(?P<kind>[A-Z_]+)\[(?P<op>[A-Z]+{_N}\.{_N}(?:@{_N})?)(?:(?P<dir>[<>])(?P<peer>{_N}:{_N}))?\]")


@dataclass(frozen=True)
class Order:
    """A compute-only schedule: for each live worker, the ops it runs, in order.

    Produced by a schedule family or a solver; `lower` turns it into a `Plan`.
    """

    topology: Topology
    microbatches: int
    ops: Mapping[Worker, tuple[Op, ...]]
    family: str = ""
    cut: Cut = NO_CUT
    """How each pipeline's share is cut into micro-batches (`schedcomp.cut`; whole by default)."""
    partition: Partition | None = None
    """Layers per stage (`schedcomp.partition`); None leaves the cut of the model to the runtime."""
    partitions: Partitions | None = None
    """Per pipeline, layers per place (`schedcomp.partitions`: re-formed pipelines); None: every pipeline
    uses `partition`."""

    def runner(self) -> dict[tuple[int, int, int], Worker]:
        """Who runs the F (and so the B and W) of each (pipeline, microbatch, stage)."""
        return {op.key: w for w, ops in self.ops.items() for op in ops if op.kind is OpKind.F}


@dataclass(frozen=True)
class Plan:
    """A compiled job: topology, costs, one instruction stream per live worker, and provenance.

    `family` names the schedule family or solver that made it; `lower_bound` is a proven
    lower bound on the period when the solver has one (so the plan carries its gap).
    """

    topology: Topology
    costs: CostModel
    microbatches: int
    streams: Mapping[Worker, tuple[Instruction, ...]]
    family: str = ""
    solver: str = ""
    lower_bound: float | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    cut: Cut = NO_CUT
    """How each pipeline's share is cut into micro-batches (`schedcomp.cut`; whole by default)."""
    partition: Partition | None = None
    """Layers per stage (`schedcomp.partition`); None leaves the cut of the model to the runtime."""
    partitions: Partitions | None = None
    """Per pipeline, layers per place (`schedcomp.partitions`: re-formed pipelines); None: every pipeline
    uses `partition`. With them, `partition` is the partition of the pipelines that keep it."""
    pipeline_costs: Mapping[int, CostModel] = field(default_factory=dict)
    """The stage cost model of each pipeline whose partition is not `partition` (keyed by pipeline; its
    memory limit is its workers'): `costs_of`. Empty without `partitions`."""
    layer_allreduce: tuple[float, ...] = ()
    """With `partitions`: each layer's gradient all-reduce time, so a segment's collective takes its layers'
    sum (`schedcomp.partitions.segments`); each stage's `allreduce` is its layers' sum. Empty without them."""

    def costs_of(self, pipeline: int) -> CostModel:
        """The stage cost model of `pipeline`'s ops and workers: its own where it was re-formed, else `costs`."""
        return self.pipeline_costs.get(pipeline, self.costs)

    def with_meta(self, meta: Mapping[str, Any]) -> Plan:
        """This plan with another `meta` (provenance: `check` does not read it and no timing depends on it), so
        what was proved or timed of this very object (kept on it by `check` and `simfast.remember`) holds for
        the new one too and is not done again."""
        new = replace(self, meta=meta)
        for name, value in self.__dict__.items():
            if name not in new.__dict__:
                object.__setattr__(new, name, value)
        return new

    @property
    def workers(self) -> tuple[Worker, ...]:
        return tuple(sorted(self.streams))

    def compute_ops(self, worker: Worker) -> tuple[Op, ...]:
        return tuple(i.op for i in self.streams[worker] if i.is_compute and i.op is not None)

    def to_networkx(self) -> Any:
        """One iteration as a networkx DiGraph: nodes (worker, index), edges stream order and transfers
        (see `schedcomp.graph`)."""
        from schedcomp.graph import to_networkx

        return to_networkx(self)

    def to_json(self) -> str:
        from schedcomp.serialize import plan_to_json

        return plan_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        from schedcomp.serialize import plan_from_json

        return plan_from_json(text)

    def to_text(self) -> str:
        from schedcomp.serialize import plan_to_text

        return plan_to_text(self)

    @classmethod
    def from_text(cls, text: str) -> Plan:
        from schedcomp.serialize import plan_from_text

        return plan_from_text(text)
