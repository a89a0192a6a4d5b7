"""The simulator against the Zero Bubble PP paper's closed forms (Qi et al., ICLR 2024).

With the same T_F, T_B, T_W at every stage, no p2p, all-reduce or optimizer cost, and
p stages running M micro-batches, the period (steady state, staggered optimizer) is
M (T_F + T_B + T_W) + bubble, where the bubble, and the conditions under which our orders
reach it exactly (found by sweeping costs and pinned below), are:

| family     | bubble                          | holds when                     |
|------------|---------------------------------|--------------------------------|
| GPipe      | (p-1)(T_F + T_B + T_W)          | any costs, M >= 1              |
| 1F1B       | (p-1)(T_F + T_B + T_W)          | any costs, M >= p              |
| ZB-H1      | (p-1)(T_F + T_B - T_W)          | T_W <= T_F, M >= p             |
| ZB-H2      | max(0, (p-1)(T_F + T_B - 2T_W)) | T_W <= T_F, M >= 2p-1          |

ZB-H1's single iteration (makespan) also equals it when T_W <= min(T_F, T_B). ZB-H2 reaches
its bubble only in steady state: a lone iteration (or a synchronous optimizer) pays the
parallelogram's ramp. Outside the conditions the fixed orders do worse (W passes that are
longer than the F they should hide behind stretch the critical path), as the last tests show.
With p2p > 0 the formulas are only lower bounds.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from schedcomp.compiler import compile
from schedcomp.costs import CostModel
from schedcomp.simulator import simulate

ITERATIONS = 4


def run(schedule: str, pp: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, **kw: float):
    plan = compile(pp, 1, m, schedule=schedule, costs=CostModel.uniform(pp, f, b, w, **kw))
    return simulate(plan, iterations=ITERATIONS)


def bubble(schedule: str, p: int, f: float, b: float, w: float) -> float:
    return {
        "gpipe": (p - 1) * (f + b + w),
        "1f1b": (p - 1) * (f + b + w),
        "zb-h1": (p - 1) * (f + b - w),
        "zb-h2": max(0.0, (p - 1) * (f + b - 2 * w)),
    }[schedule]


# ---- the anchor numbers: pp = 4, M = 8, unit costs -------------------------------------


@pytest.mark.parametrize(
    ("schedule", "period", "ratio"),
    [("gpipe", 33, Fraction(9, 33)), ("1f1b", 33, Fraction(9, 33)), ("zb-h1", 27, Fraction(3, 27)),
     ("zb-h2", 24, Fraction(0))],
)
def test_unit_costs_pp4_m8(schedule: str, period: int, ratio: Fraction) -> None:
    sim = run(schedule, 4, 8)
    assert sim.period == period
    assert sim.bubble_ratio == pytest.approx(float(ratio), abs=1e-12)


def test_unit_costs_pp4_m8_memory() -> None:
    peaks = {name: run(name, 4, 8).peak_memory for name in ("gpipe", "1f1b", "zb-h1", "zb-h2")}
    assert peaks["1f1b"] == 4
    assert peaks["zb-h1"] <= 4
    assert peaks["zb-h2"] <= 7
    assert peaks["gpipe"] == 8


def test_zb_h2_needs_the_staggered_optimizer() -> None:
    """The zero bubble is a steady-state property: one iteration, or a global barrier, costs pp-1."""
    plan = compile(4, 1, 8, schedule="zb-h2")
    assert simulate(plan, iterations=1).period == 27
    assert simulate(plan, iterations=ITERATIONS, synchronous_optimizer=True).period == 27
    assert simulate(plan, iterations=ITERATIONS).period == 24
    one_f_one_b = compile(4, 1, 8, schedule="1f1b")
    assert simulate(one_f_one_b, iterations=ITERATIONS, synchronous_optimizer=True).period == 33


# ---- the formulas over (p, M, T_F, T_B, T_W) --------------------------------------------------

TIMES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 3, 1), (1.5, 0.5, 0.5), (3, 2, 2), (1, 1, 0.5), (2, 1, 2), (4, 1, 3)]


def shapes(schedule: str) -> list[tuple[int, int]]:
    least = {"gpipe": lambda p: 1, "1f1b": lambda p: p, "zb-h1": lambda p: p, "zb-h2": lambda p: 2 * p - 1}[schedule]
    return [(p, m) for p in (2, 3, 5, 6) for m in sorted({least(p), least(p) + 1, 3 * p})]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize(("f", "b", "w"), TIMES)
def test_period_formula(schedule: str, f: float, b: float, w: float) -> None:
    if schedule.startswith("zb") and w > f:
        pytest.skip("outside the formula's condition T_W <= T_F (see test_outside_the_conditions)")
    for p, m in shapes(schedule):
        sim = run(schedule, p, m, f, b, w)
        work = m * (f + b + w)
        expect = work + bubble(schedule, p, f, b, w)
        assert sim.period == pytest.approx(expect), (p, m)
        assert sim.bubble_ratio == pytest.approx(1 - work / expect), (p, m)
        if schedule in ("gpipe", "1f1b") or (schedule == "zb-h1" and w <= b):
            assert sim.makespan == pytest.approx(expect), (p, m)


@pytest.mark.parametrize(("p", "m"), [(2, 3), (3, 5), (5, 9), (6, 18)])
@pytest.mark.parametrize("activation", [1.0, 2.5])
def test_memory_formula(p: int, m: int, activation: float) -> None:
    peak = {name: run(name, p, m, activation=activation).peak_memory for name in ("gpipe", "1f1b", "zb-h1", "zb-h2")}
    assert peak["gpipe"] == pytest.approx(m * activation)
    assert peak["1f1b"] == pytest.approx(p * activation)
    assert peak["zb-h1"] == pytest.approx(p * activation)  # stage 0 runs W right after B
    assert peak["zb-h2"] <= (2 * p - 1) * activation + 1e-9


def test_outside_the_conditions() -> None:
    """W longer than F: the fixed ZB orders miss the formula, the W passes stretch the critical path."""
    p, m = 4, 8
    for schedule, (f, b, w) in (("zb-h1", (1.0, 1.0, 2.0)), ("zb-h2", (1.0, 2.0, 2.0)), ("zb-h2", (0.5, 1.0, 1.0))):
        period = run(schedule, p, m, f, b, w).period
        assert period > m * (f + b + w) + bubble(schedule, p, f, b, w) + 1e-9


def test_p2p_only_adds_time() -> None:
    for schedule in ("1f1b", "zb-h1", "zb-h2"):
        base = run(schedule, 4, 8).period
        slow = run(schedule, 4, 8, p2p=0.25).period
        assert slow >= base + 2 * 3 * 0.25 - 1e-9  # at least one round trip across the pipeline


def test_data_parallel_replicas_keep_the_period() -> None:
    """With a free all-reduce, dp pipelines side by side run at the one-pipeline period."""
    for schedule in ("1f1b", "zb-h1", "zb-h2"):
        one = run(schedule, 3, 6).period
        plan = compile(3, 3, 6, schedule=schedule, costs=CostModel.uniform(3))
        assert simulate(plan, iterations=ITERATIONS).period == pytest.approx(one)
