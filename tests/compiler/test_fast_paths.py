"""`lower` and `check` over columns give the answers the per-instruction code gave.

`tests/compiler/data/fast_paths.json` holds, for a fixed corpus of small plans and their random corruptions
(`tests/support/fast_path_corpus.py`: families, chunks, adaptive plans with failures, re-cut, layers; broken
streams and broken compute orders), what the code answered before `lower`, the validator's scan and its
deadlock pass were rewritten: each sound plan's JSON and transfer tables (digests) and each refusal's exact
message. The rewrite must give every one of them again.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from fast_path_corpus import PLANS, compiled, order_of, verdicts
from hypothesis import given
from hypothesis import strategies as st

from schedcomp import check as checking
from schedcomp import lower as lowering
from schedcomp.check import check, index_of
from schedcomp.compiler import compile
from schedcomp.errors import ValidationError
from schedcomp.ir import Op, Plan, stream_texts
from schedcomp.lower_columns import _suffix_min_by_group, lower_streams
from schedcomp.repair import repair
from schedcomp.schedules import FAMILIES
from schedcomp.serialize import plan_to_json
from schedcomp.simfast import compute_sequences
from schedcomp.streamcolumns import EditedStreams, LoweredStreams, columns_of, json_lists
from schedcomp.topology import Worker

GOLDEN = Path(__file__).parent / "data" / "fast_paths.json"


def test_same_verdicts_as_before() -> None:
    expected = json.loads(GOLDEN.read_text())
    got = verdicts()
    assert got.keys() == expected.keys()
    differ = [name for name in expected if got[name] != expected[name]]
    assert not differ, "\n".join(f"{n}:\n  was {expected[n]}\n  now {got[n]}" for n in differ[:5])
    assert sum(v.startswith("ok ") for v in got.values()) >= 40  # the corpus has sound plans ...
    assert sum("deadlock" in v for v in got.values()) >= 5  # ... and deadlocks among its refusals


@pytest.mark.parametrize(("pp", "dp", "failed"), [(4, 3, [(0, 1), (2, 3)]), (1, 2, [])])
def test_index_order_runs_every_stream_to_its_end(pp: int, dp: int, failed: list[tuple[int, int]]) -> None:
    """The deadlock pass's order of (worker, stop) segments reaches the end of every stream, never goes
    back, and lets no worker pass ALLREDUCE before its whole stage group reached it (also with one stage,
    where streams hold no transfers)."""
    plan = compile(pp, dp=dp, microbatches=6, failed=failed, solver="greedy")
    index = index_of(plan)
    assert index is not None
    at = {w: 0 for w in plan.streams}
    reduce_at = {w: len(s) - 2 for w, s in plan.streams.items()}
    for w, stop in index.order:
        assert stop >= at[w]
        if stop > reduce_at[w]:  # passes ALLREDUCE: its group is there
            assert all(at[v] >= reduce_at[v] for v in plan.streams if v.stage == w.stage and v != w)
        at[w] = stop
    assert at == {w: len(s) for w, s in plan.streams.items()}


@pytest.mark.parametrize("name", [name for name, _ in PLANS])
def test_columns_lower_as_op_by_op(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sound order of the corpus takes the column path, and the op-by-op path gives the same streams."""
    plan = compiled(name)
    order = order_of(plan)
    assert lower_streams(order, ()) is not None
    fast = lowering.lower(order, plan.costs)
    monkeypatch.setattr(lowering, "lower_streams", lambda order, tail: None)
    slow = lowering.lower(order, plan.costs)
    assert fast.streams == slow.streams
    assert list(fast.streams) == list(slow.streams)
    assert fast.to_json() == slow.to_json()


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 50)), max_size=40))
def test_suffix_minimum_stays_in_its_group(items: list[tuple[int, int]]) -> None:
    """FIFO post times: per item, the least value among it and the later items of its (contiguous) group."""
    items.sort(key=lambda item: item[0])  # groups contiguous, values in any order within them
    groups = np.array([g for g, _ in items], dtype=np.int64)
    values = np.array([v for _, v in items], dtype=np.int64)
    expected = [min(v for g, v in items[k:] if g == items[k][0]) for k in range(len(items))]
    assert _suffix_min_by_group(values, groups).tolist() == expected


@st.composite
def jobs(draw: st.DrawFn) -> dict[str, object]:
    """A small job of any family, or an adaptive one with failed workers (and maybe re-cut)."""
    pp, dp = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    if dp > 1 and pp > 1 and draw(st.booleans()):
        workers = [(d, s) for d in range(dp) for s in range(pp)]
        failed = draw(st.lists(st.sampled_from(workers), min_size=1, max_size=dp - 1, unique_by=lambda w: w[0]))
        return {"pp": pp, "dp": dp, "microbatches": draw(st.integers(1, 6)), "failed": failed, "solver": "greedy",
                "recut": draw(st.booleans())}
    name = draw(st.sampled_from(sorted(FAMILIES)))
    chunks = 2 if name == "zb-v" else draw(st.integers(1, 2)) if name == "interleaved-1f1b" else None
    m = pp * draw(st.integers(1, 2)) if name == "interleaved-1f1b" else max(FAMILIES[name].min_microbatches(pp), 1)
    return {"pp": pp, "dp": dp, "microbatches": m + (0 if name == "interleaved-1f1b" else draw(st.integers(0, 4))),
            "schedule": name, **({"chunks": chunks} if chunks else {})}


@given(jobs())
def test_columns_lower_random_jobs_as_op_by_op(kw: dict[str, object]) -> None:
    plan = compile(**kw)  # type: ignore[arg-type]
    order = order_of(plan)
    fast = lower_streams(order, ())
    assert fast is not None
    original = lowering.lower_streams
    try:
        lowering.lower_streams = lambda order, tail: None  # type: ignore[assignment]
        slow = lowering.lower(order, plan.costs)
    finally:
        lowering.lower_streams = original
    assert {w: s + slow.streams[w][-2:] for w, s in fast.items()} == slow.streams


def test_columns_refuse_op_kinds_that_are_only_equal_to_opkind() -> None:
    """`OpKind` is a str enum: an order whose kinds are plain strings ("F") is not the op-by-op path's
    `OpKind.F` (`is`), so the column path leaves it to that path, whose plan `check` refuses as before."""
    from dataclasses import replace

    from schedcomp.check import check
    from schedcomp.errors import ValidationError

    plan = compile(2, dp=1, microbatches=2, schedule="1f1b")
    order = order_of(plan)
    texts = replace(order, ops={w: [replace(op, kind=op.kind.value) for op in ops] for w, ops in order.ops.items()})
    assert lower_streams(texts, ()) is None
    with pytest.raises(ValidationError, match=r"instruction 0 \(F0.0\): needs LOAD\[F0.0\] earlier"):
        check(lowering.lower(texts, plan.costs))


def _index_facts(plan: Plan) -> tuple[object, ...]:
    index = index_of(plan)
    assert index is not None
    return (sorted(index.sent.items()), sorted(index.received.items()), sorted(index.consumed.items()),
            list(index.order))


def _walked(plan: Plan) -> Plan:
    """`plan` with its streams as a plain dict: `check` walks its instructions."""
    walked = dataclasses.replace(plan, streams=dict(plan.streams))
    assert columns_of(walked.streams) is None
    check(walked)
    return walked


@pytest.mark.parametrize("name", [name for name, _ in PLANS])
def test_sound_plans_are_scanned_over_their_columns(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lowered plan's scan is settled by its columns, with the walk's tables (and so its index)."""
    plan = compiled(name)
    walked = _walked(plan)
    fresh = dataclasses.replace(plan)  # (not yet checked; its streams keep their columns)
    assert columns_of(fresh.streams) is not None

    def walk(checker: object) -> None:
        raise AssertionError("the walk ran on a sound lowered plan")

    monkeypatch.setattr(checking, "walk", walk)
    check(fresh)
    assert _index_facts(fresh) == _index_facts(walked)


@given(jobs())
def test_columns_scan_random_jobs_as_the_walk(kw: dict[str, object]) -> None:
    plan = compile(**kw)  # type: ignore[arg-type]
    assert columns_of(plan.streams) is not None
    walked = _walked(plan)
    assert _index_facts(plan) == _index_facts(walked)
    assert plan.to_json() == walked.to_json()  # (a plan with one chunk per worker: texts from the columns)
    ours, theirs = compute_sequences(plan), compute_sequences(walked)  # (the simulator's op ids: off the columns)
    assert ours == theirs if ours is None or theirs is None else (ours[0] == theirs[0] and ours[1] == theirs[1]
                                                                  and list(ours[1]) == list(theirs[1]))


@pytest.mark.parametrize("name", [name for name, _ in PLANS])
def test_json_lists_from_columns_are_the_instructions_texts(name: str) -> None:
    plan = compiled(name)
    columns = columns_of(plan.streams)
    assert columns is not None
    for sep in (", ", ","):
        lists = json_lists(columns, sep, batch=3)  # (batches that split the workers unevenly)
        assert lists is not None
        got = dict(lists)
        assert list(got) == sorted(plan.streams)
        assert got == {w: json.dumps(stream_texts(stream), separators=(sep, ":")) for w, stream in plan.streams.items()}
    plain = dataclasses.replace(plan, streams=dict(plan.streams))
    assert plan.to_json() == plain.to_json()
    assert plan_to_json(plan, indent=False) == plan_to_json(plain, indent=False)


def test_json_lists_of_streams_without_a_tail() -> None:
    """A list whose last text is an instruction's, not the tail's, as `json` writes it."""
    columns = columns_of(compile(3, dp=2, microbatches=2, failed=[(1, 1)], solver="greedy").streams)
    assert columns is not None
    bare = dataclasses.replace(columns, tail=())
    lists = json_lists(bare, ", ")
    assert lists is not None
    ops = np.empty(int(columns.ops.ends[-1]), object)  # (the order's ops in a row)
    ops[:] = columns.ops.make(0, len(ops))
    assert dict(lists) == {w: json.dumps(stream_texts(s)) for w, s in LoweredStreams(bare, ops).items()}


def test_lowered_streams_are_read_only_and_copy_to_dicts() -> None:
    """A lowered plan's streams are made from its columns when read, one worker's or all at once, the same
    either way; the mapping cannot be changed, and a copy or a pickle of the plan holds a plain dict."""
    plan = compile(3, dp=2, microbatches=4, failed=[(1, 1)], solver="greedy")
    streams = plan.streams
    assert isinstance(streams, LoweredStreams) and columns_of(streams) is not None
    one_by_one = {w: streams[w] for w in reversed(list(streams))}  # each made alone, in another order
    again = compile(3, dp=2, microbatches=4, failed=[(1, 1)], solver="greedy").streams
    assert dict(again.items()) == one_by_one and list(again) == list(streams)  # all at once: the same
    assert all(streams[w] is one_by_one[w] for w in streams)  # made once
    for copied in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert type(copied.streams) is dict and copied.streams == streams and list(copied.streams) == list(streams)
    with pytest.raises(TypeError):
        streams[Worker(0, 0)] = ()  # type: ignore[index]
    assert type(plan.streams) is LoweredStreams and len(streams) == 5 and Worker(1, 1) not in streams


def test_a_broken_lowered_plan_is_named_by_the_walk() -> None:
    """A rule of the scan broken in a plan that keeps its columns (a memory limit below its peak): the column
    scan leaves it to the walk, whose message names the worker and instruction."""
    plan = compile(4, dp=1, microbatches=8, schedule="1f1b")
    tight = dataclasses.replace(plan, costs=plan.costs.with_memory_limit(2.0))
    assert columns_of(tight.streams) is not None
    message = r"worker 0:0, instruction 7 \(F2.0\): holds 3 activation units, above memory_limit 2"
    with pytest.raises(ValidationError, match=message):
        check(tight)


def test_repair_of_a_lowered_plan_makes_only_the_streams_it_touches() -> None:
    """`repair` of a lowered plan reads the streams of the failed worker, its neighbours and the peers that
    take its slots; its result reads every other stream from the plan when read: the same streams as
    repairing the plan with its streams in a dict."""
    plan = compile(8, dp=4, microbatches=6, failed=[(0, 1)], solver="greedy")
    other = compile(8, dp=4, microbatches=6, failed=[(0, 1)], solver="greedy")
    plain = dataclasses.replace(other, streams=dict(other.streams))  # (reads every stream of the other)
    repaired, expected = repair(plan, (2, 2), validate=False), repair(plain, (2, 2))
    made = plan.streams._made  # type: ignore[attr-defined]
    assert 0 < len(made) <= len(plan.streams) // 2  # (14 of the 31 live workers' streams, not all)
    check(repaired)  # (the walk: it reads them all)
    assert isinstance(repaired.streams, EditedStreams) and Worker(2, 2) not in repaired.streams
    assert list(repaired.streams) == list(expected.streams) and repaired.streams == expected.streams
    assert repaired.to_json() == expected.to_json()
    again = repair(repaired, (3, 3))  # a repair of a repaired plan: its streams over the edited ones
    assert again.streams == repair(dataclasses.replace(expected, streams=dict(expected.streams)), (3, 3)).streams


def test_a_lowered_plan_keeps_its_ops_when_the_order_changes() -> None:
    """The streams are made when read, from the ops the order held when it was lowered: a change to the
    order's mapping afterwards changes nothing of the plan."""
    plan = compile(2, dp=2, microbatches=2, schedule="1f1b")
    order = order_of(plan)
    ops = dict(order.ops)
    lowered = lowering.lower(dataclasses.replace(order, ops=ops), plan.costs)
    w = next(iter(ops))
    ops[w] = tuple(reversed(ops[w]))
    assert dict(lowered.streams.items()) == dict(plan.streams.items())


def test_ops_that_print_otherwise_keep_their_text() -> None:
    """An op whose fields are bools, or of an `Op` subclass with a text of its own, takes the op-by-op path,
    whose plan prints each op as the op prints itself (the column path prints the fields)."""

    class Named(Op):
        __slots__ = ()

        def __str__(self) -> str:
            return f"X{Op.__str__(self)}"

    plan = compile(2, dp=1, microbatches=2, schedule="1f1b")
    order = order_of(plan)
    for make in (lambda op: Op(op.kind, False, op.microbatch, op.stage), lambda op: Named(*dataclasses.astuple(op))):
        odd = dataclasses.replace(order, ops={w: tuple(map(make, ops)) for w, ops in order.ops.items()})
        assert lower_streams(odd, ()) is None
        texts = lowering.lower(odd, plan.costs).to_json()
        assert ("F0.False" in texts) if make(order.ops[Worker(0, 0)][0]).pipeline is False else ("XF0.0" in texts)
