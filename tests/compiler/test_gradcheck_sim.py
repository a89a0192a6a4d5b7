"""The simulator's global-gradient-check term (`schedcomp.gradcheck`): post-validation against the barrier."""

from __future__ import annotations

import pytest

from schedcomp import CostModel, Topology
from schedcomp.errors import ValidationError
from schedcomp.gradcheck import GradCheckCost
from schedcomp.lower import lower
from schedcomp.schedules import fault_free_order
from schedcomp.simulator import simulate


def period(family: str, dp: int, check: GradCheckCost | None) -> float:
    costs = CostModel.uniform(4, optimizer=0.5, allreduce=0.3)
    return simulate(lower(fault_free_order(family, Topology.of(4, dp), 8), costs), 6, grad_check=check).period


@pytest.mark.parametrize("family", ["1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("dp", [1, 2])
def test_post_validation_costs_no_more_than_the_barrier(family: str, dp: int) -> None:
    free = period(family, dp, None)
    post = period(family, dp, GradCheckCost("post", reduce=0.2))
    barrier = period(family, dp, GradCheckCost("barrier", reduce=0.2))
    assert free <= post <= barrier
    assert free + 0.2 - 1e-9 <= barrier  # every worker waits for the slowest one's share, then the reduction
    redoing = period(family, dp, GradCheckCost("post", reduce=0.2, redo=0.5))
    assert redoing == pytest.approx(post + 0.5 * (0.5 + 0.5))  # undo + redo of a 0.5 STEP, half the time


def test_post_validation_hides_the_reduction_where_the_next_iteration_waits_anyway() -> None:
    # 1F1B: stage 0 steps last and every other stage's next forward waits for its activations
    assert period("1f1b", 1, GradCheckCost("post", reduce=0.2)) == period("1f1b", 1, None)


@pytest.mark.parametrize("bad", [{"mode": "sometimes"}, {"reduce": -1.0}, {"redo": 1.5}, {"undo": float("nan")}])
def test_bad_costs_are_one_clear_error(bad: dict) -> None:
    with pytest.raises(ValidationError, match="grad_check"):
        GradCheckCost(**bad)
