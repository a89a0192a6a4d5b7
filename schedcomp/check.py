"""The validator: proves a `Plan` keeps the semantics in design.md, or says where it does not.

`check(plan)` raises `ValidationError(message, worker, index, grid)` at the first rule broken,
in this order: live workers and stages; exactly one F, B and W (or BW) per (pipeline,
micro-batch, stage), on one worker, in dependency order; loads; transfers (each send after its
producer, each receive before its consumer, right peers, matched one to one); FIFO order per
channel; ALLREDUCE then STEP at the end; no deadlock; memory within the limit.

The scan is one pass over the streams into plain dicts; the deadlock check is a Kahn pass over
the wait-for graph (stream order, send -> consumer, one node per stage's ALLREDUCE), walked
stream by stream. A send counts as posted when its stream reaches the SEND instruction (the
runtime posts it there), which is never earlier than its producer.
"""

from __future__ import annotations

from collections import deque
from typing import NoReturn

from schedcomp.errors import ValidationError
from schedcomp.ir import COMPUTE_KINDS, SEND_KINDS, InstrKind, Instruction, OpKind, Plan
from schedcomp.topology import Worker

Key = tuple[int, int, int]  # (pipeline, microbatch, stage)
Tensor = tuple[str, int, int, int]  # ("act" | "grad", pipeline, microbatch, producing stage)
Where = tuple[Worker, int]  # (worker, instruction index)

__all__ = ["check", "memory_profile", "peak_memory"]

_EPS = 1e-9
_BACKWARD = (OpKind.B, OpKind.BW)


def check(plan: Plan) -> None:
    """Raise `ValidationError` if `plan` breaks a rule the runtime relies on; return None if it is sound."""
    _Checker(plan).run()


def memory_profile(plan: Plan, worker: Worker) -> tuple[float, ...]:
    """Activation memory `worker` holds after each instruction of its stream."""
    deltas = _deltas(plan, worker.stage)
    held, out = 0.0, []
    for ins in plan.streams[worker]:
        if ins.op is not None and ins.kind in COMPUTE_KINDS:
            held += deltas[ins.op.kind]
        out.append(held)
    return tuple(out)


def peak_memory(plan: Plan) -> dict[Worker, float]:
    """The most activation memory each worker holds at any point of an iteration."""
    return {w: max((0.0, *memory_profile(plan, w))) for w in plan.workers}


def _deltas(plan: Plan, stage: int) -> dict[OpKind, float]:
    return {k: plan.costs.memory_delta(k.value, stage) for k in OpKind}


class _Checker:
    """One validation run: the scan's indexes, then one method per rule."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.pp = plan.topology.pp
        self.comp: dict[tuple[OpKind, Key], Where] = {}
        self.sends: list[tuple[Worker, int, Instruction]] = []
        self.recvs: list[tuple[Worker, int, Instruction]] = []
        self.loads: dict[Key, Where] = {}
        self.over: dict[Worker, tuple[int, float]] = {}  # first index above the memory limit
        self.sent: dict[Tensor, Where] = {}
        self.received: dict[Tensor, tuple[Where, int]] = {}  # tensor -> (receive, its consumer's index)
        self.out: dict[tuple[Worker, Worker], list[Tensor]] = {}  # channel -> tensors in send order
        self.into: dict[tuple[Worker, Worker], list[tuple[Tensor, int]]] = {}  # channel -> receives in order

    def run(self) -> None:
        self.scan()
        self.exactly_once()
        self.loads_present()
        self.transfers()
        self.fifo()
        self.tails()
        self.deadlock()
        self.memory()

    def fail(self, worker: Worker | None, index: int | None, problem: str) -> NoReturn:
        where = "" if worker is None else f"worker {worker}"
        if worker is not None and index is not None and worker in self.plan.streams:
            stream = self.plan.streams[worker]
            where += f", instruction {index} ({stream[index]})" if index < len(stream) else f", instruction {index}"
        message = f"{where}: {problem}" if where else problem
        raise ValidationError(message, worker, index, _grid(self.plan, worker, index))

    # ---- the scan -----------------------------------------------------------------------

    def scan(self) -> None:
        plan, topo = self.plan, self.plan.topology
        dp, mbs, limit = topo.dp, plan.microbatches, plan.costs.memory_limit
        for w in plan.streams:
            if not isinstance(w, Worker) or not topo.is_live(w):
                who = w if isinstance(w, Worker) else None
                self.fail(who, None, f"stream for {w}, which is not a live worker of the topology: drop it")
        for w in topo.live_workers:
            if w not in plan.streams:
                self.fail(w, None, "live worker has no stream: give it one (at least ALLREDUCE then STEP)")
        for w in sorted(plan.streams):
            deltas, held = _deltas(plan, w.stage), 0.0
            for i, ins in enumerate(plan.streams[w]):
                op, kind = ins.op, ins.kind
                if op is None:
                    continue
                if op.stage != w.stage:
                    self.fail(w, i, f"names stage {op.stage} but {w} runs stage {w.stage}")
                if not (0 <= op.pipeline < dp and 0 <= op.microbatch < mbs):
                    self.fail(w, i, f"no such micro-batch: pipelines are 0..{dp - 1}, micro-batches 0..{mbs - 1}")
                if kind in COMPUTE_KINDS:
                    slot = (op.kind, op.key)
                    if slot in self.comp:
                        first = self.comp[slot]
                        self.fail(w, i, f"{op} runs twice (first on {first[0]} at instruction {first[1]}): keep one")
                    self.comp[slot] = (w, i)
                    held += deltas[op.kind]
                    if limit is not None and held > limit + _EPS and w not in self.over:
                        self.over[w] = (i, held)
                elif kind is InstrKind.LOAD:
                    if op.kind is not OpKind.F or 0 < w.stage < self.pp - 1:
                        self.fail(w, i, "LOAD only feeds a forward at the first or last stage: drop it")
                    if op.key in self.loads:
                        self.fail(w, i, f"{op} is loaded twice (first at instruction {self.loads[op.key][1]})")
                    self.loads[op.key] = (w, i)
                elif kind in SEND_KINDS:
                    self.sends.append((w, i, ins))
                else:
                    self.recvs.append((w, i, ins))

    # ---- exactly once, same worker, dependency order --------------------------------------

    def exactly_once(self) -> None:
        topo, get = self.plan.topology, self.comp.get
        for d in range(topo.dp):
            for m in range(self.plan.microbatches):
                for s in range(self.pp):
                    key = (d, m, s)
                    f, b, w, bw = (get((kind, key)) for kind in (OpKind.F, OpKind.B, OpKind.W, OpKind.BW))
                    name = f"micro-batch {m} of pipeline {d} at stage {s}"
                    if f is None:
                        self.missing(key, f"no F for {name}: every (pipeline, micro-batch, stage) needs exactly one F")
                    if bw is not None and (b is not None or w is not None):
                        later = max(x for x in (b, w, bw) if x is not None)
                        self.fail(*later, f"{name} has both BW and split B/W: use one or the other")
                    if bw is None and (b is None or w is None):
                        lack, after = ("B", f) if b is None else ("W", b)
                        self.fail(*after, f"no {lack} (nor BW) for {name}: add it after this op, on this worker")
                    for other in (b, w, bw):
                        if other is not None and other[0] != f[0]:
                            self.fail(*other, f"runs on {other[0]} but its F runs on {f[0]}: activations are local")
                    for first, then, why in ((f, b, "a B needs its F's activations"),
                                             (b, w, "a W needs the gradient its B computes"),
                                             (f, bw, "a BW needs its F's activations")):
                        if first is not None and then is not None and then[1] < first[1]:
                            before = self.plan.streams[first[0]][first[1]]
                            self.fail(*then, f"runs before {before} (instruction {first[1]}): {why}")

    def missing(self, key: Key, problem: str) -> NoReturn:
        """Fail for a missing op: at the first instruction naming its slot, on the worker that has one."""
        topo = self.plan.topology
        for w in [*sorted(self.plan.streams), None]:
            if w is None:
                home = Worker(key[0], key[2])
                self.fail(home if topo.is_live(home) else None, None, problem)
            for i, ins in enumerate(self.plan.streams[w]):
                if ins.op is not None and ins.op.key == key:
                    self.fail(w, i, problem)

    def loads_present(self) -> None:
        for (kind, key), (w, i) in self.comp.items():
            if kind is OpKind.F and (key[2] == 0 or key[2] == self.pp - 1):
                load = self.loads.get(key)
                if load is None or load[0] != w or load[1] > i:
                    self.fail(w, i, f"needs LOAD[{self.plan.streams[w][i]}] earlier in this stream (inputs/targets)")
        for key, (w, i) in self.loads.items():
            if (OpKind.F, key) not in self.comp:
                self.fail(w, i, "loads a micro-batch no forward here uses: drop it")

    # ---- transfers --------------------------------------------------------------------------

    def transfers(self) -> None:
        """Check every send and receive and pair them up (dicts keep the scan's stream order)."""
        pp, comp = self.pp, self.comp
        sent, received, out, into = self.sent, self.received, self.out, self.into
        F = OpKind.F
        for w, i, ins in self.sends:
            op, peer = ins.op, ins.peer
            key = op.key
            d, m, s = key
            act = ins.kind is InstrKind.SEND_ACT
            if act and (op.kind is not F or s == pp - 1):
                self.fail(w, i, "SEND_ACT names the F whose output goes to the next stage (none at the last stage)")
            if not act and (op.kind not in _BACKWARD or s == 0):
                self.fail(w, i, "SEND_GRAD names the B or BW whose input gradient goes back (none at stage 0)")
            producer = comp.get((op.kind, key))
            if producer is None or producer[0] != w or producer[1] > i:
                self.fail(w, i, f"sends the output of {op} before (or without) running it here: move it after {op}")
            target = comp.get((F, (d, m, s + 1 if act else s - 1)))
            if target is None or target[0] != peer:
                expect = "nobody" if target is None else target[0]
                self.fail(w, i, f"goes to {peer} but the consumer of {op}'s output runs on {expect}")
            tensor = ("act" if act else "grad", d, m, s)
            if tensor in sent:
                self.fail(w, i, f"sends the same tensor twice (first at instruction {sent[tensor][1]}): keep one")
            sent[tensor] = (w, i)
            out.setdefault((w, peer), []).append(tensor)
        for w, j, ins in self.recvs:
            op, peer = ins.op, ins.peer
            key = op.key
            d, m, s = key
            act = ins.kind is InstrKind.RECV_ACT
            if act and (op.kind is not F or s == 0):
                self.fail(w, j, "RECV_ACT names the F that consumes the previous stage's output (none at stage 0)")
            if not act and (op.kind not in _BACKWARD or s == pp - 1):
                self.fail(w, j, "RECV_GRAD names the B or BW that consumes the next stage's gradient (none last)")
            consumer = comp.get((op.kind, key))
            if consumer is None or consumer[0] != w:
                self.fail(w, j, f"receives for {op}, which does not run on this worker")
            if consumer[1] < j:
                self.fail(w, j, f"posted after its consumer {op} (instruction {consumer[1]}): post it before")
            source = comp.get((F, (d, m, s - 1 if act else s + 1)))
            if source is None or source[0] != peer:
                expect = "nobody" if source is None else source[0]
                self.fail(w, j, f"receives from {peer} but the producer of {op}'s input runs on {expect}")
            tensor = ("act", d, m, s - 1) if act else ("grad", d, m, s + 1)
            if tensor in received:
                self.fail(w, j, f"receives the same tensor twice (first at instruction {received[tensor][0][1]})")
            received[tensor] = ((w, j), consumer[1])
            into.setdefault((peer, w), []).append((tensor, j))
        for (kind, (d, m, s)), (w, i) in comp.items():
            if kind is F and s < pp - 1 and ("act", d, m, s) not in sent:
                self.fail(w, i, "its output is never sent to the next stage: add a SEND_ACT after it")
            if kind in _BACKWARD and s > 0 and ("grad", d, m, s) not in sent:
                self.fail(w, i, "its input gradient is never sent to the previous stage: add a SEND_GRAD after it")
        for tensor, (w, i) in sent.items():
            if tensor not in received:
                self.fail(w, i, f"nobody receives it: add the matching receive to {self.plan.streams[w][i].peer}")

    def fifo(self) -> None:
        """NCCL pairs sends and receives between two ranks in posting order: both ends must agree."""
        for (x, y), got in sorted(self.into.items()):
            expected = self.out[(x, y)]
            for n, (tensor, j) in enumerate(got):
                if expected[n] != tensor:
                    send = self.plan.streams[x][self.sent[expected[n]][1]]
                    self.fail(y, j, f"is receive #{n} from {x}, but {x}'s send #{n} to {y} is {send}: "
                                    "post receives in the order the peer sends")

    def tails(self) -> None:
        for w in sorted(self.plan.streams):
            stream = self.plan.streams[w]
            n = len(stream)
            reduce = [i for i, ins in enumerate(stream) if ins.kind is InstrKind.ALLREDUCE]
            step = [i for i, ins in enumerate(stream) if ins.kind is InstrKind.STEP]
            rule = "a stream ends with exactly one ALLREDUCE then one STEP, after all its other instructions"
            if not reduce or not step:
                self.fail(w, n - 1 if n else None, f"no {'ALLREDUCE' if not reduce else 'STEP'}: {rule}")
            if len(reduce) > 1 or len(step) > 1:
                self.fail(w, reduce[1] if len(reduce) > 1 else step[1], f"repeated: {rule}")
            if step[0] < reduce[0]:
                self.fail(w, step[0], f"STEP before ALLREDUCE: {rule}")
            if (reduce[0], step[0]) != (n - 2, n - 1):
                extra = reduce[0] + 1 if step[0] != reduce[0] + 1 else step[0] + 1
                self.fail(w, extra, f"comes after ALLREDUCE: {rule}")

    # ---- deadlock -----------------------------------------------------------------------

    def deadlock(self) -> None:
        """Kahn's pass over the wait-for graph, walked stream by stream.

        The graph's edges are stream order, send -> consumer, and one shared node per stage's
        ALLREDUCE. Each worker advances until a compute op's input has not been sent yet (its
        sender has not reached the SEND) or it reaches ALLREDUCE before the rest of its stage
        group; it resumes when that changes. Whoever cannot finish waits on a cycle.
        """
        streams = self.plan.streams
        inputs: dict[Worker, dict[int, Tensor]] = {w: {} for w in streams}
        outputs: dict[Worker, dict[int, Tensor]] = {w: {} for w in streams}
        for tensor, ((y, _), c) in self.received.items():
            inputs[y][c] = tensor
        for tensor, (x, i) in self.sent.items():
            outputs[x][i] = tensor
        group = {s: sum(1 for w in streams if w.stage == s) for s in range(self.pp)}
        pos = dict.fromkeys(streams, 0)
        reached: set[Tensor] = set()
        parked: dict[Tensor, Worker] = {}  # tensor -> the worker waiting for it
        arrived: dict[int, set[Worker]] = {s: set() for s in range(self.pp)}  # at each stage's ALLREDUCE
        todo = deque(sorted(streams))
        while todo:
            w = todo.popleft()
            stream, need, give, i = streams[w], inputs[w], outputs[w], pos[w]
            while i < len(stream):
                tensor = need.get(i)
                if tensor is not None and tensor not in reached:
                    parked[tensor] = w
                    break
                tensor = give.get(i)
                if tensor is not None:
                    reached.add(tensor)
                    if tensor in parked:
                        todo.append(parked.pop(tensor))
                elif stream[i].kind is InstrKind.ALLREDUCE:
                    here = arrived[w.stage]
                    if w not in here:
                        here.add(w)
                        if len(here) == group[w.stage]:
                            todo.extend(v for v in here if v != w)
                    if len(here) < group[w.stage]:
                        break
                i += 1
            pos[w] = i
        stuck = {w for w in streams if pos[w] < len(streams[w])}
        if stuck:
            self.report_cycle(stuck, pos, inputs, self.sent, arrived)

    def report_cycle(self, stuck: set[Worker], pos: dict[Worker, int], inputs: dict[Worker, dict[int, Tensor]],
                     sent: dict[Tensor, Where], arrived: dict[int, set[Worker]]) -> NoReturn:
        """Follow 'waits for' from stuck worker to stuck worker until one repeats, and name that cycle."""
        streams = self.plan.streams

        def blocker(w: Worker) -> tuple[Worker, str]:
            i = pos[w]
            tensor = inputs[w].get(i)
            if tensor is not None:
                x, j = sent[tensor]
                return x, f"{x} instruction {j} ({streams[x][j]})"
            late = min(v for v in stuck if v.stage == w.stage and v not in arrived[w.stage])
            return late, f"{late} to reach ALLREDUCE"

        w, walk = min(stuck), []
        while w not in walk:
            walk.append(w)
            w = blocker(w)[0]
        cycle = walk[walk.index(w) :]
        first = cycle.index(min(cycle))
        cycle = cycle[first:] + cycle[:first]
        steps = [f"{v} instruction {pos[v]} ({streams[v][pos[v]]}) waits for {blocker(v)[1]}" for v in cycle]
        self.fail(cycle[0], pos[cycle[0]],
                  f"deadlock: {'; '.join(steps)}; each of those comes after the next one's wait in its stream: "
                  "reorder the ops")

    def memory(self) -> None:
        limit = self.plan.costs.memory_limit
        for w, (i, held) in sorted(self.over.items()):
            peak = max(memory_profile(self.plan, w))
            self.fail(w, i, f"holds {held:g} activation units, above memory_limit {limit:g}: raise the limit "
                            f"to {peak:g} or use a schedule that holds fewer micro-batches")


def _grid(plan: Plan, worker: Worker | None, index: int | None, rows: int = 6, cols: int = 3) -> str:
    """A step x worker picture of the streams around the bad cell, which is marked >>like this<<."""
    workers = sorted(w for w in plan.streams if isinstance(w, Worker))
    if not workers:
        return ""
    at = workers.index(worker) if worker in plan.streams else 0
    shown = workers[max(0, at - cols) : at + cols + 1]
    mid = index if index is not None else 0
    steps = range(max(0, mid - rows), min(max(len(plan.streams[w]) for w in shown), mid + rows + 1))

    def cell(w: Worker, i: int) -> str:
        stream = plan.streams[w]
        text = str(stream[i]) if i < len(stream) else ""
        return f">>{text}<<" if (w == worker and i == index) else text

    table = [[str(i), *(cell(w, i) for w in shown)] for i in steps]
    header = ["step", *(str(w) for w in shown)]
    widths = [max(len(r[c]) for r in [header, *table]) for c in range(len(header))]

    def line(row: list[str]) -> str:
        return " | ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()

    rule = "-" * (sum(widths) + 3 * (len(widths) - 1))
    return "\n".join([line(header), rule, *(line(r) for r in table)])
