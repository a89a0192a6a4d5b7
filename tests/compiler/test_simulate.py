"""The simulator: semantics on small hand-written plans, deadlocks, metrics, closed forms."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.errors import ValidationError
from schedcomp.ir import InstrKind, Instruction, Plan
from schedcomp.simulator import Simulation, simulate
from schedcomp.timeline import timeline_metrics
from schedcomp.topology import Topology, Worker


def make_plan(streams: dict[str, str], pp: int, dp: int = 1, microbatches: int = 2,
              costs: CostModel | None = None, failed: tuple = ()) -> Plan:
    """A plan from text streams, one string of instructions per worker."""
    parsed = {}
    for key, text in streams.items():
        w = Worker.parse(key)
        parsed[w] = tuple(Instruction.parse(x, w.stage) for x in text.split())
    return Plan(Topology.of(pp, dp, failed), costs or CostModel.uniform(pp), microbatches, parsed, family="hand")


# Two stages, two micro-batches, split backward, W right after B on stage 0 and deferred on stage 1.
TWO_STAGE = {
    "0:0": "LOAD[F0.0] F0.0 SEND_ACT[F0.0>0:1] LOAD[F1.0] F1.0 SEND_ACT[F1.0>0:1] "
           "RECV_GRAD[B0.0<0:1] B0.0 W0.0 RECV_GRAD[B1.0<0:1] B1.0 W1.0 ALLREDUCE STEP",
    "0:1": "RECV_ACT[F0.0<0:0] RECV_ACT[F1.0<0:0] LOAD[F0.0] F0.0 B0.0 SEND_GRAD[B0.0>0:0] "
           "LOAD[F1.0] F1.0 B1.0 SEND_GRAD[B1.0>0:0] W0.0 W1.0 ALLREDUCE STEP",
}


def span(sim: Simulation, worker: str, text: str, iteration: int = 0):
    w = Worker.parse(worker)
    found = [s for s in sim.spans if s.worker == w and s.iteration == iteration and str(s.instruction) == text]
    assert len(found) == 1, f"{text} on {worker}: {found}"
    return found[0]


def test_two_stage_unit_timeline():
    sim = simulate(make_plan(TWO_STAGE, 2), iterations=1)
    # stage 0: F0 [0,1] F1 [1,2]; stage 1: F0 [1,2] B0 [2,3]; stage 0: B0 [3,4] W0 [4,5]; ...
    assert (span(sim, "0:1", "F0.0").start, span(sim, "0:1", "F0.0").end) == (1, 2)
    assert span(sim, "0:0", "B0.0").start == 3
    assert span(sim, "0:0", "B1.0").start == 5
    assert span(sim, "0:1", "W1.0").end == 7
    assert sim.makespan == 7
    assert sim.period == 7  # one iteration: the makespan
    # 2 workers x 6 unit ops = 12 of 14 busy
    assert sim.bubble_ratio == pytest.approx(1 - 12 / 14)
    assert len(sim.spans) == sum(len(s) for s in make_plan(TWO_STAGE, 2).streams.values())


def test_p2p_latency_delays_consumers_and_spans_cover_the_transfer():
    costs = CostModel.uniform(2, p2p=0.5)
    sim = simulate(make_plan(TWO_STAGE, 2, costs=costs), iterations=1)
    send = span(sim, "0:0", "SEND_ACT[F0.0>0:1]")
    recv = span(sim, "0:1", "RECV_ACT[F0.0<0:0]")
    assert (send.start, send.end) == (1.0, 1.5)
    assert recv.start == 0.0 and recv.end == 1.5
    assert span(sim, "0:1", "F0.0").start == 1.5
    # the gradient comes back after another 0.5
    assert span(sim, "0:0", "B0.0").start == span(sim, "0:1", "B0.0").end + 0.5


def test_send_is_posted_when_its_producer_completes_not_when_the_stream_reaches_it():
    streams = {
        "0:0": "LOAD[F0.0] F0.0 LOAD[F1.0] F1.0 SEND_ACT[F0.0>0:1] SEND_ACT[F1.0>0:1] "
               "RECV_GRAD[BW0.0<0:1] BW0.0 RECV_GRAD[BW1.0<0:1] BW1.0 ALLREDUCE STEP",
        "0:1": "RECV_ACT[F0.0<0:0] RECV_ACT[F1.0<0:0] LOAD[F0.0] F0.0 BW0.0 SEND_GRAD[BW0.0>0:0] "
               "LOAD[F1.0] F1.0 BW1.0 SEND_GRAD[BW1.0>0:0] ALLREDUCE STEP",
    }
    sim = simulate(make_plan(streams, 2), iterations=1)
    assert span(sim, "0:0", "SEND_ACT[F0.0>0:1]").start == 1.0
    assert span(sim, "0:1", "F0.0").start == 1.0
    assert span(sim, "0:1", "BW0.0").end == 4.0  # fused backward costs B + W


def test_straggler_speed_factor_stretches_its_compute():
    costs = CostModel(forward=(1, 1), backward_input=(1, 1), backward_weight=(1, 1), speed={Worker(0, 1): 0.5})
    sim = simulate(make_plan(TWO_STAGE, 2, costs=costs), iterations=1)
    f = span(sim, "0:1", "F0.0")
    assert f.end - f.start == 2.0
    assert span(sim, "0:0", "F0.0").duration == 1.0
    assert sim.busy[Worker(0, 1)] == 12.0 and sim.busy[Worker(0, 0)] == 6.0


def test_staggered_optimizer_beats_a_global_barrier():
    # Stage 1's W costs 3, so stage 1 ends each iteration 4 units after stage 0:
    # iteration 0: stage 0 ends at 7, stage 1 at 11 (F0 1-2 B0 2-3 F1 3-4 B1 4-5 W 5-11).
    # Staggered, stage 0 runs ahead and stage 1 never waits again: period = its busy time 10.
    # With a barrier every iteration repeats iteration 0: period = makespan = 11.
    costs = CostModel(forward=(1, 1), backward_input=(1, 1), backward_weight=(1, 3))
    plan = make_plan(TWO_STAGE, 2, costs=costs)
    staggered = simulate(plan, iterations=6)
    barrier = simulate(plan, iterations=6, synchronous_optimizer=True)
    assert staggered.makespan == barrier.makespan == 11
    assert staggered.period == 10
    assert barrier.period == 11
    assert barrier.iteration_ends == (11, 22, 33, 44, 55, 66)
    # with the barrier nobody starts iteration k+1 before every worker finished iteration k
    for s in barrier.spans:
        if s.iteration > 0:
            assert s.start >= barrier.iteration_ends[s.iteration - 1]
    # staggered: stage 0 starts iteration 1 right after its own STEP, before stage 1 is done
    assert span(staggered, "0:0", "F0.0", 1).start == span(staggered, "0:0", "STEP", 0).end == 7


def test_allreduce_waits_for_the_slowest_member_and_steps_follow():
    streams = {
        "0:0": "LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP",
        "1:0": "LOAD[F0.1] F0.1 B0.1 W0.1 ALLREDUCE STEP",
    }
    costs = CostModel(forward=(1,), backward_input=(1,), backward_weight=(1,), allreduce=(2,), optimizer=(0.5,),
                      speed={Worker(1, 0): 0.5})
    sim = simulate(make_plan(streams, 1, dp=2, microbatches=1, costs=costs), iterations=3)
    fast, slow = span(sim, "0:0", "ALLREDUCE"), span(sim, "1:0", "ALLREDUCE")
    assert fast.start == slow.start == 6.0  # the straggler needs 6 for F+B+W
    assert fast.end == slow.end == 8.0
    assert span(sim, "0:0", "STEP").end == 8.5
    assert span(sim, "1:0", "STEP").end == 9.0  # the straggler steps at half speed too
    assert sim.period == 9.0


def test_allreduce_of_a_lone_worker_costs_nothing():
    streams = {"0:0": "LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP"}
    costs = CostModel(forward=(1,), backward_input=(1,), backward_weight=(1,), allreduce=(2,), optimizer=(0.5,))
    plan = make_plan(streams, 1, dp=2, microbatches=1, costs=costs, failed=((1, 0),))
    sim = simulate(plan, iterations=2, validate=False)
    assert span(sim, "0:0", "ALLREDUCE").duration == 0
    assert sim.period == 3.5


def test_deadlock_names_a_stuck_worker_and_instruction():
    # Stage 0 runs B0 before F0: it waits for a gradient that needs its own activation first.
    streams = {
        "0:0": "LOAD[F0.0] RECV_GRAD[B0.0<0:1] B0.0 F0.0 SEND_ACT[F0.0>0:1] W0.0 ALLREDUCE STEP",
        "0:1": "RECV_ACT[F0.0<0:0] LOAD[F0.0] F0.0 B0.0 SEND_GRAD[B0.0>0:0] W0.0 ALLREDUCE STEP",
    }
    with pytest.raises(ValidationError) as info:
        simulate(make_plan(streams, 2, microbatches=1), validate=False)
    err = info.value
    assert err.worker == Worker(0, 0) and err.index == 2
    msg = str(err)
    assert "deadlock" in msg and "0:0" in msg and "B0.0" in msg and "\n" not in msg
    assert "0:1" in err.grid and "F0.0" in err.grid


def test_deadlock_in_a_collective_is_reported():
    streams = {
        "0:0": "LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP",
        "1:0": "LOAD[F0.1] F0.1 B0.1 W0.1 ALLREDUCE ALLREDUCE STEP",
    }
    with pytest.raises(ValidationError, match="ALLREDUCE") as info:
        simulate(make_plan(streams, 1, dp=2, microbatches=1), iterations=2)
    assert info.value.worker in (Worker(0, 0), Worker(1, 0))


def test_barrier_over_data_parallel_workers_repeats_the_iteration():
    streams = {
        "0:0": "LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP",
        "1:0": "LOAD[F0.1] F0.1 B0.1 W0.1 ALLREDUCE STEP",
    }
    plan = make_plan(streams, 1, dp=2, microbatches=1)
    assert simulate(plan, iterations=3, synchronous_optimizer=True).period == 3


@pytest.mark.parametrize(
    ("streams", "pattern"),
    [
        ({"0:0": "LOAD[F0.0] F0.0 SEND_ACT[F0.0>0:1] B0.0 W0.0 ALLREDUCE STEP",
          "0:1": "LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP"}, "no matching receive"),
        ({"0:0": "LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP",
          "0:1": "RECV_ACT[F0.0<0:0] LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP"}, "no matching send"),
        ({"0:0": "LOAD[F0.0] F0.0 SEND_ACT[F0.0>0:1] B0.0 W0.0 ALLREDUCE STEP",
          "0:1": "LOAD[F0.0] F0.0 RECV_ACT[F0.0<0:0] B0.0 W0.0 ALLREDUCE STEP"}, "posted after"),
        ({"0:0": "LOAD[F0.0] SEND_ACT[F1.0>0:1] F0.0 B0.0 W0.0 ALLREDUCE STEP",
          "0:1": "RECV_ACT[F1.0<0:0] LOAD[F0.0] F0.0 B0.0 W0.0 ALLREDUCE STEP"}, "never runs"),
    ],
)
def test_broken_transfers_are_rejected(streams, pattern):
    with pytest.raises(ValidationError, match=pattern):
        simulate(make_plan(streams, 2, microbatches=2), validate=False)


def test_bad_iterations_and_empty_plans_are_rejected():
    with pytest.raises(ValidationError):
        simulate(make_plan(TWO_STAGE, 2), iterations=0)
    with pytest.raises(ValidationError):
        simulate(make_plan({"0:0": "", "0:1": ""}, 2))


def test_memory_follows_the_cost_model():
    costs = CostModel(forward=(1, 1), backward_input=(1, 1), backward_weight=(1, 1), activation=(2, 4), b_frees=0.25)
    sim = simulate(make_plan(TWO_STAGE, 2, costs=costs), iterations=3)
    # stage 0: F F -> 2 x 2 = 4; stage 1: F B F -> 4 - 1 + 4 = 7
    assert sim.memory == {Worker(0, 0): 4.0, Worker(0, 1): 7.0}
    assert sim.peak_memory == 7.0


def test_metrics_agree_with_the_spans_and_invariants_hold():
    for costs in (CostModel.uniform(2), CostModel(forward=(1, 2), backward_input=(2, 1), backward_weight=(0.5, 3),
                                                  p2p=0.25, allreduce=(1, 1), optimizer=(0.5, 2))):
        plan = make_plan(TWO_STAGE, 2, costs=costs)
        for sync in (False, True):
            sim = simulate(plan, iterations=5, synchronous_optimizer=sync)
            t = timeline_metrics(sim.spans, sim.workers)
            assert (t.makespan, t.period, t.iteration_ends) == (sim.makespan, sim.period, sim.iteration_ends)
            assert t.bubble_ratio == pytest.approx(sim.bubble_ratio)
            assert dict(t.busy) == pytest.approx(dict(sim.busy))
            assert max(sim.busy.values()) <= sim.period <= sim.makespan + 1e-9
            for w in sim.workers:  # blocking instructions of a worker never overlap
                blocking = [s for s in sim.spans_of(w) if s.instruction.kind not in
                            (InstrKind.SEND_ACT, InstrKind.SEND_GRAD, InstrKind.RECV_ACT, InstrKind.RECV_GRAD)]
                for a, b in itertools.pairwise(blocking):
                    assert a.end <= b.start + 1e-12
            assert all(s.end >= s.start and not math.isnan(s.start) for s in sim.spans)


def test_summary_is_plain_json():
    import json

    summary = simulate(make_plan(TWO_STAGE, 2)).summary()
    assert json.loads(json.dumps(summary)) == summary
    assert {"makespan", "period", "bubble_ratio", "peak_memory"} <= set(summary)


# ---- compiled plans ------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "period", "bubble", "memory"), [
    ("gpipe", 33, 9 / 33, 8), ("1f1b", 33, 9 / 33, 4), ("zb-h1", 27, 3 / 27, 4), ("zb-h2", 24, 0.0, 7),
])
def test_paper_closed_forms_at_pp4_m8(family, period, bubble, memory):
    sim = simulate(compile(4, microbatches=8, schedule=family))
    assert sim.period == period
    assert sim.bubble_ratio == pytest.approx(bubble)
    assert sim.peak_memory == memory


@pytest.mark.parametrize("family", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize(("pp", "m", "f", "b", "w"), [(3, 7, 1, 1, 1), (6, 12, 1, 2, 1), (5, 20, 2, 1.5, 0.5)])
def test_closed_forms_for_other_shapes_and_costs(family, pp, m, f, b, w):
    bubble = {"gpipe": (pp - 1) * (f + b + w), "1f1b": (pp - 1) * (f + b + w), "zb-h1": (pp - 1) * (f + b - w),
              "zb-h2": max(0.0, (pp - 1) * (f + b - 2 * w))}[family]
    sim = simulate(compile(pp, microbatches=m, schedule=family, costs=CostModel.uniform(pp, f, b, w)), iterations=6)
    assert sim.period == pytest.approx(m * (f + b + w) + bubble)


def test_zb_h2_needs_staggered_steps_for_zero_bubble():
    plan = compile(4, microbatches=8, schedule="zb-h2")
    assert simulate(plan, synchronous_optimizer=True).period == 27
    assert simulate(plan).period == 24


@given(family=st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2"]), pp=st.integers(1, 5), extra=st.integers(0, 5),
       dp=st.integers(1, 2), p2p=st.sampled_from([0.0, 0.3]), allreduce=st.sampled_from([0.0, 2.0]),
       optimizer=st.sampled_from([0.0, 0.5]), slow=st.sampled_from([1.0, 0.5]), sync=st.booleans())
def test_simulated_timelines_respect_the_semantics(family, pp, extra, dp, p2p, allreduce, optimizer, slow, sync):
    base = CostModel.uniform(pp, p2p=p2p, allreduce=allreduce, optimizer=optimizer)
    costs = CostModel(**{**base.__dict__, "speed": {Worker(dp - 1, pp - 1): slow}})
    plan = compile(pp, dp=dp, microbatches=2 * pp + extra, schedule=family, costs=costs)
    sim = simulate(plan, iterations=3, synchronous_optimizer=sync)
    t = timeline_metrics(sim.spans, sim.workers)
    assert (t.makespan, t.period, t.iteration_ends) == (sim.makespan, sim.period, sim.iteration_ends)
    assert max(sim.busy.values()) <= sim.period + 1e-9
    assert sim.period <= sim.makespan + 1e-9  # starting early never makes an iteration slower
    by_key = {(s.worker, s.iteration, s.index): s for s in sim.spans}
    sends = {}
    for s in sim.spans:
        ins = s.instruction
        if ins.kind in (InstrKind.SEND_ACT, InstrKind.SEND_GRAD):
            assert s.end == pytest.approx(s.start + p2p)
            sends[(s.iteration, ins.kind is InstrKind.SEND_ACT, ins.op.pipeline, ins.op.microbatch, s.worker,
                   ins.peer)] = s
    for s in sim.spans:
        ins = s.instruction
        if ins.kind in (InstrKind.RECV_ACT, InstrKind.RECV_GRAD):
            send = sends[(s.iteration, ins.kind is InstrKind.RECV_ACT, ins.op.pipeline, ins.op.microbatch, ins.peer,
                          s.worker)]
            assert s.end >= send.end - 1e-9
            consumer = next(by_key[(s.worker, s.iteration, j)] for j in range(s.index, len(plan.streams[s.worker]))
                            if plan.streams[s.worker][j].is_compute and plan.streams[s.worker][j].op == ins.op)
            assert consumer.start >= s.end - 1e-9
        if ins.is_compute:
            assert s.duration == pytest.approx(costs.compute_time(ins.kind.value, s.worker))
    # peak memory is the validator's
    from schedcomp.check import peak_memory

    assert sim.memory == pytest.approx(peak_memory(plan))


@given(family=st.sampled_from(["1f1b", "zb-h1", "zb-h2"]), pp=st.integers(2, 4), dp=st.integers(1, 2),
       data=st.data())
def test_corrupted_plans_fail_cleanly_and_agree_with_the_validator(family, pp, dp, data):
    from schedcomp.check import check

    plan = compile(pp, dp=dp, microbatches=2 * pp, schedule=family)
    worker = data.draw(st.sampled_from(plan.workers))
    stream = list(plan.streams[worker])
    i = data.draw(st.integers(0, len(stream) - 1))
    j = data.draw(st.integers(0, len(stream) - 1))
    if data.draw(st.booleans()):
        stream[i], stream[j] = stream[j], stream[i]  # reorder
    else:
        del stream[i]  # drop
    broken = Plan(plan.topology, plan.costs, plan.microbatches, {**plan.streams, worker: tuple(stream)}, family)
    try:
        check(broken)
        valid = True
    except ValidationError:
        valid = False
    try:
        simulate(broken, iterations=2)
        ran = True
    except ValidationError as exc:
        assert "\n" not in str(exc)
        ran = False
    assert ran or not valid  # whatever the validator accepts, the simulator runs


def test_blocking_instructions_before_compute_keep_inputs_aligned():
    # ALLREDUCE and STEP first (an odd but runnable order): the forward must still wait for its receive.
    streams = {
        "0:0": "ALLREDUCE STEP LOAD[F0.0] F0.0 SEND_ACT[F0.0>0:1] RECV_GRAD[BW0.0<0:1] BW0.0",
        "0:1": "ALLREDUCE STEP RECV_ACT[F0.0<0:0] LOAD[F0.0] F0.0 BW0.0 SEND_GRAD[BW0.0>0:0]",
    }
    costs = CostModel(forward=(1, 1), backward_input=(1, 1), backward_weight=(1, 1), optimizer=(0.5, 0.5))
    sim = simulate(make_plan(streams, 2, microbatches=1, costs=costs), iterations=1, validate=False)
    assert span(sim, "0:1", "F0.0").start == 1.5
    assert span(sim, "0:0", "BW0.0").start == 4.5


def test_spans_of_some_iterations_match_the_full_timeline():
    plan = make_plan(TWO_STAGE, 2, costs=CostModel.uniform(2, p2p=0.25, optimizer=1))
    first = simulate(plan, iterations=3).spans_in([2, 0])
    full = simulate(plan, iterations=3)
    assert first == tuple(s for s in full.spans if s.iteration in (0, 2))
    assert full.spans_in([1]) == tuple(s for s in full.spans if s.iteration == 1)
    assert full.spans_in([7]) == ()
