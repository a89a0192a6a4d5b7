"""The strategies compared under failures, against closed forms where they have one, and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from schedcomp.baselines import LAYERED_ONLY, STRATEGIES, compare, rerouted_1f1b_order
from schedcomp.check import check
from schedcomp.cli import main
from schedcomp.cli.compare import STRATEGIES as CLI_STRATEGIES
from schedcomp.costs import CostModel
from schedcomp.lower import lower
from schedcomp.simulator import simulate
from schedcomp.topology import Topology


def _by_name(outcomes):
    return {o.strategy: o for o in outcomes}


UNLAYERED = [s for s in STRATEGIES if s not in LAYERED_ONLY]
"""`compare`'s default strategies without layer costs."""


def test_without_failures_every_strategy_is_measured_against_the_same_reference():
    pp, dp, m = 4, 2, 8
    out = _by_name(compare(pp, dp, m))
    assert list(out) == UNLAYERED and STRATEGIES == CLI_STRATEGIES
    assert out["fault-free"].relative_throughput == 1.0
    assert out["adaptive"].period == out["fault-free"].period == 24.0  # zero bubble, staggered
    assert out["drop-pipeline"].period == 24.0
    # 1F1B with a synchronous step: (M + pp - 1)(F + B + W).
    assert out["oobleck"].period == (m + pp - 1) * 3
    assert out["adaptive-no-split"].period == (m + pp - 1) * 3
    # Bamboo pays its successor's forward: (M + pp - 1)(2F + B + W).
    assert out["bamboo"].period == (m + pp - 1) * 4
    for o in out.values():
        assert o.relative_throughput == pytest.approx(24.0 / o.period)


@pytest.mark.slow  # > 5 s: simulates every strategy under failures
def test_strategies_under_failures():
    out = _by_name(compare(4, 4, 8, failed=[(1, 1), (2, 3)]))
    assert out["fault-free"].relative_throughput == 1.0
    for name in UNLAYERED:
        assert 0 < out[name].relative_throughput <= 1.0 + 1e-9, name
    # Both ablations give up something the full method has.
    assert out["adaptive"].period <= out["adaptive-no-split"].period
    assert out["adaptive"].period <= out["adaptive-no-stagger"].period
    # Dropping two of four pipelines halves the workers: re-routing does better.
    assert out["adaptive"].period < out["drop-pipeline"].period


@pytest.mark.slow  # > 5 s
def test_strategies_that_need_a_restart_say_so():
    out = _by_name(compare(4, 2, 4, failed=[(0, 1), (1, 2)]))
    assert math.isinf(out["drop-pipeline"].period) and out["drop-pipeline"].relative_throughput == 0.0
    assert "checkpoint" in out["drop-pipeline"].note
    assert math.isfinite(out["adaptive"].period)
    out = _by_name(compare(4, 2, 4, failed=[(0, 1), (0, 2)], strategies=("bamboo", "oobleck")))
    assert math.isinf(out["bamboo"].period) and "neighbouring" in out["bamboo"].note
    assert math.isfinite(out["oobleck"].period)


@pytest.mark.slow  # > 5 s
def test_oobleck_splits_the_batch_by_throughput():
    """One pipeline of two loses a stage: it becomes a 3-stage pipeline with 4/3-slower stages, and
    takes fewer micro-batches than the intact one; the slower of the two sets the period."""
    out = _by_name(compare(4, 2, 6, failed=[(1, 3)], strategies=("oobleck",)))
    period = out["oobleck"].period
    # Deals 12 micro-batches minimising max((m + stages - 1) * slot): 7 to the 4-stage pipeline
    # ((7+3)*3 = 30), 5 to the 3-stage one ((5+2)*4 = 28).
    assert period == pytest.approx(30.0)


def test_the_plain_construction_runs_and_validates():
    topo = Topology.of(4, 3, [(1, 2)])
    order = rerouted_1f1b_order(topo, 6)
    plan = lower(order, CostModel.uniform(4))
    check(plan)
    assert simulate(plan).period > 0


@pytest.mark.slow  # > 5 s
def test_compare_cli_prints_a_table_and_json(capsys):
    assert main(["compare", "--pp", "4", "--dp", "2", "--microbatches", "4", "--fail", "1:2"]) == 0
    out = capsys.readouterr().out
    for name in UNLAYERED:
        assert name in out
    assert main(["compare", "--pp", "4", "--dp", "2", "--microbatches", "4", "--fail", "1:2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in rows] == UNLAYERED
    for r in rows:
        assert {"strategy", "period", "relative_throughput", "peak_memory"} <= set(r)
    assert rows[0]["relative_throughput"] == 1.0


def test_compare_cli_reports_bad_input_in_one_line(capsys):
    assert main(["compare", "--pp", "2", "--dp", "2", "--microbatches", "2", "--fail", "0:1", "--fail", "1:1",
                 "--strategy", "adaptive"]) == 0  # the strategy reports it cannot continue
    assert "stopped" in capsys.readouterr().out
    assert main(["compare", "--pp", "2", "--dp", "2", "--microbatches", "2", "--fail", "5:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("schedcomp: error:") and err.count("\n") == 1
