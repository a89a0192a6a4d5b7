"""The validator: sound plans pass; each kind of corruption is caught at the right worker and instruction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedcomp.check import check, memory_profile, peak_memory
from schedcomp.costs import CostModel
from schedcomp.errors import ValidationError
from schedcomp.ir import InstrKind, Instruction, Op, OpKind, Order, Plan
from schedcomp.lower import lower
from schedcomp.schedules import FAMILIES, ONE_STAGE_FAMILIES, fault_free_order
from schedcomp.topology import Topology, Worker

W = Worker.parse


def plan_of(name: str = "zb-h1", pp: int = 4, dp: int = 1, m: int = 8, **costs: float) -> Plan:
    return lower(fault_free_order(name, Topology(pp, dp), m), CostModel.uniform(pp, **costs))


def texts(plan: Plan, worker: Worker) -> list[str]:
    return [str(i) for i in plan.streams[worker]]


def at(plan: Plan, worker: str, text: str) -> int:
    return texts(plan, W(worker)).index(text)


def edit(plan: Plan, worker: str, stream: list[Instruction]) -> Plan:
    return replace(plan, streams={**plan.streams, W(worker): tuple(stream)})


def parse(worker: str, text: str) -> Instruction:
    return Instruction.parse(text, W(worker).stage)


def rejected(plan: Plan, worker: str | None, index: int | None, *words: str) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        check(plan)
    err = info.value
    assert (str(err.worker) if err.worker is not None else None, err.index) == (worker, index), str(err)
    message = str(err)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    if worker is not None and index is not None:
        assert f"worker {worker}, instruction {index} ({plan.streams[W(worker)][index]})" in message
    return err


@pytest.mark.parametrize("name", ONE_STAGE_FAMILIES)
@pytest.mark.parametrize(("pp", "dp"), [(1, 1), (2, 1), (4, 1), (4, 2), (3, 3)])
def test_family_plans_pass(name: str, pp: int, dp: int) -> None:
    check(plan_of(name, pp, dp, max(8, FAMILIES[name].min_microbatches(pp))))


def test_dropped_op() -> None:
    plan = plan_of()
    stream = list(plan.streams[W("0:1")])
    del stream[at(plan, "0:1", "F3.0")]
    bad = edit(plan, "0:1", stream)
    first = next(i for i, ins in enumerate(stream) if ins.op is not None and ins.op.key == (0, 3, 1))
    rejected(bad, "0:1", first, "no F for micro-batch 3 of pipeline 0 at stage 1")


def test_dropped_w_and_dropped_transfer() -> None:
    plan = plan_of()
    stream = list(plan.streams[W("0:2")])
    del stream[at(plan, "0:2", "W5.0")]
    rejected(edit(plan, "0:2", stream), "0:2", at(plan, "0:2", "B5.0"), "no W (nor BW) for micro-batch 5")
    stream = list(plan.streams[W("0:2")])
    del stream[at(plan, "0:2", "SEND_ACT[F5.0>0:3]")]
    rejected(edit(plan, "0:2", stream), "0:2", at(plan, "0:2", "F5.0"), "never sent")
    stream = list(plan.streams[W("0:3")])
    del stream[at(plan, "0:3", "RECV_ACT[F5.0<0:2]")]
    rejected(edit(plan, "0:3", stream), "0:2", at(plan, "0:2", "SEND_ACT[F5.0>0:3]"), "nobody receives")


def test_swapped_send_receive_pair() -> None:
    """The two ends of one transfer trade places: 0:1 now 'receives' what it should send."""
    plan = plan_of()
    i, j = at(plan, "0:1", "SEND_ACT[F2.0>0:2]"), at(plan, "0:2", "RECV_ACT[F2.0<0:1]")
    a, b = list(plan.streams[W("0:1")]), list(plan.streams[W("0:2")])
    a[i], b[j] = parse("0:1", "RECV_ACT[F2.0<0:2]"), parse("0:2", "SEND_ACT[F2.0>0:1]")
    bad = edit(edit(plan, "0:1", a), "0:2", b)
    rejected(bad, "0:2", j, "before (or without) running it")


def test_reordered_dependency_on_one_worker() -> None:
    plan = plan_of()
    stream = list(plan.streams[W("0:3")])
    f, b = at(plan, "0:3", "F0.0"), at(plan, "0:3", "B0.0")
    stream[f], stream[b] = stream[b], stream[f]
    rejected(edit(plan, "0:3", stream), "0:3", f, "runs before F0.0", "activations")
    stream = list(plan.streams[W("0:0")])
    b, w = at(plan, "0:0", "B2.0"), at(plan, "0:0", "W2.0")
    stream[b], stream[w] = stream[w], stream[b]
    rejected(edit(plan, "0:0", stream), "0:0", b, "runs before B2.0")


def test_receive_after_its_consumer() -> None:
    plan = plan_of()
    stream = list(plan.streams[W("0:1")])
    recv = stream.pop(at(plan, "0:1", "RECV_ACT[F5.0<0:0]"))
    consumer = [str(i) for i in stream].index("F5.0")
    stream.insert(consumer + 1, recv)
    rejected(edit(plan, "0:1", stream), "0:1", consumer + 1, "posted after its consumer F5.0")


def test_send_before_its_producer() -> None:
    plan = plan_of("1f1b")
    stream = list(plan.streams[W("0:2")])
    send = stream.pop(at(plan, "0:2", "SEND_GRAD[BW1.0>0:1]"))
    producer = [str(i) for i in stream].index("BW1.0")
    stream.insert(producer, send)
    rejected(edit(plan, "0:2", stream), "0:2", producer, "before (or without) running it")


def test_duplicated_op() -> None:
    plan = plan_of()
    stream = list(plan.streams[W("0:2")])
    b = at(plan, "0:2", "B3.0")
    stream.insert(b + 1, stream[b])
    rejected(edit(plan, "0:2", stream), "0:2", b + 1, "runs twice", "instruction " + str(b))


def test_fifo_violation_on_a_channel() -> None:
    """Both receives are posted before their consumers, but not in the order 0:0 sends them."""
    plan = plan_of()
    stream = list(plan.streams[W("0:1")])
    i, j = at(plan, "0:1", "RECV_ACT[F0.0<0:0]"), at(plan, "0:1", "RECV_ACT[F1.0<0:0]")
    stream[i], stream[j] = stream[j], stream[i]
    rejected(edit(plan, "0:1", stream), "0:1", min(i, j), "receive #0 from 0:0", "SEND_ACT[F0.0>0:1]")


def test_fifo_violations_on_two_channels_name_the_first_by_sender_then_receiver() -> None:
    """The scan meets channel 0:2 -> 0:1 (gradients, at receiver 0:1) before 0:1 -> 0:2 (activations, at 0:2);
    the one reported is the first in (sender, receiver) order, whatever order the channels were met in."""
    plan = plan_of("gpipe")
    down = list(plan.streams[W("0:1")])
    i, j = at(plan, "0:1", "RECV_GRAD[BW0.0<0:2]"), at(plan, "0:1", "RECV_GRAD[BW1.0<0:2]")
    down[i], down[j] = down[j], down[i]
    up = list(plan.streams[W("0:2")])
    k, n = at(plan, "0:2", "RECV_ACT[F0.0<0:1]"), at(plan, "0:2", "RECV_ACT[F1.0<0:1]")
    up[k], up[n] = up[n], up[k]
    rejected(edit(plan, "0:1", down), "0:1", i, "receive #0 from 0:2")  # each alone is caught
    both = edit(edit(plan, "0:1", down), "0:2", up)
    rejected(both, "0:2", k, "receive #0 from 0:1", "SEND_ACT[F0.0>0:2]")


def test_fifo_violation_from_swapped_sends() -> None:
    """The sender reorders its forwards; the receiver's (unchanged) receives no longer match."""
    plan = plan_of("gpipe")
    stream = list(plan.streams[W("0:1")])
    a, b = at(plan, "0:1", "F3.0"), at(plan, "0:1", "F4.0")
    stream[a : a + 2], stream[b : b + 2] = stream[b : b + 2], stream[a : a + 2]  # receives stay where they were
    assert [str(i) for i in stream[a : b + 2]] == [
        "F4.0", "SEND_ACT[F4.0>0:2]", "RECV_ACT[F5.0<0:0]", "F3.0", "SEND_ACT[F3.0>0:2]"
    ]
    rejected(edit(plan, "0:1", stream), "0:2", at(plan, "0:2", "RECV_ACT[F3.0<0:1]"), "receive #3 from 0:1")


def test_wrong_peer() -> None:
    plan = plan_of(dp=2)
    stream = list(plan.streams[W("1:1")])
    i = at(plan, "1:1", "SEND_ACT[F2.1>1:2]")
    stream[i] = parse("1:1", "SEND_ACT[F2.1>0:2]")
    rejected(edit(plan, "1:1", stream), "1:1", i, "goes to 0:2", "runs on 1:2")


def test_repeated_and_misrouted_transfers() -> None:
    """Each transfer rule names its own failure, at the transfer that breaks it."""
    plan = plan_of(dp=2)
    stream = list(plan.streams[W("0:1")])
    i = at(plan, "0:1", "SEND_ACT[F2.0>0:2]")
    stream.insert(i + 1, stream[i])
    rejected(edit(plan, "0:1", stream), "0:1", i + 1, f"sends the same tensor twice (first at instruction {i})")
    stream = list(plan.streams[W("0:2")])
    j = at(plan, "0:2", "RECV_ACT[F2.0<0:1]")
    stream.insert(j + 1, stream[j])
    rejected(edit(plan, "0:2", stream), "0:2", j + 1, f"receives the same tensor twice (first at instruction {j})")
    stream = list(plan.streams[W("0:2")])
    stream[j] = parse("0:2", "RECV_ACT[F2.0<0:3]")
    rejected(edit(plan, "0:2", stream), "0:2", j, "receives from 0:3", "input runs on 0:1")
    stream = list(plan.streams[W("1:2")])
    k = at(plan, "1:2", "RECV_ACT[F2.1<1:1]")
    stream[k] = Instruction(InstrKind.RECV_ACT, Op(OpKind.F, 0, 2, 2), W("1:1"))
    rejected(edit(plan, "1:2", stream), "1:2", k, "receives for F2.0, which does not run on this worker")


def test_the_first_broken_transfer_in_stream_order_is_reported() -> None:
    """Sends are checked before receives, each side in stream order (worker, then index), whichever rule breaks."""
    plan = plan_of(dp=2)
    late = list(plan.streams[W("1:1")])
    i = at(plan, "1:1", "SEND_ACT[F2.1>1:2]")
    late[i] = parse("1:1", "SEND_ACT[F2.1>0:2]")  # goes to the wrong worker
    early = list(plan.streams[W("0:2")])
    j = at(plan, "0:2", "SEND_ACT[F4.0>0:3]")
    early.insert(j + 1, early[j])  # sent twice, on an earlier worker
    recv = list(plan.streams[W("0:1")])
    k = at(plan, "0:1", "RECV_ACT[F2.0<0:0]")
    recv[k] = parse("0:1", "RECV_ACT[F2.0<0:3]")  # a receive from the wrong worker, on the earliest worker
    bad = edit(edit(edit(plan, "1:1", late), "0:2", early), "0:1", recv)
    rejected(bad, "0:2", j + 1, "sends the same tensor twice")
    rejected(edit(bad, "0:2", list(plan.streams[W("0:2")])), "1:1", i, "goes to 0:2")
    rejected(edit(edit(bad, "0:2", list(plan.streams[W("0:2")])), "1:1", list(plan.streams[W("1:1")])),
             "0:1", k, "receives from 0:3")


def test_memory_limit_overflow() -> None:
    plan = plan_of("zb-h2")
    profile = memory_profile(plan, W("0:0"))
    assert max(profile) == 7 == peak_memory(plan)[W("0:0")]
    bad = replace(plan, costs=plan.costs.with_memory_limit(6.5))
    first = next(i for i, held in enumerate(profile) if held > 6.5)
    assert texts(plan, W("0:0"))[first] == "F6.0"
    rejected(bad, "0:0", first, "holds 7 activation units", "memory_limit 6.5", "to 7")
    check(replace(plan, costs=plan.costs.with_memory_limit(7)))


def test_deadlock() -> None:
    """Stage 0 waits for BW0's gradient before sending F1; stage 1 wants F1 before it runs BW0."""
    topo = Topology(2)
    ops = {
        W("0:0"): tuple(Op(k, 0, m, 0) for k, m in [(OpKind.F, 0), (OpKind.BW, 0), (OpKind.F, 1), (OpKind.BW, 1)]),
        W("0:1"): tuple(Op(k, 0, m, 1) for k, m in [(OpKind.F, 0), (OpKind.F, 1), (OpKind.BW, 0), (OpKind.BW, 1)]),
    }
    plan = lower(Order(topo, 2, ops, "hand"), CostModel.uniform(2))
    err = rejected(plan, "0:0", at(plan, "0:0", "BW0.0"), "deadlock", "0:1", "SEND_GRAD[BW0.0>0:0]")
    assert "F1.0" in str(err)


def test_memory_helpers() -> None:
    plan = plan_of("1f1b", pp=4, m=8)
    peaks = peak_memory(plan)
    assert [peaks[W(f"0:{s}")] for s in range(4)] == [4, 3, 2, 1]
    profile = memory_profile(plan, W("0:0"))
    assert len(profile) == len(plan.streams[W("0:0")]) and profile[-1] == 0
    half = memory_profile(plan_of("zb-h1", b_frees=0.5), W("0:3"))
    assert max(half) == 2.5  # the last stage holds back W, so B's half-frees pile up


@pytest.mark.parametrize(
    ("corrupt", "worker", "words"),
    [
        (lambda s: [i for i in s if i.kind is not InstrKind.LOAD or str(i.op) != "F2.0"], "0:0", ["LOAD[F2.0]"]),
        (lambda s: s[:-1], "0:2", ["STEP"]),
        (lambda s: [*s[:-2], s[-1], s[-2]], "0:2", ["STEP before ALLREDUCE"]),
        (lambda s: [*s[:-2], Instruction.compute(Op(OpKind.W, 0, 9, 0)), *s[-2:]], None, ["micro-batches 0..7"]),
    ],
)
def test_other_rules(corrupt, worker: str | None, words: list[str]) -> None:
    plan = plan_of()
    target = worker or "0:0"
    bad = edit(plan, target, corrupt(list(plan.streams[W(target)])))
    with pytest.raises(ValidationError) as info:
        check(bad)
    assert worker is None or str(info.value.worker) == worker
    for word in words:
        assert word in str(info.value)


def test_workers_must_be_live_and_have_streams() -> None:
    plan = plan_of(dp=2)
    streams = dict(plan.streams)
    streams.pop(W("1:3"))
    rejected(replace(plan, streams=streams), "1:3", None, "no stream")
    failed = replace(plan, topology=Topology.of(4, 2, [(1, 3)]))
    rejected(failed, "1:3", None, "not a live worker")
    streams = dict(plan.streams)
    streams[Worker(1.0, 3)] = streams.pop(W("1:3"))  # type: ignore[arg-type]  # workers are numbered by integers
    rejected(replace(plan, streams=streams), "1.0:3", None, "not a live worker")


def test_op_at_the_wrong_stage() -> None:
    plan = plan_of()
    stream = list(plan.streams[W("0:1")])
    i = at(plan, "0:1", "F4.0")
    stream[i] = Instruction.compute(Op(OpKind.F, 0, 4, 2))
    rejected(edit(plan, "0:1", stream), "0:1", i, "names stage 2")


def test_f_b_w_on_different_workers() -> None:
    plan = plan_of(dp=2)
    a, b = list(plan.streams[W("0:1")]), list(plan.streams[W("1:1")])
    w = a.pop(at(plan, "0:1", "W3.0"))
    b.insert(len(b) - 2, w)
    bad = edit(edit(plan, "0:1", a), "1:1", b)
    rejected(bad, "1:1", len(b) - 3, "its F runs on 0:1")


def test_grid_marks_the_bad_cell() -> None:
    plan = plan_of()
    stream = list(plan.streams[W("0:2")])
    b = at(plan, "0:2", "B3.0")
    stream.insert(b + 1, stream[b])
    with pytest.raises(ValidationError) as info:
        check(edit(plan, "0:2", stream))
    grid = info.value.grid.splitlines()
    assert [cell.strip() for cell in grid[0].split(" | ")] == ["step", "0:0", "0:1", "0:2", "0:3"]
    marked = [line for line in grid if ">>B3.0<<" in line]
    assert len(marked) == 1 and marked[0].startswith(str(b + 1))


def test_a_plan_beyond_the_job_limits_is_refused_in_one_line() -> None:
    """The validator's op table is sized by the job's slots: a hand-made plan claiming 2^40 micro-batches
    gets a LimitError, not an allocation of terabytes."""
    from schedcomp.errors import LimitError

    with pytest.raises(LimitError, match="micro-batches, over the limit"):
        check(replace(plan_of(), microbatches=2**40))


def test_op_fields_that_are_not_whole_numbers_are_refused() -> None:
    # A float op field that equals no whole number (0.5 * 4 + 0 lands on micro-batch 2's slot) would be
    # counted as that real op: refused with the worker and the instruction named, never rounded.
    import dataclasses

    from schedcomp.compiler import compile

    plan = compile(2, 1, 4, schedule="1f1b")

    def odd(ins):
        op = ins.op
        if op is None or (op.pipeline, op.microbatch) != (0, 2):
            return ins
        return dataclasses.replace(ins, op=dataclasses.replace(op, pipeline=0.5, microbatch=0))

    bad = dataclasses.replace(plan, streams={w: tuple(odd(i) for i in s) for w, s in plan.streams.items()})
    with pytest.raises(ValidationError, match="must be whole numbers"):
        check(bad)
