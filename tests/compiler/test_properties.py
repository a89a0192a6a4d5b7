"""Properties over families, pp, M, dp, chunks and random cost models (hypothesis).

Every compiled plan validates, round-trips through JSON and the text form, agrees with the
simulator on memory; every random corruption of it is rejected.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedcomp.check import check, peak_memory
from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, ValidationError
from schedcomp.ir import COMPUTE_KINDS, RECV_KINDS, SEND_KINDS, InstrKind, Instruction, Plan
from schedcomp.schedules import FAMILIES, ONE_STAGE_FAMILIES
from schedcomp.simulator import simulate
from schedcomp.topology import Worker

times = st.floats(0.1, 5.0, allow_nan=False)


@st.composite
def cost_models(draw: st.DrawFn, pp: int, dp: int, chunks: int = 1) -> CostModel:
    def per_stage(values: st.SearchStrategy[float]) -> list[float]:  # one per virtual stage
        return draw(st.lists(values, min_size=pp * chunks, max_size=pp * chunks))

    workers = [Worker(d, s) for d in range(dp) for s in range(pp)]
    slow = draw(st.lists(st.sampled_from(workers), max_size=2, unique=True))
    return CostModel(
        forward=per_stage(times),
        backward_input=per_stage(times),
        backward_weight=per_stage(times),
        p2p=draw(st.sampled_from([0.0, 0.05, 0.5, 2.0])),
        allreduce=per_stage(st.floats(0.0, 2.0)),
        optimizer=per_stage(st.floats(0.0, 2.0)),
        activation=per_stage(st.floats(0.25, 4.0)),
        b_frees=draw(st.floats(0.0, 1.0)),
        speed={w: draw(st.floats(0.25, 2.0)) for w in slow},
    )


@st.composite
def configs(draw: st.DrawFn) -> tuple[str, int, int, int, CostModel]:
    name = draw(st.sampled_from(ONE_STAGE_FAMILIES))
    pp = draw(st.integers(1, 8))
    dp = draw(st.integers(1, 3))
    m = FAMILIES[name].min_microbatches(pp) + draw(st.integers(0, 6))
    return name, pp, dp, m, draw(cost_models(pp, dp))


@st.composite
def chunked_configs(draw: st.DrawFn) -> tuple[str, int, int, int, CostModel]:
    """Families with virtual stages; the chunks are the cost model's stages over pp."""
    name = draw(st.sampled_from([n for n in FAMILIES if n not in ONE_STAGE_FAMILIES]))
    pp = draw(st.integers(1, 6))
    dp = draw(st.integers(1, 3))
    chunks = 2 if name == "zb-v" else draw(st.integers(1, 3))
    m = draw(st.integers(pp, 3 * pp) if name == "interleaved-1f1b" else st.integers(1, 3 * pp))
    if name == "interleaved-1f1b":
        m -= m % max(1, m // pp)  # equal rounds (PyTorch's rule)
    return name, pp, dp, m, draw(cost_models(pp, dp, chunks))


any_configs = st.one_of(configs(), chunked_configs())


def compiled(config: tuple[str, int, int, int, CostModel]) -> Plan:
    name, pp, dp, m, costs = config
    return compile(pp, dp, m, schedule=name, costs=costs, chunks=costs.pp // pp)


@given(any_configs)
def test_compiled_plans_validate_and_round_trip(config) -> None:
    plan = compiled(config)
    check(plan)
    again = Plan.from_json(plan.to_json())
    assert again == plan
    check(again)
    assert Plan.from_text(plan.to_text()) == plan
    sim = simulate(plan, iterations=2)
    peaks = peak_memory(plan)
    assert sim.peak_memory == pytest.approx(max(peaks.values()))
    assert sim.period >= max(sim.busy.values()) - 1e-6


@given(any_configs, st.sampled_from([0.5, 0.9, 0.999, 1.0, 1.25]))
def test_memory_limit_is_met_or_refused(config, fraction: float) -> None:
    name, pp, dp, m, costs = config
    need = max(peak_memory(compiled(config)).values())
    limit = need * fraction
    if limit >= need:
        plan = compile(pp, dp, m, schedule=name, costs=costs, memory_limit=limit, chunks=costs.pp // pp)
        assert max(peak_memory(plan).values()) <= limit
    else:
        with pytest.raises(MemoryLimitError, match=f"memory_limit >= {need:g}"):
            compile(pp, dp, m, schedule=name, costs=costs, memory_limit=limit, chunks=costs.pp // pp)


CORRUPTIONS = ["drop", "duplicate", "late receive", "wrong peer", "backward first", "tight memory"]


@given(any_configs, st.sampled_from(CORRUPTIONS), st.randoms(use_true_random=False))
def test_random_corruptions_are_rejected(config, how: str, rnd) -> None:
    plan = compiled(config)
    workers = sorted(plan.streams)
    w = rnd.choice(workers)
    stream = list(plan.streams[w])
    where: set[tuple[Worker, int] | Worker] = set()
    if how in ("drop", "duplicate"):
        i = rnd.randrange(len(stream))
        if how == "drop":
            removed = stream.pop(i)
            where = {w} | ({removed.peer} if removed.peer else set())
        else:
            stream.insert(i + 1, stream[i])
            where = {(w, i + 1)}
    elif how == "late receive":
        recvs = [i for i, ins in enumerate(stream) if ins.kind in RECV_KINDS]
        if not recvs:
            return
        i = rnd.choice(recvs)
        recv = stream.pop(i)
        consumer = next(j for j, ins in enumerate(stream) if ins.is_compute and ins.op == recv.op)
        stream.insert(consumer + 1, recv)
        where = {(w, consumer + 1)}
    elif how == "wrong peer":
        transfers = [i for i, ins in enumerate(stream) if ins.kind in SEND_KINDS | RECV_KINDS]
        if not transfers or len(workers) < 3:
            return
        i = rnd.choice(transfers)
        other = rnd.choice([v for v in workers if v not in (w, stream[i].peer)])
        stream[i] = Instruction(stream[i].kind, stream[i].op, other)
        where = {(w, i)}
    elif how == "backward first":
        compute = [i for i, ins in enumerate(stream) if ins.kind in COMPUTE_KINDS and ins.kind is not InstrKind.F]
        i = rnd.choice(compute)
        op = stream[i].op
        before = next(j for j, ins in enumerate(stream) if ins.is_compute and ins.op.key == op.key)
        stream.insert(before, stream.pop(i))  # a B, W or BW moved in front of the first op of its slot
        where = {(w, before)}
    else:
        need = max(peak_memory(plan).values())
        bad = replace(plan, costs=plan.costs.with_memory_limit(need * 0.9))
        with pytest.raises(ValidationError, match="above memory_limit"):
            check(bad)
        return
    bad = replace(plan, streams={**plan.streams, w: tuple(stream)})
    with pytest.raises(ValidationError) as info:
        check(bad)
    err = info.value
    assert "\n" not in str(err)
    assert (err.worker, err.index) in where or err.worker in where, (how, str(err))
