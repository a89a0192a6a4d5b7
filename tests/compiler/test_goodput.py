"""The whole-run goodput simulator: closed forms, hand-worked runs, fast against exact rates, the CLI."""

from __future__ import annotations

import json
import math
import random

import pytest

from schedcomp import compile as compile_plan
from schedcomp.baselines import compare
from schedcomp.cli import main
from schedcomp.cli.goodput import STRATEGIES as CLI_STRATEGIES
from schedcomp.costs import CostModel
from schedcomp.errors import PlanFormatError, SchedcompError
from schedcomp.goodput import (
    STRATEGIES,
    Failure,
    Recovery,
    first_order,
    goodput,
    parse_trace,
    poisson_failures,
    system_mtbf,
    young_daly,
)
from schedcomp.goodput.failures import node_workers
from schedcomp.goodput.rates import Rates
from schedcomp.simulator import simulate
from schedcomp.topology import Worker

NO_PAUSE = Recovery(0.0, 0.0, 0.0)


def _rows(result):
    return {r.strategy: r for r in result.runs}


# ---- closed forms (issue 12, item 3) -------------------------------------------------------------------


def test_checkpoint_restart_matches_the_first_order_model_and_young_daly():
    # 4 GPUs failing as a Poisson process with system MTBF M = 1e5 s; C << M; ~2,000 failures.
    pp, dp, mtbf, c, s = 2, 2, 1e5, 60.0, 120.0
    gpu_mtbf_h = mtbf * pp * dp / 3600
    duration = 2000 * mtbf
    fails = poisson_failures(pp, dp, duration, gpu_mtbf_h, repair_s=1.0, seed=7)
    assert system_mtbf(pp, dp, gpu_mtbf_h) == pytest.approx(mtbf)
    result = goodput(pp, dp, 4, fails, duration_s=duration, checkpoint_s=c, restart_s=s, system_mtbf_s=mtbf,
                     iteration_s=1.0, strategies=("checkpoint-restart", "checkpoint-restart-best"))
    rows = _rows(result)
    yd = rows["checkpoint-restart"]
    assert yd.checkpoint_interval_s == pytest.approx(math.sqrt(2 * c * mtbf), rel=1e-12)
    assert yd.checkpoint_interval_s == young_daly(c, mtbf)
    model = first_order(c, yd.checkpoint_interval_s, s, mtbf)
    assert abs(yd.relative_goodput - model) / model < 0.02
    assert yd.stops == yd.failures == len(fails)
    best = rows["checkpoint-restart-best"]
    assert best.relative_goodput >= yd.relative_goodput
    assert abs(best.relative_goodput - first_order(c, best.checkpoint_interval_s, s, mtbf)) < 0.02


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
def test_without_failures_goodput_is_the_fault_free_plans_throughput_exactly():
    pp, dp, m = 4, 2, 4
    costs = CostModel.uniform(pp, forward=1.5, backward_input=2.0, backward_weight=1.0, p2p=0.25, allreduce=0.5,
                              optimizer=0.75)
    period = simulate(compile_plan(pp, dp, m, schedule="adaptive", costs=costs, solver="greedy")).period
    day = 86400.0
    for fidelity in ("exact", "fast"):
        result = goodput(pp, dp, m, (), duration_s=day, checkpoint_s=30.0, restart_s=60.0, system_mtbf_s=math.inf,
                         costs=costs, fidelity=fidelity)
        assert result.iteration_s == period
        assert result.fault_free_goodput == 3600.0 / period
        rows = _rows(result)
        for name in ("adaptive", "lossy", "checkpoint-restart", "checkpoint-restart-best", "drop-pipeline"):
            assert rows[name].goodput == pytest.approx(3600.0 / period, rel=1e-12), name
            assert rows[name].relative_goodput == pytest.approx(1.0, rel=1e-12)
            assert rows[name].checkpoint_interval_s is None  # nothing fails: no checkpoint is worth its cost
        # oobleck and bamboo run their own (slower) schedules even without failures
        theirs = {o.strategy: o.relative_throughput for o in compare(pp, dp, m, (), costs)}
        for name in ("oobleck", "bamboo"):
            assert rows[name].relative_goodput == pytest.approx(theirs[name], rel=1e-12)
            assert rows[name].ceiling == pytest.approx(theirs[name], rel=1e-12)


# ---- hand-worked runs -------------------------------------------------------------------------------------


def test_one_failure_by_hand():
    # pp=2 dp=2, unit costs, T = 10 s per iteration; the throughput with the failure is the compiler's.
    pp, dp, m, t = 2, 2, 4, 10.0
    fail = Failure(105.0, (Worker(1, 0),), 1000.0)  # half way through iteration 10
    pause = Recovery(1.0, 2.0, 3.0)
    result = goodput(pp, dp, m, (fail,), duration_s=2000.0, checkpoint_s=5.0, restart_s=50.0, system_mtbf_s=1e9,
                     iteration_s=t, recovery=pause, strategies=("adaptive", "lossy"))
    rel = Rates(pp, dp, m, CostModel.uniform(pp), "exact").relative("adaptive", frozenset({Worker(1, 0)}))
    assert 0 < rel < 1
    rows = _rows(result)
    # adaptive: 10 iterations kept, the half iteration re-run; 6 s pause; 994 s at `rel`; 3 s switch back; 892 s.
    expected = 10 + (1105 - 111) * rel / t + (2000 - 1108) / t
    assert rows["adaptive"].relative_goodput * 200 == pytest.approx(expected, rel=1e-12)
    # lossy: no re-run, but pipeline 1's half of iteration 10's samples is lost.
    expected_lossy = 10.5 - 0.5 + (1105 - 111) * rel / t + (2000 - 1108) / t
    assert rows["lossy"].relative_goodput * 200 == pytest.approx(expected_lossy, rel=1e-12)
    assert rows["adaptive"].lost_hours == pytest.approx((200 - expected) * t / 3600)


def test_checkpoint_restart_by_hand_with_and_without_spares():
    # T = 1 s, checkpoint every 100 s costing 10 s; failure at 250 s: the checkpoint taken after
    # 200 s of training (finished at 220 s) holds 200 iterations; restart 30 s; repair at 400 s.
    fail = Failure(250.0, (Worker(0, 0),), 150.0)
    common = dict(duration_s=1000.0, checkpoint_s=10.0, restart_s=30.0, system_mtbf_s=500.0, iteration_s=1.0,
                  strategies=("checkpoint-restart",))
    assert young_daly(10.0, 500.0) == 100.0
    spares = _rows(goodput(2, 2, 2, (fail,), **common))["checkpoint-restart"]
    # after 280 s: train 100, checkpoint 10 ... up to 1000 s: 720 s left = 6 cycles of 110 + 60 s
    assert spares.relative_goodput * 1000 == pytest.approx(200 + 600 + 60)
    waiting = _rows(goodput(2, 2, 2, (fail,), spares=False, **common))["checkpoint-restart"]
    # waits for the repair at 400 s, restarts until 430 s: 570 s left = 5 cycles of 110 + 20 s
    assert waiting.relative_goodput * 1000 == pytest.approx(200 + 500 + 20)
    assert spares.stops == waiting.stops == 1


def test_a_strategy_that_cannot_go_on_restarts_from_its_checkpoint():
    # Bamboo loses neighbouring stages 0 and 1 of pipeline 0: it stops until the repair, then
    # restarts; adaptive re-routes both to pipeline 1 and goes on.
    fails = (Failure(100.0, (Worker(0, 0),), 500.0), Failure(150.0, (Worker(0, 1),), 500.0))
    rows = _rows(goodput(2, 2, 2, fails, duration_s=2000.0, checkpoint_s=1.0, restart_s=20.0, system_mtbf_s=1000.0,
                         iteration_s=1.0, recovery=NO_PAUSE, strategies=("adaptive", "bamboo")))
    assert rows["adaptive"].stops == 0 and rows["adaptive"].checkpoint_interval_s is None
    assert rows["bamboo"].stops == 1
    assert rows["bamboo"].checkpoint_interval_s == pytest.approx(young_daly(1.0, 2000.0))
    assert rows["bamboo"].relative_goodput < rows["bamboo"].ceiling * (1 - 450 / 2000)


# ---- rates: fast against exact, one evaluation per canonical failure set -----------------------------------


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
def test_fast_rates_agree_with_the_full_compiler():
    rng = random.Random(3)
    pp, dp, m = 4, 4, 8
    costs = CostModel.uniform(pp, forward=1.0, backward_input=1.5, backward_weight=1.0, allreduce=0.5)
    exact, fast = Rates(pp, dp, m, costs, "exact"), Rates(pp, dp, m, costs, "fast")
    assert fast.fault_free_period() == exact.fault_free_period()  # dp=1 reference = the dp-pipeline plan
    for _ in range(6):
        failed = frozenset(Worker(rng.randrange(dp), rng.randrange(pp)) for _ in range(rng.randrange(1, 4)))
        for name in ("oobleck", "bamboo", "drop-pipeline"):  # the baselines themselves, or decomposed: exact
            assert fast.relative(name, failed) == pytest.approx(exact.relative(name, failed), rel=1e-12)
        # adaptive: the work bound, which no plan beats
        assert fast.relative("adaptive", failed) >= exact.relative("adaptive", failed) - 1e-12


def test_failure_sets_equal_up_to_relabelling_are_evaluated_once():
    pp, dp = 4, 8
    fails = tuple(Failure(1000.0 * i, (Worker(i, 2),), 100.0) for i in range(dp))  # one at a time, each pipeline
    result = goodput(pp, dp, 4, fails, duration_s=10000.0, checkpoint_s=1.0, restart_s=1.0, system_mtbf_s=1000.0,
                     strategies=("adaptive",))
    assert result.scenarios == 2  # healthy, and "one worker of stage 2 down"


# ---- failures: model, nodes, trace ------------------------------------------------------------------------


def test_node_failures_take_all_their_gpus():
    assert node_workers(1, 4, 2, 4) == tuple(Worker(1, s) for s in range(4))
    assert node_workers(2, 3, 3, 2) == (Worker(1, 1), Worker(1, 2))
    fails = poisson_failures(4, 2, 1e6, 1000.0, 60.0, gpus_per_node=4, seed=1)
    assert fails and all(len(f.workers) == 4 and len({w.pipeline for w in f.workers}) == 1 for f in fails)


def test_trace_rows():
    text = "time_s,who,down_s\n# comment\n30,1:2,60\n10,1,5\n"
    fails = parse_trace(text, 4, 2, gpus_per_node=2)
    assert fails == (Failure(10.0, (Worker(0, 2), Worker(0, 3)), 5.0), Failure(30.0, (Worker(1, 2),), 60.0))


@pytest.mark.parametrize(("row", "message"), [
    ("10,1:1", "row 2: expected 3 fields"),
    ("ten,1:1,5", "row 2: time_s 'ten' is not a number"),
    ("-5,1:1,5", "row 2: time_s must be a finite number of seconds, at least 0"),
    ("5,1:1,nan", "row 2: down_s must be a finite number"),
    ("5,2:0,5", "row 2: unknown worker 2:0"),
    ("5,1:9,5", "row 2: unknown worker 1:9"),
    ("5,8,5", "row 2: unknown node 8"),
    ("5,a:b,5", "row 2: bad worker"),
    ("5,abc,5", "row 2: 'abc' is neither a node number nor a worker"),
])
def test_bad_trace_rows_are_named(row, message, tmp_path, capsys):
    with pytest.raises(PlanFormatError, match=message):
        parse_trace(f"1,0:0,5\n{row}\n", 4, 2)
    path = tmp_path / "trace.csv"
    path.write_text(f"1,0:0,5\n{row}\n")
    assert main(["goodput", "--pp", "4", "--dp", "2", "-m", "4", "--trace", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and str(path) in err[0]


def test_bad_arguments_are_one_line(capsys, tmp_path):
    assert main(["goodput", "--pp", "4", "-m", "4", "--gpu-mtbf-hours", "-1"]) == 2
    assert main(["goodput", "--pp", "4", "-m", "4"]) == 2  # neither --gpu-mtbf-hours nor --trace
    assert main(["goodput", "--pp", "4", "-m", "4", "--trace", str(tmp_path / "missing.csv")]) == 2
    assert main(["goodput", "--pp", "4", "-m", "4", "--gpu-mtbf-hours", "10", "--gpus-per-node", "9"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("schedcomp: error: ") for line in lines)
    with pytest.raises(SchedcompError, match="checkpoint_s"):
        goodput(2, 1, 2, (), duration_s=10.0, checkpoint_s=-1.0, restart_s=0.0, system_mtbf_s=1.0)


# ---- the CLI ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
def test_cli_json_and_png(capsys, tmp_path):
    assert CLI_STRATEGIES == STRATEGIES
    png = tmp_path / "goodput.png"
    # 8 GPUs for 10 days at a 500 h MTBF: a few failures (each distinct failure set is compiled and compared)
    assert main(["goodput", "--pp", "2", "--dp", "4", "-m", "4", "--days", "10", "--gpu-mtbf-hours", "500",
                 "--iteration-seconds", "5", "--json", "--png", str(png)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in rows] == list(STRATEGIES)
    assert all(r["failures"] > 0 for r in rows)
    for r in rows:
        assert {"strategy", "goodput", "relative_goodput", "failures", "lost_hours", "checkpoint_interval_s"} <= set(r)
        assert 0 < r["relative_goodput"] <= 1
        assert r["goodput"] == pytest.approx(r["relative_goodput"] * 3600 / 5)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["goodput", "--pp", "2", "--dp", "4", "-m", "4", "--days", "1", "--gpu-mtbf-hours", "2000",
                 "--png", str(tmp_path / "goodput.gif")]) == 2
    assert "ending in .png or .svg" in capsys.readouterr().err
    assert main(["goodput", "--pp", "2", "--dp", "4", "-m", "4", "--days", "1", "--gpu-mtbf-hours", "2000",
                 "--strategies", "adaptive", "checkpoint-restart"]) == 0
    out = capsys.readouterr().out
    assert "adaptive" in out and "checkpoint-restart" in out and "bamboo" not in out


# ---- logging-based recovery (issue 13) ---------------------------------------------------------------------


def test_logging_rebuilds_a_lost_stage_by_replay_by_hand():
    from schedcomp.goodput.engine import Policy, run

    # dp = 1, T = 1 s, checkpoint every 100 s costing 10 s: the checkpoint after 200 s of training
    # holds 200 iterations (done at 220 s). Stage 0 dies at 250 s: 230 iterations done, 30 to replay
    # at 0.5 s each after a 1 s pause and a 30 s start of the replacement: training again at 296 s,
    # from iteration 230 (nothing rolled back), fault-free: 6 cycles of 110 s + 44 s to 1000 s.
    def alive(failed):
        return 0.0 if failed else 1.0

    replay = Policy("replay", 100.0, 10.0, 30.0, pause_s=1.0, replay_s=0.5)
    out = run((Failure(250.0, (Worker(0, 0),), 400.0),), alive, replay, duration_s=1000.0, iteration_s=1.0, dp=1)
    assert out.useful == pytest.approx(230 + 600 + 44) and (out.stops, out.replays) == (0, 1)
    # Logging 10 % slower: the fault-free run delivers 1/1.1 of the iterations.
    slow = Policy("replay", math.inf, 0.0, 0.0, slowdown=1.1)
    assert run((), alive, slow, duration_s=1000.0, iteration_s=1.0, dp=1).useful == pytest.approx(1000 / 1.1)
    # Two adjacent stages lost: back to the checkpoint and wait for the repair, as rollback does.
    both = (Failure(250.0, (Worker(0, 0), Worker(0, 1)), 400.0),)
    fallback = run(both, alive, replay, duration_s=1000.0, iteration_s=1.0, dp=1)
    assert (fallback.stops, fallback.replays) == (1, 0) and fallback.useful < out.useful


def test_logging_strategy_in_goodput_replays_where_adaptive_stops():
    fails = (Failure(5000.0, (Worker(0, 1),), 20000.0),)
    rows = _rows(goodput(4, 1, 4, fails, duration_s=50000.0, checkpoint_s=10.0, restart_s=60.0, system_mtbf_s=1e5,
                         iteration_s=1.0, recovery=NO_PAUSE, strategies=("adaptive", "logging")))
    assert rows["adaptive"].stops == 1 and rows["logging"].stops == 0
    assert rows["logging"].relative_goodput > rows["adaptive"].relative_goodput


def test_logging_overhead_is_measured_or_modelled_from_the_boundary_bytes_or_assumed():
    from schedcomp.goodput.replay_costs import ASSUMED_OVERHEAD, LoggingCosts

    # 8 micro-batches, 40 MB boundaries, 10 GB/s, 10 s iterations: 2 x 8 x 4e7 / 1e10 = 0.064 s of 10 s
    assert LoggingCosts(boundary_bytes=4e7).step_overhead(8, 10.0) == pytest.approx(0.0064)
    assert LoggingCosts(boundary_bytes=4e7, copy_bytes_per_s=2e10).step_overhead(8, 10.0) == pytest.approx(0.0032)
    assert LoggingCosts(overhead=0.05).step_overhead(8, 10.0) == 0.05
    assert LoggingCosts().step_overhead(8, 10.0) == ASSUMED_OVERHEAD
    for bad in ({"overhead": 0.1, "boundary_bytes": 1.0}, {"overhead": -0.1}, {"boundary_bytes": math.inf},
                {"copy_bytes_per_s": 0.0}, {"replay_speed": True}):
        with pytest.raises(SchedcompError, match="logging"):
            LoggingCosts(**bad)


def test_goodput_charges_the_modelled_logging_overhead_on_every_iteration():
    from schedcomp.goodput.replay_costs import LoggingCosts

    # no failures: logging delivers the fault-free iterations divided by 1 + overhead (0.064 here)
    result = goodput(4, 1, 8, (), duration_s=10000.0, checkpoint_s=10.0, restart_s=60.0, system_mtbf_s=1e5,
                     iteration_s=1.0, recovery=NO_PAUSE, strategies=("adaptive", "logging"),
                     logging=LoggingCosts(boundary_bytes=4e7))
    assert result.logging_overhead == pytest.approx(0.064)
    assert _rows(result)["logging"].relative_goodput == pytest.approx(1 / 1.064, rel=1e-3)
    assert _rows(result)["adaptive"].relative_goodput == pytest.approx(1.0)


def test_goodput_cli_takes_the_logging_overhead_measured_or_modelled(capsys):
    base = ["goodput", "--pp", "4", "-m", "8", "--days", "1", "--gpu-mtbf-hours", "2000", "--iteration-seconds",
            "10", "--strategies", "logging", "-q"]
    assert main([*base, "--boundary-bytes", "4e7"]) == 0
    assert "logging overhead 0.64% per iteration (modelled)" in capsys.readouterr().out
    assert main([*base, "--logging-overhead", "0.05"]) == 0
    assert "logging overhead 5.00% per iteration (measured)" in capsys.readouterr().out
    assert main(base) == 0
    assert "logging overhead 2.00% per iteration (assumed)" in capsys.readouterr().out
    assert main([*base, "--copy-bytes-per-second", "2e10"]) == 2
    assert "needs --boundary-bytes" in capsys.readouterr().err
    assert main([*base, "--logging-overhead", "0.05", "--boundary-bytes", "4e7"]) == 2
    assert "not allowed with" in capsys.readouterr().err
