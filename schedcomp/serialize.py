"""Plans on disk: versioned JSON, a compact text form, and PyTorch's compute-only CSV.

JSON (`plan_to_json` / `plan_from_json`)::

    {"format": "schedcomp-plan", "version": 1,
     "topology": {"pp": 4, "dp": 1, "failed": ["1:2"]}, "microbatches": 8,
     "family": "1f1b", "solver": "", "lower_bound": null, "meta": {},
     "costs": {...CostModel.to_dict()...},
     "streams": {"0:0": ["LOAD[F0.0]", "F0.0", "SEND_ACT[F0.0>0:1]", ...], ...}}

Text (`plan_to_text` / `plan_from_text`): the same header without streams as one JSON line,
then one line per worker, `0:2: F0.0 SEND_ACT[F0.0>0:3] ...`. Blank lines and `#` lines are
ignored. With virtual stages the topology also has "chunks" and "placement" (both optional: a
plan without them has one chunk per worker, and one-chunk plans are written without them) and every
op names its virtual stage: `F3.1@5` (`schedcomp.ir.staged_text`). Both forms round-trip exactly:
`plan_from_json(plan_to_json(p)) == p`, provided
`meta` holds JSON values (lists, not tuples).

Re-cut micro-batches (`schedcomp.cut`): a plan with a cut is written as version 2 with one more header
key, `"cut": {"3": [0.0, 0.57, ..., 8.0]}` (per re-cut pipeline its pieces' boundaries); every other plan
is written as version 1, as before, and both versions are read (a version-1 plan has no cut). An older
schedcomp refuses a version-2 plan in one line rather than run it with whole micro-batches.
A plan with a partition (`schedcomp.partition`: layers per stage) is written as version 3 with a
`"partition": [4, 3, 5, 4]` key (and a cut if it has one); an older schedcomp refuses it in one line
rather than run it with the model cut elsewhere.
A plan with per-pipeline partitions (`schedcomp.partitions`: re-formed pipelines) is written as version 4:
`"partition"` (the pipelines that keep it), `"partitions": [[4, 4, 4, 4], ..., [6, 0, 5, 5]]` (one per
pipeline) and `"pipeline_costs": {"3": {...CostModel.to_dict()...}}` (the cost model of each pipeline whose
partition is not `partition`), `"layer_allreduce"` (per layer, what a segment's collective sums), with a
cut or none (its last boundaries are then the pipelines' shares).

PyTorch CSV (`plan_to_torch_csv` / `order_from_torch_csv`): the compute-only format that
`torch.distributed.pipelining` schedules `_dump_csv` / `_load_csv`: one row per rank, one cell
per action `{stage}{type}{microbatch}` with type F (forward), I (backward input, our B),
W (backward weight) or B (full backward, our BW); an empty cell is an idle step. Only
fault-free plans map onto it; with dp > 1 every pipeline must run the same order, written once.
With virtual stages a rank's row names each of its stages (`4F0`, interleaved or V placement), and
reading such a CSV infers the chunks and placement (`schedcomp.torch_csv_virtual`).

Every malformed input raises `PlanFormatError` with a one-line message.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any

from schedcomp import fileio, limits
from schedcomp.costs import CostModel
from schedcomp.cut import NO_CUT, Cut
from schedcomp.errors import LimitError, PlanFormatError, SchedcompError
from schedcomp.gcpause import paused_gc
from schedcomp.ir import Instruction, Op, OpKind, Order, Plan, staged_text, stream_texts
from schedcomp.limits import MAX_COST
from schedcomp.partition import as_partition
from schedcomp.partitions import are_layer_times, as_partitions
from schedcomp.streamcolumns import JSON_PLAIN, columns_of, json_lists
from schedcomp.topology import Topology, Worker, by_pipeline

FORMAT = "schedcomp-plan"
VERSION = 1
VERSION_CUT = 2
"""The version of plans with re-cut micro-batches (a `cut` key); plans without one stay version 1."""
VERSION_PARTITION = 3
"""The version of plans with a partition (a `partition` key, and a `cut` key or none)."""
VERSION_PARTITIONS = 4
"""The version of plans with per-pipeline partitions (`partitions` and `pipeline_costs` keys, a `partition`)."""
VERSIONS = (VERSION, VERSION_CUT, VERSION_PARTITION, VERSION_PARTITIONS)

__all__ = [
    "FORMAT",
    "VERSION",
    "order_from_torch_csv",
    "order_to_torch_csv",
    "plan_from_json",
    "plan_from_text",
    "plan_json_pieces",
    "plan_to_json",
    "plan_to_text",
    "plan_to_torch_csv",
    "read_plan",
]

_HEADER_KEYS = ("format", "version", "topology", "microbatches", "family", "solver", "lower_bound", "meta", "costs",
                "cut", "partition", "partitions", "pipeline_costs", "layer_allreduce")


# ---- header (everything but the streams) -------------------------------------------------------


def _header(plan: Plan) -> dict[str, Any]:
    topo = plan.topology
    return {
        "format": FORMAT,
        "version": VERSION_PARTITIONS if plan.partitions is not None else VERSION_PARTITION
        if plan.partition is not None else VERSION_CUT if plan.cut else VERSION,
        "topology": {"pp": topo.pp, "dp": topo.dp, "failed": [str(w) for w in sorted(topo.failed)],
                     # Optional: written only with virtual stages, so one-chunk plans stay as they were.
                     **({"chunks": topo.chunks, "placement": topo.placement} if topo.chunks > 1 else {})},
        "microbatches": plan.microbatches,
        "family": plan.family,
        "solver": plan.solver,
        "lower_bound": plan.lower_bound,
        "meta": dict(plan.meta),
        "costs": plan.costs.to_dict(),
        **({"cut": plan.cut.to_json()} if plan.cut else {}),
        **({"partition": list(plan.partition)} if plan.partition is not None else {}),
        **({"partitions": [list(p) for p in plan.partitions],
            "pipeline_costs": {str(d): c.to_dict() for d, c in sorted(plan.pipeline_costs.items())},
            "layer_allreduce": list(plan.layer_allreduce)}
           if plan.partitions is not None else {}),
    }


def _dumps(data: Any, **kw: Any) -> str:
    try:
        return json.dumps(data, allow_nan=False, **kw)
    except (TypeError, ValueError) as exc:
        raise PlanFormatError(f"plan cannot be written as JSON ({exc}): keep plan.meta to JSON values") from None


def _loads(text: str, what: str) -> Any:
    if not isinstance(text, str):
        raise PlanFormatError(f"{what} must be text, got {type(text).__name__}")
    return fileio.load_json(text, what, PlanFormatError)  # depth, NaN and huge ints refused before use


def _get(data: Mapping[str, Any], key: str, types: type | tuple[type, ...], what: str) -> Any:
    if key not in data:
        raise PlanFormatError(f"{what} lacks {key!r}: write plans with schedcomp (plan.to_json())")
    value = data[key]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise PlanFormatError(f"{what}: {key!r} has the wrong type ({type(value).__name__})")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _parse_header(data: Any, what: str) -> dict[str, Any]:
    """Check the header of a plan and build everything but the streams."""
    if not isinstance(data, dict):
        raise PlanFormatError(f"{what} must be a JSON object with \"format\": \"{FORMAT}\"")
    if data.get("format") != FORMAT:
        raise PlanFormatError(f"{what} is not a schedcomp plan (\"format\" is {data.get('format')!r}, "
                              f"expected {FORMAT!r})")
    version = data.get("version")
    if version not in VERSIONS or isinstance(version, bool):
        raise PlanFormatError(f"{what} has version {version!r}; this schedcomp reads versions "
                              f"{', '.join(map(str, VERSIONS))}: recompile the plan with this version")
    reformed = version == VERSION_PARTITIONS
    for key in ("partitions", "pipeline_costs", "layer_allreduce"):
        if (key in data) != reformed:
            raise PlanFormatError(f"{what}: a version-{VERSION_PARTITIONS} plan has {key!r} (re-formed pipelines) "
                                  f"and other versions none; this one has version {version}"
                                  f"{f' and {key!r}' if key in data else f' and no {key!r}'}")
    if ("partition" in data) != (version in (VERSION_PARTITION, VERSION_PARTITIONS)):
        raise PlanFormatError(f"{what}: a version-{VERSION_PARTITION} or {VERSION_PARTITIONS} plan has a 'partition' "
                              f"(layers per stage) and other versions none; this one has version {version}"
                              f"{' and a partition' if 'partition' in data else ' and no partition'}")
    if version < VERSION_PARTITION and ("cut" in data) != (version == VERSION_CUT):
        raise PlanFormatError(f"{what}: a version-{VERSION_CUT} plan has a 'cut' (re-cut micro-batches) and a "
                              f"version-{VERSION} plan none; this one has version {version}"
                              f"{' and a cut' if 'cut' in data else ' and no cut'}")
    topo = _get(data, "topology", dict, what)
    try:
        pp = _get(topo, "pp", int, f"{what} topology")
        dp = _get(topo, "dp", int, f"{what} topology")
        failed = _get(topo, "failed", list, f"{what} topology")
        if not all(isinstance(w, str) for w in failed):
            raise PlanFormatError(f"{what}: topology failed workers must be strings like \"1:2\"")
        chunks = _get(topo, "chunks", int, f"{what} topology") if "chunks" in topo else 1
        placement = _get(topo, "placement", str, f"{what} topology") if "placement" in topo else "loop"
        # refuses dp=1e9 before allocating
        topology = Topology.of(pp, dp, [Worker.parse(w) for w in failed], chunks, placement)
        costs = CostModel.from_dict(_get(data, "costs", dict, what))
        if costs.pp != topology.stages:
            raise PlanFormatError(f"{what}: the cost model has {costs.pp} stages but the topology has "
                                  f"{topology.stages} (pp={pp} x chunks={chunks})" if chunks > 1 else
                                  f"{what}: the cost model has {costs.pp} stages but the topology has pp={pp}")
        costs.check_workers(topology)
        pipeline_costs = _pipeline_costs(data, topology, what) if reformed else {}
        microbatches = _get(data, "microbatches", int, what)
        if microbatches < 1:
            raise PlanFormatError(f"{what}: microbatches must be positive, got {microbatches}")
        limits.check_job(pp, dp, microbatches)
    except (PlanFormatError, LimitError):
        raise
    except SchedcompError as exc:
        raise PlanFormatError(f"{what}: {exc}") from None
    lower_bound = data.get("lower_bound")
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not math.isfinite(lower_bound)):
        raise PlanFormatError(f"{what}: 'lower_bound' must be a finite number or null")
    return {
        "topology": topology,
        "costs": costs,
        "microbatches": microbatches,
        "family": _get(data, "family", str, what),
        "solver": _get(data, "solver", str, what),
        "lower_bound": None if lower_bound is None else float(lower_bound),
        "meta": _get(data, "meta", dict, what),
        "cut": Cut.from_json(data["cut"], shares=reformed) if "cut" in data else NO_CUT,
        "partition": as_partition(data["partition"], topology.stages, f"{what}: 'partition'")
        if "partition" in data else None,
        **({"partitions": as_partitions(data["partitions"], topology.dp, topology.pp, topology.failed,
                                        f"{what}: 'partitions'"),
            "pipeline_costs": pipeline_costs,
            "layer_allreduce": _per_layer(data["layer_allreduce"], what)} if reformed else {}),
    }


def _per_layer(value: object, what: str) -> tuple[float, ...]:
    """'layer_allreduce': one time from 0 to MAX_COST per layer (their count is checked against the partitions)."""
    if not isinstance(value, list) or not are_layer_times(value):
        raise PlanFormatError(f"{what}: 'layer_allreduce' must be a list of one time per layer, each from 0 to "
                              f"{MAX_COST:g} (as a cost model's times)")
    return tuple(float(x) for x in value)


def _pipeline_costs(data: Mapping[str, Any], topology: Topology, what: str) -> dict[int, CostModel]:
    """The 'pipeline_costs' of a version-4 plan: pipeline number -> its stage cost model."""
    out: dict[int, CostModel] = {}
    for d, value in by_pipeline(_get(data, "pipeline_costs", dict, what), f"{what}: 'pipeline_costs'").items():
        if d >= topology.dp:
            raise PlanFormatError(f"{what}: 'pipeline_costs' is keyed by pipelines 0..{topology.dp - 1}, got {d}")
        if not isinstance(value, dict):
            raise PlanFormatError(f"{what}: 'pipeline_costs' of pipeline {d} must be a cost model (an object)")
        costs = CostModel.from_dict(value)
        if costs.pp != topology.stages:
            raise PlanFormatError(f"{what}: the cost model of pipeline {d} has {costs.pp} stages but the topology "
                                  f"has pp={topology.pp}")
        costs.check_workers(topology)
        out[d] = costs
    return out


def _parse_stream(worker: Worker, items: Any, topology: Topology, what: str) -> tuple[Instruction, ...]:
    if not topology.is_live(worker):
        raise PlanFormatError(f"{what}: worker {worker} has a stream but is not a live worker of the topology")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise PlanFormatError(f"{what}: the stream of {worker} must be a list of instruction strings")
    out = []
    for k, text in enumerate(items):
        try:
            out.append(Instruction.parse(text, worker.stage))
        except SchedcompError as exc:
            raise PlanFormatError(f"{what}: worker {worker} instruction {k}: {exc}") from None
    return tuple(out)


def _parse_worker(text: str, what: str) -> Worker:
    try:
        return Worker.parse(text)
    except SchedcompError:
        raise PlanFormatError(f"{what}: bad worker {text!r}: write it as PIPELINE:STAGE, e.g. 0:3") from None


# ---- JSON -----------------------------------------------------------------------------------------


@paused_gc()  # many small acyclic objects (ops, instructions, texts): see `schedcomp.gcpause`
def plan_to_json(plan: Plan, indent: bool = True) -> str:
    """The versioned JSON form of `plan`: one line per header key and per worker's stream, or one
    line in all with `indent=False`."""
    if not indent:
        data = _header(plan)
        streams = _stream_items(plan, ":", ",")
        head = _dumps(data, separators=(",", ":"))
        return f'{head[:-1]},"streams":{{{",".join(streams)}}}}}'
    # Joined once (a 70 MB plan at pp = 32, dp = 256: each intermediate copy would add that much to the peak).
    return "".join(plan_json_pieces(plan))


def plan_json_pieces(plan: Plan) -> Iterator[str]:
    """`plan_to_json(plan)` in pieces, a stream's line at a time (what `fileio.write_atomic` writes of a large
    plan without holding its whole text)."""
    # One line per key and per stream keeps files diff-able without a line per instruction.
    lines = [f" {json.dumps(k)}: {_dumps(v)}," for k, v in _header(plan).items()]
    yield "{\n" + "\n".join(lines) + '\n "streams": {\n  '
    with paused_gc():
        for n, stream in enumerate(_stream_items(plan, ": ", ", ")):
            yield f",\n  {stream}" if n else stream
    yield "\n }\n}\n"


def _stream_items(plan: Plan, item: str, sep: str) -> Iterator[str]:
    """Each worker's `"WORKER": [...]` item, in worker order."""
    # Instruction and worker texts are letters, digits and `._:<>[]-` (see `ir`), valid JSON strings as
    # they are: each stream is joined directly, not escaped by `json` text by text (that was most of the
    # time for plans of 100k+ workers). Anything else (a hand-made op with odd fields) goes through `json`.
    columns = columns_of(plan.streams)
    lists = json_lists(columns, sep) if columns is not None and plan.topology.chunks == 1 else None
    if lists is not None:  # a lowered plan: its lists made from its columns
        for w, texts in lists:
            yield f'"{w}"{item}{texts}'
        return
    text = _text_of(plan)
    # Sorted items, not `plan.streams[w]` per sorted key: that hashes each `Worker` (a Python call) once more.
    for w, stream in sorted(plan.streams.items(), key=itemgetter(0)):
        yield f"{_string(str(w))}{item}{_json_list(text(stream), sep)}"




def _string(text: str) -> str:
    return f'"{text}"' if JSON_PLAIN.fullmatch(text) else _dumps(text)


def _text_of(plan: Plan) -> Callable[[Sequence[Instruction]], list[str]]:
    """How a stream of the plan is written: with each op's virtual stage when workers hold several."""
    return _staged_texts if plan.topology.chunks > 1 else stream_texts


def _staged_texts(stream: Sequence[Instruction]) -> list[str]:
    return list(map(staged_text, stream))


def _json_list(texts: list[str], sep: str) -> str:
    """`json.dumps(texts, separators=(sep, ...))`, fast for plain texts."""
    if not JSON_PLAIN.fullmatch("".join(texts)):
        return _dumps(texts, separators=(sep, ":"))
    return '["' + f'"{sep}"'.join(texts) + '"]' if texts else "[]"


def plan_from_json(text: str) -> Plan:
    """Read a plan written by `plan_to_json`; PlanFormatError if it is not one."""
    return _plan_from_data(_loads(text, "plan"))


@paused_gc()  # many small acyclic objects (ops, instructions, texts): see `schedcomp.gcpause`
def _plan_from_data(data: Any) -> Plan:
    fields = _parse_header(data, "plan")
    streams_data = _get(data, "streams", dict, "plan")
    streams = {}
    for key, items in streams_data.items():
        w = _parse_worker(key, "plan")
        if w in streams:  # "1:0" and "01:0": one would silently override the other
            raise PlanFormatError(f"plan: worker {w} has a second stream (key {key[:40]!r}): give each worker one")
        streams[w] = _parse_stream(w, items, fields["topology"], "plan")
    return Plan(streams=streams, **fields)


# ---- text -----------------------------------------------------------------------------------------


@paused_gc()  # many small acyclic objects (ops, instructions, texts): see `schedcomp.gcpause`
def plan_to_text(plan: Plan) -> str:
    """The compact text form: a JSON header line, then `WORKER: INSTR INSTR ...` per worker."""
    lines = [_dumps(_header(plan), separators=(",", ":"))]
    text = _text_of(plan)
    for w in sorted(plan.streams):
        lines.append(f"{w}: " + " ".join(text(plan.streams[w])))
    return "\n".join(lines) + "\n"


_LINE_RE = re.compile(r"(?P<worker>[0-9]+:[0-9]+):(?P<rest>.*)")


@paused_gc()  # many small acyclic objects (ops, instructions, texts): see `schedcomp.gcpause`
def plan_from_text(text: str) -> Plan:
    """Read the text form written by `plan_to_text`; PlanFormatError if it is not one."""
    if not isinstance(text, str):
        raise PlanFormatError(f"plan text must be a string, got {type(text).__name__}")
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    if not lines:
        raise PlanFormatError("plan text is empty: its first line must be the JSON header")
    n0, head = lines[0]
    fields = _parse_header(_loads(head, f"plan text header (line {n0})"), f"plan text header (line {n0})")
    streams: dict[Worker, tuple[Instruction, ...]] = {}
    for n, line in lines[1:]:
        m = _LINE_RE.fullmatch(line)
        if not m:
            raise PlanFormatError(f"plan text line {n}: expected 'PIPELINE:STAGE: INSTRUCTION ...', got {line[:40]!r}")
        w = _parse_worker(m["worker"], f"plan text line {n}")
        if w in streams:
            raise PlanFormatError(f"plan text line {n}: worker {w} has a second stream line")
        streams[w] = _parse_stream(w, m["rest"].split(), fields["topology"], f"plan text line {n}")
    return Plan(streams=streams, **fields)


def read_plan(text: str) -> Plan:
    """Read a plan in either form: JSON if the whole text is one JSON value, else the text form."""
    if not isinstance(text, str):
        raise PlanFormatError(f"a plan must be text, got {type(text).__name__}")
    try:
        data = fileio.load_json(text, "plan", PlanFormatError)
    except PlanFormatError:
        first = text.lstrip().split("\n", 1)[0]
        if text.lstrip().startswith("{") and not _is_json(first):
            return plan_from_json(text)  # broken JSON: say where
        return plan_from_text(text)
    return _plan_from_data(data)


def _is_json(line: str) -> bool:
    try:
        fileio.load_json(line, "line", PlanFormatError)
    except PlanFormatError:
        return False
    return True


# ---- PyTorch compute-only CSV -----------------------------------------------------------------------

_TO_TORCH = {OpKind.F: "F", OpKind.B: "I", OpKind.W: "W", OpKind.BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_ACTION_RE = re.compile(r"(?P<stage>[0-9]{1,18})(?P<kind>[A-Z_]+?)(?P<mb>[0-9]{0,18})")


def order_to_torch_csv(order: Order) -> str:
    """PyTorch's compute-only CSV of a fault-free compute order (each rank's actions name their stage)."""
    topo = order.topology
    if topo.failed:
        raise PlanFormatError(f"the PyTorch CSV format has no failed workers, but {len(topo.failed)} failed here: "
                              "export a fault-free plan")
    rows = []
    for s in range(topo.pp):
        row = None
        held = frozenset(topo.chunks_of(s))
        for d in range(topo.dp):
            w = Worker(d, s)
            ops = order.ops.get(w, ())
            cells = []
            for op in ops:
                if op.stage not in held or op.pipeline != d:
                    raise PlanFormatError(f"worker {w} runs {op} of pipeline {op.pipeline} at stage {op.stage}: the "
                                          "PyTorch CSV format needs every rank to run only its own stages and pipeline")
                cells.append(f"{op.stage}{_TO_TORCH[op.kind]}{op.microbatch}")
            if row is not None and cells != row:
                raise PlanFormatError(f"pipelines 0 and {d} run different orders at stage {s}: the PyTorch CSV format "
                                      "holds one pipeline, so export a plan whose pipelines all run the same schedule")
            row = cells
        rows.append(row or [])
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow(row)
    return out.getvalue()


def plan_to_torch_csv(plan: Plan) -> str:
    """PyTorch's compute-only CSV of a fault-free plan (PlanFormatError otherwise)."""
    if plan.cut:
        raise PlanFormatError("PyTorch's CSV has no micro-batch sizes: a plan with re-cut micro-batches cannot be "
                              "written as one")
    order = Order(plan.topology, plan.microbatches, {w: plan.compute_ops(w) for w in plan.streams}, plan.family)
    return order_to_torch_csv(order)


@paused_gc()  # many small acyclic objects (ops, instructions, texts): see `schedcomp.gcpause`
def csv_not_an_action(rank: int, col: int, cell: str) -> PlanFormatError:
    """The refusal of a CSV cell that is not a compute action (both CSV readers)."""
    return PlanFormatError(f"row {rank} column {col}: {cell!r} is not a compute action like 0F1, 0I1, 0W1 or 0B1 "
                           "(export the compute-only schedule, not the one with communication)")


def csv_microbatches(largest: int, microbatches: int | None) -> int:
    """The micro-batches of a CSV whose largest micro-batch is `largest`: `microbatches` when given (refused in one
    line below largest + 1), else largest + 1 (both CSV readers)."""
    if microbatches is None:
        return largest + 1
    if largest >= microbatches:
        raise PlanFormatError(f"the CSV uses micro-batch {largest} but microbatches={microbatches}: "
                              f"give at least {largest + 1}")
    return microbatches


def order_from_torch_csv(
    text: str, pp: int | None = None, microbatches: int | None = None, dp: int = 1, family: str = "torch-csv"
) -> Order:
    """Read PyTorch's compute-only CSV into an `Order` (every pipeline runs the same rows).

    `pp` and `microbatches` default to the number of rows and 1 + the largest micro-batch;
    given, they must agree with the file.
    """
    if not isinstance(text, str):
        raise PlanFormatError(f"a PyTorch schedule CSV must be text, got {type(text).__name__}")
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as exc:
        raise PlanFormatError(f"malformed CSV: {exc}") from None
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()  # a trailing empty line is not a rank
    if not rows:
        raise PlanFormatError("the PyTorch schedule CSV is empty: it needs one row of actions per rank")
    if pp is not None and pp != len(rows):
        raise PlanFormatError(f"the CSV has {len(rows)} rows (ranks) but pp={pp}: give one row per stage")
    pp = len(rows)
    per_stage: list[list[tuple[OpKind, int]]] = []
    largest = -1
    # Rows repeat the same actions after their stage prefix: parse "F3" once (a 200k-row CSV has
    # ~10^6 cells). Only text the full parse below accepted is ever cached, so the result is the same,
    # and the largest micro-batch is among the parsed ones (every hit repeats one).
    parsed: dict[str, tuple[OpKind, int]] = {}
    for rank, row in enumerate(rows):
        actions = []
        prefix = str(rank)
        cut = len(prefix)
        for col, cell in enumerate(row):
            cell = cell.strip()
            if not cell:
                continue  # an idle step
            hit = parsed.get(cell[cut:]) if cell.startswith(prefix) else None
            if hit is not None:
                actions.append(hit)
                continue
            m = _ACTION_RE.fullmatch(cell)
            if not m or m["kind"] not in _FROM_TORCH or not m["mb"]:
                raise csv_not_an_action(rank, col, cell)
            stage = int(m["stage"])
            if stage != rank:  # several stages per rank (virtual stages): read by their own reader
                from schedcomp.torch_csv_virtual import virtual_order_from_rows

                return virtual_order_from_rows(rows, microbatches, dp, family)
            mb = int(m["mb"])
            largest = max(largest, mb)
            action = (_FROM_TORCH[m["kind"]], mb)
            if cell == prefix + m["kind"] + m["mb"]:
                parsed[m["kind"] + m["mb"]] = action
            actions.append(action)
        per_stage.append(actions)
    microbatches = csv_microbatches(largest, microbatches)
    try:
        topology = Topology.of(pp, dp)
    except LimitError:
        raise
    except SchedcompError as exc:
        raise PlanFormatError(str(exc)) from None
    limits.check_job(pp, dp, microbatches)  # before building dp x pp op tuples
    make = Op.trusted  # fields checked above: skip the frozen dataclass's per-field setattr
    ops = {
        Worker(d, s): tuple([make(kind, d, mb, s) for kind, mb in per_stage[s]]) for d in range(dp) for s in range(pp)
    }
    return Order(topology, microbatches, ops, family)
