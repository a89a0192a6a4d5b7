"""Re-partitioning layers as well as re-routing (`schedcomp.repartition`, `compile(layers=...)`)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from schedcomp import compile
from schedcomp.baselines import compare
from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.costs import CostModel
from schedcomp.errors import PlanFormatError, RecoveryError
from schedcomp.ir import Plan
from schedcomp.layers import LayerCosts, stage_costs
from schedcomp.memory import resolve_limit
from schedcomp.repartition import candidate_partitions, fits_memory, layers_moved, max_load, min_max_partition
from schedcomp.simulator import simulate
from schedcomp.topology import Topology

CONCENTRATED = dict(pp=8, dp=4, microbatches=16, failed=[(0, 3), (1, 3)])
"""Issue 14's case: two of stage 3's four workers failed."""


def _partitions(layers: int, stages: int):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(stages))


def test_the_min_max_partition_is_optimal_against_brute_force() -> None:
    rng = random.Random(14)
    for _ in range(250):
        stages = rng.randint(1, 5)
        layers = rng.randint(stages, 10)
        work = [rng.choice([0.5, 1.0, 1.5, 3.0, rng.random()]) for _ in range(layers)]
        weights = [rng.choice([1.0, 4 / 3, 2.0, 4.0]) for _ in range(stages)]
        memory = [rng.choice([0.0, 1.0, 2.0]) for _ in range(layers)]
        rooms = [rng.choice([2.0, 4.0, math.inf]) for _ in range(stages)]
        fitting = [p for p in _partitions(layers, stages) if fits_memory(p, memory, rooms)]
        got = min_max_partition(work, weights, memory, rooms)
        if not fitting:
            assert got is None
            continue
        best = min(max_load(p, work, weights) for p in fitting)
        assert got is not None and sum(got) == layers and min(got) >= 1 and fits_memory(got, memory, rooms)
        assert max_load(got, work, weights) == pytest.approx(best, rel=1e-9)


def test_the_optimum_keeps_stages_that_are_not_the_bottleneck_even() -> None:
    # Stage 3 has half its workers: it takes about half a stage's layers, the rest share the remainder.
    assert min_max_partition([0.25] * 32, [1, 1, 1, 2, 1, 1, 1, 1]) == (4, 4, 4, 2, 5, 4, 5, 4)


def test_at_the_optimum_load_a_partition_near_the_jobs_moves_fewer_layers() -> None:
    work, weights = [0.25] * 32, [1, 1, 1, 2, 1, 1, 1, 1]
    balanced, near = min_max_partition(work, weights), min_max_partition(work, weights, near=(4,) * 8)
    assert near == (4, 4, 4, 2, 5, 5, 4, 4) and max_load(near, work, weights) == max_load(balanced, work, weights)
    assert layers_moved((4,) * 8, near) == 3 < layers_moved((4,) * 8, balanced)


def test_candidates_are_the_optimum_the_job_and_the_best_neighbours() -> None:
    topology = Topology.of(8, 4, CONCENTRATED["failed"])
    layers = LayerCosts.even(CostModel.uniform(8), 4)
    job = (4,) * 8
    names = candidate_partitions(topology, layers, job, CostModel.uniform(8))
    assert [n for n, _ in names[:2]] == ["optimum", "job"] and names[1][1] == job
    assert {n for n, _ in names[2:]} <= {"neighbour", "fewest-moves"} and len({p for _, p in names}) == len(names)
    assert all(sum(p) == 32 and p[3] < 4 for n, p in names if n != "job")


def test_a_concentrated_failure_moves_layers_off_the_stage_and_beats_oobleck() -> None:
    plan = compile(**CONCENTRATED, layers=4, solver="greedy", reform="never")  # (re-forming is faster: below)
    assert plan.partition is not None and sum(plan.partition) == 32
    assert plan.partition[3] <= 2  # stage 3 lost half its workers: it keeps at most half its layers
    info = plan.meta["repartition"]
    assert info["job_partition"] == [4] * 8 and info["candidates"] >= 3 and info["layers_moved"] >= 2
    period = simulate(plan).period
    rerouted = simulate(compile(**CONCENTRATED, solver="greedy")).period
    outcomes = {o.strategy: o for o in compare(8, 4, 16, CONCENTRATED["failed"], layers=4,
                                                strategies=("fault-free", "adaptive", "oobleck"))}
    assert outcomes["adaptive"].period <= period  # compare's adaptive also tries re-forming pipelines 0 and 1
    assert period < 0.7 * rerouted  # re-routing alone: 105 against 68.75
    assert period < 0.95 * outcomes["oobleck"].period  # oobleck cutting whole layers: 75
    assert outcomes["adaptive"].relative_throughput >= 0.79
    assert Plan.from_json(plan.to_json()).partition == plan.partition


def test_the_fault_free_plan_carries_the_jobs_partition() -> None:
    plan = compile(4, 2, 8, schedule="zb-h1", layers=3, partition=(4, 3, 2, 3))
    assert plan.partition == (4, 3, 2, 3)
    assert plan.costs.forward == pytest.approx((4 / 3, 1.0, 2 / 3, 1.0))


def test_the_static_memory_moves_with_the_layers() -> None:
    # Each layer's weights hold 1 unit: a stage that takes on layers has that much less room for activations,
    # so every device's total (activations + static) stays within what the job's partition allowed.
    layers = LayerCosts(LayerCosts.even(CostModel.uniform(4), 2).costs, static=(1.0,) * 8)
    topology = Topology.of(4, 2, [(0, 1)])
    job = resolve_limit("fault-free", topology, 8, stage_costs(layers, (2, 2, 2, 2)))
    plan = compile(4, 2, 8, failed=[(0, 1)], layers=layers, solver="greedy", reform="never")
    assert plan.partition is not None and plan.partition != (2, 2, 2, 2)
    memory = simulate(plan).memory
    for s, n in enumerate(plan.partition):
        assert plan.costs.limit_at(s) == pytest.approx(job.limit_at(s) + 2 - n)
        held = max(m for w, m in memory.items() if w.stage == s)
        assert held + n <= job.limit_at(s) + 2 + 1e-9


def run(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_compile_and_compare_json_carry_the_partition(capsys) -> None:
    job = ["--pp", "4", "--dp", "2", "-m", "8", "--fail", "1:1", "--layers", "4"]
    status, out, _ = run(capsys, "compile", *job, "--solver", "greedy", "--reform", "never", "--json")
    facts = json.loads(out)
    assert status == 0 and sum(facts["partition"]) == 16 and facts["partition"][1] < 4
    assert facts["repartition"]["job_partition"] == [4, 4, 4, 4] and "choice" not in facts
    status, out, _ = run(capsys, "compare", *job, "--json", *(f"--strategy={s}" for s in
                                                              ("fault-free", "adaptive", "adaptive-reformed",
                                                               "oobleck", "bamboo")))
    rows = {r["strategy"]: r for r in json.loads(out)}
    # Under the default limit re-forming pipeline 1 beats re-routing (31.68 against 34.5): adaptive takes it,
    # the other pipeline keeping the job's partition.
    assert status == 0 and rows["adaptive"]["reformed"] == rows["adaptive-reformed"]["reformed"] == [1]
    assert rows["adaptive"]["period"] == rows["adaptive-reformed"]["period"] < facts["period"]
    assert rows["adaptive"]["partition"] == [4, 4, 4, 4]
    assert rows["fault-free"]["partition"] == [4, 4, 4, 4] and rows["oobleck"]["partition"] is None
    assert all(isinstance(rows[s]["within_memory_limit"], bool) for s in ("adaptive", "oobleck", "bamboo"))
    assert rows["adaptive"]["relative_throughput"] >= rows["oobleck"]["relative_throughput"] * 0.99


@pytest.mark.parametrize("argv, words", [
    (["--layers", "0"], "--layers"),
    (["--layers", "2", "--layer-costs", "x.json"], "not allowed with"),
    (["--layers", "2", "--partition", "4,x"], "--partition"),
    (["--layers", "2", "--partition", "4,4"], "4 stages"),
    (["--layers", "2", "--partition", "1,2,2,2"], "sum to the model's layers"),
    (["--partition", "2,2,2,2"], "per-layer costs"),
    (["--layers", "2", "--schedule", "zb-v"], "chunks=2"),
    (["--layer-costs", "missing.json"], "missing.json"),
])
def test_bad_layer_flags_are_one_line_and_exit_2(capsys, argv, words) -> None:
    status, out, err = run(capsys, "compile", "--pp", "4", "--dp", "2", "-m", "8", "--fail", "1:1", *argv)
    assert status == 2 and out == "" and words in err and err.count("\n") == 1


def test_re_cut_pieces_and_moved_layers_compose_and_beat_either_alone() -> None:
    # pp 2, dp 3, M 3, 1:1 failed, 3 layers per stage: moving a layer off stage 1 leaves its two live workers
    # 2 layers each; re-cutting pipeline 1's micro-batches then spreads them evenly over those two
    both = compile(2, 3, 3, failed=["1:1"], layers=3, recut=True, solver="greedy", reform="never")
    layers_only = compile(2, 3, 3, failed=["1:1"], layers=3, solver="greedy", reform="never")
    recut_only = compile(2, 3, 3, failed=["1:1"], recut=True, solver="greedy")
    assert both.partition == (4, 2) and both.cut and 1 in both.cut.pipelines
    check(both)
    assert simulate(both).period < min(simulate(layers_only).period, simulate(recut_only).period) - 1
    text = Plan.from_json(both.to_json())
    assert text.partition == both.partition and text.cut == both.cut


def test_a_layer_cost_file_with_a_stage_cost_model_is_refused(capsys, tmp_path) -> None:
    layers, stages = tmp_path / "layers.json", tmp_path / "stages.json"
    LayerCosts.even(CostModel.uniform(4), 2).save(layers)
    CostModel.uniform(4).save(stages)
    status, _, err = run(capsys, "compile", "--pp", "4", "-m", "4", "--layer-costs", str(layers),
                         "--costs", str(stages))
    assert status == 2 and "not both" in err and err.count("\n") == 1
    status, out, _ = run(capsys, "compile", "--pp", "4", "-m", "4", "--layer-costs", str(layers), "--json",
                         "--schedule", "1f1b")
    assert status == 0 and json.loads(out)["partition"] == [2, 2, 2, 2]


@pytest.mark.slow
def test_a_precompiled_cache_carries_each_scenarios_partition(capsys, tmp_path) -> None:
    from schedcomp.cache import PlanCache

    # (--reform never: each failure plan re-routes and moves layers; auto would re-form its pipeline instead)
    status, out, _ = run(capsys, "precompile", "--pp", "4", "--dp", "2", "-m", "4", "-k", "1", "--layers", "2",
                         "--reform", "never", "-j", "1", "-q", "-o", str(tmp_path))
    assert status == 0 and out.startswith("5 plans")
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["version"] == 2 and index["partition"] == [2, 2, 2, 2] and index["layers"]["static"] == [0.0] * 8
    cache = PlanCache.load(tmp_path)
    assert cache.lookup([]).partition == (2, 2, 2, 2)
    moved = cache.lookup([(0, 2)])
    assert moved.partition is not None and moved.partition[2] == 1 and sum(moved.partition) == 8
    assert cache.lookup([(1, 2)]).partition == moved.partition  # the same scenario, relabelled
    index["partition"] = [3, 1, 2, 2]
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.raises(PlanFormatError, match="layer costs and partition"):
        PlanCache.load(tmp_path)


@pytest.mark.parametrize("failed", [[(1, 1)], [(0, 0), (1, 3)]])
def test_layers_never_make_a_plan_slower_than_re_routing_alone(failed) -> None:
    costs = CostModel(forward=[1.0, 1.2, 0.8, 1.5], backward_input=[1.1, 1.3, 0.9, 1.6],
                      backward_weight=[0.9, 1.0, 0.7, 1.2], p2p=0.05)
    plain = simulate(compile(4, 2, 4, failed=failed, costs=costs, solver="greedy")).period
    moved = compile(4, 2, 4, failed=failed, costs=costs, layers=3, solver="greedy", reform="never")
    assert simulate(moved).period <= plain + 1e-9
    assert moved.meta["repartition"]["won"] in ("optimum", "neighbour", "job")


def test_oobleck_cuts_whole_layers_with_layer_costs() -> None:
    # pp 4, one failure: the broken pipeline re-forms into 3 stages. Fractional stages hold 4/3 of a stage
    # each; with one layer per stage one of them holds two whole layers, so its 1F1B slot is 6, not 4.
    def period(layers: object) -> float:
        return compare(4, 2, 4, [(1, 3)], layers=layers, strategies=("oobleck",))[0].period

    assert period(None) == 24.0 and period(1) == 27.0


@pytest.mark.slow
def test_within_memory_limit_counts_the_static_memory_each_device_holds() -> None:
    def outcomes(static: float) -> dict[str, object]:
        layers = LayerCosts(LayerCosts.even(CostModel.uniform(4), 4).costs, static=(static,) * 16)
        return {o.strategy: o for o in compare(4, 2, 8, [(1, 3)], layers=layers,
                                               strategies=("fault-free", "adaptive", "oobleck"))}

    light, heavy = outcomes(0.0), outcomes(0.5)
    # The same schedules, but oobleck's re-formed stages hold 5 or 6 layers' weights where 4 were.
    assert light["oobleck"].period == heavy["oobleck"].period
    assert light["oobleck"].within_memory_limit is True and heavy["oobleck"].within_memory_limit is False
    assert light["adaptive"].within_memory_limit is True and heavy["adaptive"].within_memory_limit is True
    # Weights too heavy to move: adaptive keeps the job's partition and only re-routes.
    assert outcomes(2.0)["adaptive"].partition == (4, 4, 4, 4)


def test_a_stage_that_lost_every_worker_stops_re_routing_not_the_comparison() -> None:
    out = {o.strategy: o for o in compare(4, 2, 4, [(0, 1), (1, 1)], layers=2)}
    # Re-routing cannot go on; re-forming both pipelines over their three live workers can.
    assert out["adaptive"].relative_throughput > 0 and out["adaptive"].reformed == (0, 1)
    assert out["adaptive-no-split"].relative_throughput == 0.0 and "checkpoint" in out["adaptive-no-split"].note
    assert out["oobleck"].relative_throughput > 0  # the others still compared
    with pytest.raises(RecoveryError, match="every worker of stage 1"):
        compile(4, 2, 4, failed=[(0, 1), (1, 1)], layers=2, reform="never")
