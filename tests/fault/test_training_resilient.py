"""The training-loop options under failures: the LR schedule and global clipping stay exact across a
rollback recovery and a rejoin (`ResilientTrainer(lr_scheduler=, max_grad_norm=)`, `runtime.training`).

One launch of the pp = 4, dp = 2 chaos job: worker 0:1 dies mid-iteration 1 (its stage's survivors
roll back), is replaced, and the replacement receives its stage's state, schedule included, from
the donor replica. Every replica must end equal to one process trained with the same schedule and
`clip_grad_norm_` (float64, 1e-10), with the same learning rate.
"""

from __future__ import annotations

import pytest
from chaos_job import DP, MICROBATCHES, PP, launch, precompile_chaos_plans
from resilient_procs import assert_matches_reference, chaos_reference

from schedcomp.topology import Worker

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

ITERATIONS = 7
MAX_NORM = 0.3  # the fault-free norms run 0.22-0.44 over these iterations: clipped on some, not on others


def test_schedule_and_clipping_survive_rollback_and_rejoin(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CHAOS_SCHEDULE", "step")
    monkeypatch.setenv("CHAOS_MAX_NORM", str(MAX_NORM))
    victim = Worker(0, 1)
    results = launch(precompile_chaos_plans(tmp_path), f"{victim}@1.5", iterations=ITERATIONS, respawn=1, hold=3,
                     timeout=300.0)
    reference = chaos_reference(PP, DP * MICROBATCHES, ITERATIONS, "step", MAX_NORM)
    unclipped = chaos_reference(PP, DP * MICROBATCHES, ITERATIONS, "step")
    assert reference != unclipped  # clipping changed the model: the comparison covers it
    expected = {str(Worker(d, s)) for d in range(DP) for s in range(PP)}
    assert_matches_reference(results, reference, expected, ITERATIONS, DP * MICROBATCHES)
    joined = results[str(victim)]
    assert joined["incarnation"] == 1 and joined["resumed_at"] is not None and joined["resumed_at"] > 1
    assert any(r["recoveries"] for w, r in results.items() if w != str(victim))  # a rollback happened
    # every worker reports the same clipping decisions for every iteration it stepped, some clipped, some not
    decisions = {i: u[1] for r in results.values() for i, u in r["updates"].items()}
    assert all(r["updates"][i][1] == decisions[i] for r in results.values() for i in r["updates"])
    assert sorted(map(int, results[str(Worker(1, 1))]["updates"])) == list(range(ITERATIONS))
    assert any(decisions.values()) and not all(decisions.values())
    lr = 0.05 * 0.5 ** (ITERATIONS // 2)  # StepLR(step_size=2, gamma=0.5) after ITERATIONS steps
    assert all(r["lr"] == pytest.approx(lr, rel=1e-15) for r in results.values())
