"""What a span looks like, shared by every drawing: its category, label and colour."""

from __future__ import annotations

from schedcomp.ir import InstrKind, Instruction
from schedcomp.timeline import Span

# Categories in legend order: (name, legend text, matplotlib colour, ANSI background code).
CATEGORIES: dict[str, tuple[str, str, str]] = {
    "F": ("forward", "#4e79a7", "44"),
    "B": ("backward (input)", "#59a14f", "42"),
    "W": ("backward (weight)", "#f1ce63", "43"),
    "BW": ("fused backward", "#2f7f7a", "46"),
    "ALLREDUCE": ("all-reduce", "#e15759", "41"),
    "STEP": ("optimizer step", "#b07aa1", "45"),
    "comm": ("transfer (send to arrival)", "#9d9d9d", "47"),
    "LOAD": ("load micro-batch", "#d4d4d4", "47"),
}
BLOCKING = ("F", "B", "W", "BW", "ALLREDUCE", "STEP")
"""Categories that occupy a worker's stream; the others run beside it."""


def category(instruction: Instruction) -> str:
    kind = instruction.kind
    if instruction.is_compute or kind in (InstrKind.ALLREDUCE, InstrKind.STEP, InstrKind.LOAD):
        return kind.value
    return "comm"


def label(span: Span) -> str:
    """Short label: `F3` for the forward of micro-batch 3, `F3.1` when it is pipeline 1's re-routed here,
    `F3@5` when it is of virtual stage 5, a later chunk than the worker's first."""
    ins = span.instruction
    if ins.kind is InstrKind.ALLREDUCE:
        return "AR"
    if ins.kind is InstrKind.STEP:
        return "OPT"
    op = ins.op
    if op is None:  # another op-less kind (a registered one): its name
        return str(ins)
    text = f"{op.kind.value}{op.microbatch}"
    if op.pipeline != span.worker.pipeline:
        text += f".{op.pipeline}"
    if op.stage != span.worker.stage:  # a later chunk of a worker with virtual stages: say which
        text += f"@{op.stage}"
    return text if ins.is_compute else f"{ins.kind.value}[{text}]"
