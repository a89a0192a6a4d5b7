"""Plan repair (`schedcomp.repair`): one more failed worker, a valid plan by a local re-route."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from schedcomp.check import check, peak_memory
from schedcomp.cli import main
from schedcomp.compiler import compile
from schedcomp.errors import RecoveryError, SchedcompTypeError, ScheduleError, TopologyError
from schedcomp.ir import COMPUTE_KINDS, Plan
from schedcomp.memory import stage_peak_memory
from schedcomp.repair import repair
from schedcomp.repair_place import compute_ops
from schedcomp.simulator import simulate
from schedcomp.topology import Worker

W = Worker.parse

# (compile arguments, workers to fail next, repair arguments): small jobs whose local re-route validates.
CASES = [
    ({"pp": 3, "dp": 3, "microbatches": 4, "schedule": "1f1b"}, ["0:0", "1:1", "2:2"], {}),
    # (ZB-H2 holds its peers' memory full: re-routed here only past it)
    ({"pp": 4, "dp": 2, "microbatches": 8, "schedule": "zb-h2"}, ["0:0", "1:3"], {"memory_limit": None}),
    ({"pp": 4, "dp": 3, "microbatches": 6, "failed": [(0, 1)], "memory_limit": None}, ["1:1", "2:0", "0:3"], {}),
    ({"pp": 8, "dp": 4, "microbatches": 16, "failed": [(0, 3), (1, 5)]}, ["0:6", "1:4", "2:7"], {}),
]


def stage_peaks(plan: Plan) -> tuple[float, ...]:
    """The most activation memory any worker of each stage holds in `plan`."""
    return stage_peak_memory(peak_memory(plan), plan.topology.pp)


def slots_of(plan: Plan) -> Counter[tuple[object, int, int, int]]:
    """How often each compute op (kind, pipeline, micro-batch, stage) runs, over all streams."""
    return Counter((ins.kind, ins.op.pipeline, ins.op.microbatch, ins.op.stage)
                   for stream in plan.streams.values() for ins in stream if ins.kind in COMPUTE_KINDS and ins.op)


@pytest.mark.parametrize(("kw", "workers", "options"), CASES, ids=lambda x: str(x))
def test_repair_validates_and_runs_every_op_once(kw: dict[str, object], workers: list[str],
                                                 options: dict[str, object]) -> None:
    plan = compile(**kw)  # type: ignore[arg-type]
    ops = slots_of(plan)
    for name in workers:
        dead = W(name)
        fixed = repair(plan, dead, validate=False, **options)  # type: ignore[arg-type]
        check(fixed)  # sound: transfers paired in FIFO order, no deadlock, memory within the plan's limit
        assert fixed.topology.failed == plan.topology.failed | {dead} and dead not in fixed.streams
        assert slots_of(fixed) == ops and set(ops.values()) == {1}  # every op of every micro-batch, once
        # the plan's costs, with its memory limit, or a fault-free plan's own per-stage peaks
        assert replace(fixed.costs, memory_limit=None) == replace(plan.costs, memory_limit=None)
        assert fixed.costs.memory_limit == (plan.costs.memory_limit if plan.topology.failed or options
                                            else stage_peaks(plan))
        assert fixed.solver == "repair" and fixed.lower_bound is None
        touched = {w for w in plan.streams if w != dead and fixed.streams[w] is not plan.streams[w]}
        neighbours = {ins.peer for ins in plan.streams[dead] if ins.peer is not None}
        # Local: only peers of the dead worker's stage and its neighbours are lowered again.
        assert touched and all(w.stage == dead.stage or w in neighbours for w in touched)
        assert all(fixed.streams[w] is plan.streams[w] for w in fixed.streams if w not in touched)
        assert simulate(fixed).period >= simulate(plan).period  # the same work on fewer workers


def test_a_repaired_fault_free_plan_holds_no_more_than_its_stage_held() -> None:
    """A fault-free plan carries no memory limit; its repair keeps each stage within the plan's own peaks
    (without that, a peer took the dead worker's micro-batches on top of its own: twice the memory)."""
    plan = compile(pp=4, dp=2, microbatches=4, schedule="adaptive", time_limit=1.0)
    assert plan.costs.memory_limit is None
    limit, over, repaired = stage_peaks(plan), 0, 0
    for dead in plan.streams:
        try:
            fixed = repair(plan, dead)
        except RecoveryError as e:
            assert "memory" in str(e)
        else:
            repaired += 1
            peaks = peak_memory(fixed)
            assert all(peaks[w] <= limit[w.stage] + 1e-9 for w in fixed.streams), (dead, peaks)
        unbounded = peak_memory(repair(plan, dead, memory_limit=None))
        over += any(unbounded[w] > limit[w.stage] + 1e-9 for w in unbounded)
    assert over and repaired  # the default limit made a difference, and some repairs keep to it


def test_repair_validates_by_default_and_chains() -> None:
    plan = compile(pp=4, dp=3, microbatches=6, failed=[(0, 1)], memory_limit=None)
    twice = repair(repair(plan, (1, 1)), "2:0")  # a pair, then a "d:s" string: both name workers
    assert twice.topology.failed == {W("0:1"), W("1:1"), W("2:0")}
    check(twice)
    assert slots_of(twice) == slots_of(plan)


def test_bad_input_is_one_clear_error() -> None:
    plan = compile(pp=2, dp=2, microbatches=4, failed=[(0, 1)])
    with pytest.raises(TopologyError, match=r"worker 5:0 is not in the job: pipelines are 0\.\.1, stages 0\.\.1"):
        repair(plan, (5, 0))
    with pytest.raises(TopologyError, match="worker 0:1 has failed already"):
        repair(plan, W("0:1"))
    with pytest.raises(RecoveryError, match=r"1:1 was the last live worker of stage 1.*checkpoint"):
        repair(plan, (1, 1))
    with pytest.raises(SchedcompTypeError, match="bad failed worker"):
        repair(plan, 3)  # type: ignore[arg-type]
    with pytest.raises(SchedcompTypeError, match="repair needs a Plan"):
        repair("plan.json", (1, 0))  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="one stage per worker, not chunks=2"):
        repair(compile(pp=2, dp=2, microbatches=4, schedule="zb-v"), (1, 0))
    recut = compile(pp=4, dp=8, microbatches=8, failed=[(3, 1)], recut=True, memory_limit=None)
    assert recut.cut  # (the case: re-cut pieces)
    with pytest.raises(ScheduleError, match="re-cut ones"):
        repair(recut, (2, 1))
    untimed = Plan(plan.topology, plan.costs, plan.microbatches, {w: s[:-1] for w, s in plan.streams.items()})
    with pytest.raises(ScheduleError, match="repair edits plans as `lower` makes them"):
        repair(untimed, (0, 0))  # no STEP tail: no timeline to place re-routed ops on


def test_where_forwards_waiting_for_memory_would_deadlock_the_pipeline_goes_last() -> None:
    """Every peer of stage 1 sits at the fault-free memory limit all along: the re-routed forwards could only
    wait for memory past their consumers, which deadlocks. The fallback runs pipeline 2's ops after every other
    op on the lanes that run them beside others', the failed worker's slots after all of their peers' ops, each
    lane's in the order of the plan's timeline: a valid plan within the limit, slower until a compile replaces
    it."""
    plan = compile(pp=4, dp=3, microbatches=8, failed=[(1, 2)])
    fixed = repair(plan, (2, 1))  # (checked)
    assert slots_of(fixed) == slots_of(plan)
    for lane in (W("0:1"), W("1:1")):  # the peers that took 2:1's slots, pipeline 2's now after all their own
        pipelines = [op.pipeline for op in compute_ops(fixed.streams[lane])]
        assert 2 in pipelines and pipelines == sorted(pipelines, key=lambda d: d == 2)
    limit = fixed.costs.limit_at(1)
    assert max(peak_memory(fixed)[w] for w in (W("0:1"), W("1:1"))) <= limit * (1 + 1e-9)
    assert simulate(fixed).period > simulate(plan).period


def test_no_peer_with_memory_is_a_recovery_error() -> None:
    # 1:1 ran pipeline 0's stage-1 slots beside its own (0:1 failed); the last peer of stage 1, 2:1, holds its
    # own and its share of pipeline 0's: after them, 1:1's do not fit its limit either.
    plan = compile(pp=4, dp=3, microbatches=6, failed=[(0, 1)])
    with pytest.raises(RecoveryError, match=r"no live peer of 1:1 at stage 1 has the memory.*compile the plan"):
        repair(plan, (1, 1))


# Small jobs (pp 3-8, dp 2-4): fault-free families and adaptive plans with 0-2 failures, at each plan's default
# memory limit. The first local re-route left 4 of their 118 single repairs deadlocked (e.g. 1:2 of the
# fourth); placed on one timeline, none does.
SWEEP = [
    {"pp": 3, "dp": 3, "microbatches": 4, "schedule": "1f1b"},
    {"pp": 4, "dp": 2, "microbatches": 8, "schedule": "zb-h2"},
    {"pp": 4, "dp": 3, "microbatches": 8, "schedule": "zb-h1"},
    {"pp": 4, "dp": 4, "microbatches": 8, "failed": [(0, 1), (2, 3)]},
    {"pp": 6, "dp": 3, "microbatches": 8},
    {"pp": 8, "dp": 2, "microbatches": 8, "schedule": "1f1b"},
]


@pytest.mark.parametrize("kw", SWEEP, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_every_repair_validates_or_is_refused_for_memory(kw: dict[str, object]) -> None:
    plan = compile(**kw)  # type: ignore[arg-type]
    outcomes = Counter()
    for dead in sorted(plan.streams):
        if len(plan.topology.stage_group(dead.stage)) < 2:
            continue  # the last of its stage: a checkpoint's job (test_bad_input_is_one_clear_error)
        try:
            fixed = repair(plan, dead, validate=False)
        except RecoveryError as exc:  # memory is the only reason to refuse (found short, or waited for)
            assert "memory" in str(exc)
            outcomes["memory"] += 1
            continue
        check(fixed)  # never a deadlock, transfers paired, memory within the limit
        assert slots_of(fixed) == slots_of(plan)
        outcomes["valid"] += 1
    assert outcomes["valid"] > 0


def test_without_a_memory_limit_every_repair_validates_and_chains() -> None:
    plan = compile(pp=4, dp=4, microbatches=8, failed=[(0, 1), (2, 3)], memory_limit=None)
    for dead in sorted(plan.streams):
        check(repair(plan, dead, validate=False))
    chained = plan
    for dead in ("1:2", "3:0", "2:1", "0:3"):  # each repair hands the next its timeline (no timing again)
        chained = repair(chained, W(dead), validate=False)
        check(chained)
    assert slots_of(chained) == slots_of(plan)


def test_cli_repair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved, out = tmp_path / "plan.json", tmp_path / "repaired.json"
    assert main(["compile", "--pp", "4", "--dp", "3", "-m", "6", "--fail", "0:1", "--memory-limit", "none",
                 "-o", str(saved)]) == 0
    capsys.readouterr()
    assert main(["repair", str(saved), "--fail", "1:1", "--fail", "2:0", "-o", str(out), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["failed"] == ["0:1", "1:1", "2:0"] and facts["solver"] == "repair" and facts["period"] > 0
    repaired = Plan.from_json(out.read_text())
    check(repaired)
    assert repaired.topology.failed == {W("0:1"), W("1:1"), W("2:0")}
    for argv, message in ((["--fail", "0:1"], "worker 0:1 has failed already"),
                          (["--fail", "7:0"], "worker 7:0 is not in the job"),
                          ([], "name the newly failed worker")):
        assert main(["repair", str(saved), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_lookup_or_repair_serves_failure_sets_beyond_the_cache() -> None:
    from schedcomp.cache import precompile
    from schedcomp.repair import lookup_or_repair

    cache = precompile(3, 3, 4, 1, memory_limit=None)  # every set of at most one failed worker
    one = lookup_or_repair(cache, [(0, 0)])
    assert one.topology.failed == {W("0:0")} and one.solver != "repair"  # a hit: the cached plan itself
    two = lookup_or_repair(cache, [(1, 1), (0, 0)])  # a miss: 0:0's cached plan, repaired around 1:1
    assert two.topology.failed == {W("0:0"), W("1:1")} and two.solver == "repair"
    check(two)
    assert slots_of(two) == slots_of(one)
    with pytest.raises(RecoveryError, match="last live worker of stage 0"):
        lookup_or_repair(cache, [(0, 0), (1, 0), (2, 0)])


def test_the_timeline_orders_every_stream_and_dependency_before_and_after_a_repair() -> None:
    from schedcomp.ir import Op, OpKind
    from schedcomp.optimes import op_times

    plan = compile(pp=4, dp=3, microbatches=6, failed=[(0, 1)])
    fixed = repair(plan, W("2:2"), validate=False)
    for p in (plan, fixed):
        times = op_times(p)
        assert times is not None
        for stream in p.streams.values():  # each stream runs its ops in the order of their times
            ts = [times.of(ins.op) for ins in stream if ins.kind in COMPUTE_KINDS and ins.op]
            assert ts == sorted(ts) and len(set(ts)) == len(ts)
        for stream in p.streams.values():  # and each op after what it reads from another stage
            for ins in stream:
                op = ins.op
                if ins.kind in COMPUTE_KINDS and op and op.kind is OpKind.F and op.stage > 0:
                    assert times.of(op) > times.of(Op(OpKind.F, op.pipeline, op.microbatch, op.stage - 1))
                if ins.kind in COMPUTE_KINDS and op and op.kind is OpKind.B and op.stage < 3:
                    assert times.of(op) > times.of(Op(OpKind.B, op.pipeline, op.microbatch, op.stage + 1))
    assert op_times(fixed) is op_times(fixed)  # kept with the plan: a further repair needs no timing


def test_chained_repairs_at_the_memory_limit_stay_sound() -> None:
    # Repairs that made forwards wait for memory hand on a re-timed timeline, the others an edited one.
    plan = compile(pp=4, dp=4, microbatches=8, failed=[(0, 1)])
    done = 0
    for dead in ("1:2", "3:0", "2:1", "0:3", "2:2"):
        try:
            plan = repair(plan, W(dead), validate=False)
        except RecoveryError as exc:
            assert "memory" in str(exc)
            continue
        check(plan)
        done += 1
    assert done >= 2


def test_cli_repair_takes_a_memory_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(compile(pp=4, dp=3, microbatches=6, failed=[(0, 1)]).to_json())
    assert main(["repair", str(plan_file), "--fail", "1:1"]) == 2  # its own limit: no room
    assert "memory" in capsys.readouterr().err
    assert main(["repair", str(plan_file), "--fail", "1:1", "--memory-limit", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["repair_seconds"] >= 0
