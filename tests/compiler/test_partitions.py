"""Per-pipeline partitions (`schedcomp.partitions`): the rules, held stages, and the segments reduced."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedcomp.errors import PlanFormatError
from schedcomp.partitions import as_partitions, held_stages, next_stage, previous_stage, segments, segments_by_holder
from schedcomp.topology import Worker


@st.composite
def jobs(draw: st.DrawFn) -> tuple[tuple[tuple[int, ...], ...], frozenset[Worker]]:
    """Per-pipeline partitions of one model over a small job, some pipelines re-formed, some with failures
    they keep (re-routed)."""
    pp, dp = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    layers = draw(st.integers(pp, 12))
    out, failed = [], set()
    for d in range(dp):
        dead = draw(st.sets(st.integers(0, pp - 1), max_size=pp - 1))
        reform = bool(dead) and draw(st.booleans())
        held = [s for s in range(pp) if not (reform and s in dead)]
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=len(held) - 1,
                                   max_size=len(held) - 1))) if len(held) > 1 else []
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, layers], strict=True)]
        partition = [0] * pp
        for s, n in zip(held, counts, strict=True):
            partition[s] = n
        out.append(tuple(partition))
        failed |= {Worker(d, s) for s in dead}
    return tuple(out), frozenset(failed)


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_every_layer_is_in_exactly_one_segment_held_by_one_live_worker_per_pipeline(job) -> None:  # type: ignore[no-untyped-def]
    partitions, failed = job
    assert as_partitions(partitions, len(partitions), len(partitions[0]), failed) == partitions
    segs = segments(partitions, failed)
    layers = sum(partitions[0])
    assert [layer for seg in segs for layer in seg.layers] == list(range(layers))  # in order, each once
    for seg in segs:
        assert len({w.pipeline for w in seg.holders}) == len(seg.holders)  # one per pipeline
        assert list(seg.holders) == sorted(seg.holders) and not set(seg.holders) & failed
        for d, partition in enumerate(partitions):
            stage_of = [s for s, n in enumerate(partition) for _ in range(n)]
            holder = {stage_of[layer] for layer in seg.layers}
            assert len(holder) == 1  # the same holder for every layer of the segment
            w = Worker(d, holder.pop())
            assert (w in seg.holders) == (w not in failed)
    stage_of = [[s for s, n in enumerate(p) for _ in range(n)] for p in partitions]
    for a, b in itertools.pairwise(segs):  # maximal: neighbours differ in some pipeline's holder
        assert any(st_[a.layers[-1]] != st_[b.layers[0]] for st_ in stage_of)
    # Each holder's segments come in layer order: the one global order of the collectives.
    by_holder = segments_by_holder(segs)
    for w, mine in by_holder.items():
        assert mine == sorted(mine) and all(w in segs[k].holders for k in mine)
    assert sorted((k, w) for w, mine in by_holder.items() for k in mine) == sorted(
        (k, w) for k, seg in enumerate(segs) for w in seg.holders)  # every holding listed, once


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.data())
def test_a_shared_partition_gives_one_segment_per_stage_held_by_its_stage_group(pp: int, dp: int, data) -> None:  # type: ignore[no-untyped-def]
    from schedcomp.topology import Topology

    partition = tuple(data.draw(st.lists(st.integers(1, 3), min_size=pp, max_size=pp)))
    failed = data.draw(st.sets(st.sampled_from([Worker(d, s) for d in range(dp) for s in range(pp)])))
    topo = Topology.of(pp, dp, failed)
    segs = segments((partition,) * dp, failed)
    assert len(segs) == pp
    start = 0
    for s, seg in enumerate(segs):
        assert seg.layers == range(start, start + partition[s])
        assert seg.holders == topo.stage_group(s)
        start += partition[s]


def test_a_re_formed_pipeline_splits_the_segments_at_its_boundaries() -> None:
    # pp 2, dp 2, worker 1:1 failed, pipeline 1 re-formed: 1:0 holds all four layers.
    partitions = ((2, 2), (4, 0))
    failed = {Worker(1, 1)}
    segs = segments(partitions, failed)
    assert [(list(s.layers), s.holders) for s in segs] == [
        ([0, 1], (Worker(0, 0), Worker(1, 0))), ([2, 3], (Worker(0, 1), Worker(1, 0)))]
    assert held_stages((4, 0)) == (0,) and held_stages((1, 0, 2)) == (0, 2)
    assert next_stage((1, 0, 2)) == (2, 2, 3) and previous_stage((1, 0, 2)) == (-1, 0, 0)


@pytest.mark.parametrize(("value", "failed", "says"), [
    ([[2, 2]], (), "pipelines"),
    ([[2, 2], [2]], (), "2 layer counts"),
    ([[2, 2], [3, 2]], (), "holds 5 layers"),
    ([[2, 2], [4, 0]], (), "a live worker must hold layers"),
    ([[2, 2], [0, 4], ], [Worker(1, 1)], "place 0"),
    ([[2, 2], [2, -1]], (), "holds -1"),
    ([[2, 2], [2, True]], (), "holds True"),
    ("22", (), "list"),
])
def test_bad_partitions_are_refused_in_one_line(value: object, failed: tuple[Worker, ...], says: str) -> None:
    with pytest.raises(PlanFormatError) as exc:
        as_partitions(value, 2, 2, failed)
    assert "\n" not in str(exc.value) and says in str(exc.value)
