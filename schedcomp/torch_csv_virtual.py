"""PyTorch's compute-only CSV with several stages per rank (virtual stages), read into an `Order`.

A row is a rank; each cell `{stage}{type}{microbatch}` names its stage, so a rank holding chunks
4 and 0 writes `0F0,...,4F0`. The reader infers what the CSV implies: the model's stages (one more
than the largest index), the chunks per rank (stages / ranks) and PyTorch's `stage_to_rank`
placement, "loop" (interleaved: s on s mod pp) or "v" (ZB-V: s on s, then 2pp-1-s). Every stage
runs on exactly one rank; any other mapping is refused in one line. `order_from_torch_csv` hands a
CSV here as soon as a row names a stage that is not its rank; writing needs nothing special
(`order_to_torch_csv` writes each op's stage).
"""

from __future__ import annotations

from collections.abc import Sequence

from schedcomp import limits
from schedcomp.errors import LimitError, PlanFormatError, SchedcompError
from schedcomp.ir import Op, OpKind, Order
from schedcomp.serialize import _ACTION_RE, _FROM_TORCH, csv_microbatches, csv_not_an_action
from schedcomp.topology import LOOP, PLACEMENTS, Topology, Worker

Action = tuple[OpKind, int, int]  # (kind, micro-batch, stage)


def virtual_order_from_rows(rows: Sequence[Sequence[str]], microbatches: int | None, dp: int,
                            family: str) -> Order:
    """The `Order` of CSV `rows` (one per rank) whose ranks hold several stages; see the module docstring."""
    pp = len(rows)
    actions = [_parse_row(rank, row) for rank, row in enumerate(rows)]
    owner: dict[int, int] = {}  # stage -> the rank running it
    for rank, row_actions in enumerate(actions):
        for _, _, stage in row_actions:
            other = owner.setdefault(stage, rank)
            if other != rank:
                raise PlanFormatError(f"stage {stage} runs on ranks {other} and {rank}: every stage runs on one rank")
    stages = max(owner) + 1
    missing = sorted(set(range(stages)) - set(owner))
    if missing:
        raise PlanFormatError(f"the CSV names stages up to {stages - 1} but no rank runs stage {missing[0]}: "
                              "give every stage its actions")
    if stages % pp:
        raise PlanFormatError(f"{stages} stages on {pp} ranks: every rank must hold the same number of stages")
    topology = _topology(pp, dp, stages // pp, owner)
    largest = max(mb for row_actions in actions for _, mb, _ in row_actions)
    microbatches = csv_microbatches(largest, microbatches)
    limits.check_job(stages, dp, microbatches)  # before building dp x pp op tuples
    make = Op.trusted  # fields checked above: skip the frozen dataclass's per-field setattr
    ops = {Worker(d, rank): tuple([make(kind, d, mb, stage) for kind, mb, stage in actions[rank]])
           for d in range(dp) for rank in range(pp)}
    return Order(topology, microbatches, ops, family)


def _parse_row(rank: int, row: Sequence[str]) -> list[Action]:
    out = []
    for col, cell in enumerate(row):
        cell = cell.strip()
        if not cell:
            continue  # an idle step
        m = _ACTION_RE.fullmatch(cell)
        if not m or m["kind"] not in _FROM_TORCH or not m["mb"]:
            raise csv_not_an_action(rank, col, cell)
        out.append((_FROM_TORCH[m["kind"]], int(m["mb"]), int(m["stage"])))
    return out


def _topology(pp: int, dp: int, chunks: int, owner: dict[int, int]) -> Topology:
    """The topology whose placement puts every stage on the rank the CSV runs it on."""
    for placement in PLACEMENTS:
        try:
            topology = Topology.of(pp, dp, chunks=chunks, placement=placement)
        except LimitError:
            raise
        except SchedcompError as exc:
            if placement == LOOP:
                raise PlanFormatError(str(exc)) from None
            continue  # the V placement holds two chunks only
        if all(topology.place_of(s) == rank for s, rank in owner.items()):
            return topology
    mapping = ", ".join(f"{s}->{owner[s]}" for s in sorted(owner))
    raise PlanFormatError(f"the CSV places stages on ranks as {mapping}: only PyTorch's interleaved (stage s on rank "
                          "s mod pp) and V (ZB-V) placements are supported")
