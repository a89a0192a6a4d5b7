"""`compile(reform="auto")`: re-route or re-form, whichever plan is faster within the memory limit
(`schedcomp.choice`), through the API, `compare`, the CLI and `precompile`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from schedcomp import compile
from schedcomp.baselines import compare
from schedcomp.cache import PlanCache, precompile
from schedcomp.check import check, is_checked
from schedcomp.choice import Timed, fastest, timed
from schedcomp.cli import main
from schedcomp.costs import CostModel
from schedcomp.errors import MemoryLimitError, RecoveryError, SchedcompTypeError, ScheduleError
from schedcomp.ir import Plan
from schedcomp.layers import LayerCosts, stage_costs
from schedcomp.memory import resolve_limit
from schedcomp.reform import timed_reformed
from schedcomp.simulator import simulate
from schedcomp.topology import Topology, Worker

JOB = {"pp": 3, "dp": 2, "microbatches": 4, "layers": 2, "solver": "greedy", "time_limit": 1.0}
"""A small job (6 layers) whose tests run in seconds."""


def _period(plan: Plan) -> float:
    return simulate(plan).period


def test_auto_re_forms_a_pipeline_whose_failure_is_concentrated_under_the_default_limit() -> None:
    # 1:1 failed: re-routing loads 0:1 with both pipelines' stage 1 (21); re-formed, pipeline 1's two workers
    # hold all 6 layers and take a smaller share of the batch (16.32).
    auto = compile(**JOB, failed=["1:1"])
    forced = compile(**JOB, failed=["1:1"], reform=(1,))
    rerouted = compile(**JOB, failed=["1:1"], reform="never")
    choice = auto.meta["choice"]
    assert choice == {"kept": "re-form", "periods": {"re-route": _period(rerouted), "re-form": _period(forced)}}
    assert _period(auto) == _period(forced) < _period(rerouted) * 0.9
    assert auto.partitions == forced.partitions and auto.cut == forced.cut and auto.streams == forced.streams
    assert Plan.from_json(auto.to_json()).meta["choice"] == choice
    assert is_checked(auto)  # (the kept plan carries the proof of the candidate it was: not checked twice)


@pytest.mark.slow  # re-routing with re-cut pieces: ~13 s
def test_issue_14s_case_keeps_the_faster_of_re_forming_and_re_routing(capsys: pytest.CaptureFixture[str]) -> None:
    issue = ("compile", "--pp", "4", "--dp", "8", "-m", "8", "--fail", "3:1", "--layers", "4", "--json")
    # whole micro-batches: re-forming pipeline 3 (27.83) beats re-routing + re-partitioning (33.0)
    status, out, _ = _cli(capsys, *issue)
    facts = json.loads(out)
    assert status == 0 and facts["choice"]["kept"] == "re-form" and facts["reform"]["pipelines"] == [3]
    assert facts["period"] == pytest.approx(27.826, abs=1e-3) and facts["within_memory_limit"] is True
    assert facts["choice"]["periods"]["re-route"] == pytest.approx(33.0)
    # with --recut, re-routing's pieces with the other pipelines halved reach the work bound, 27.43: kept
    status, out, _ = _cli(capsys, *issue, "--recut")
    facts = json.loads(out)
    assert status == 0 and facts["choice"]["kept"] == "re-route" and facts["within_memory_limit"] is True
    assert facts["period"] == pytest.approx(8 * 3 + 8 * 3 / 7)
    assert facts["period"] < facts["choice"]["periods"]["re-form"]


def test_auto_re_routes_where_failures_are_spread() -> None:
    # One failure at dp 2 without a limit: re-routing 30.00, the re-formed pipeline 31.68 (bench/README.md).
    job = {**JOB, "pp": 4, "dp": 2, "microbatches": 8, "layers": 4, "failed": ["1:1"], "memory_limit": None}
    auto = compile(**job)
    rerouted = compile(**job, reform="never")
    forced = compile(**job, reform=(1,))
    assert auto.meta["choice"] == {"kept": "re-route",
                                   "periods": {"re-route": _period(rerouted), "re-form": _period(forced)}}
    assert _period(rerouted) < _period(forced)
    # The kept candidate is the re-routed plan itself: only the record of the choice is added.
    assert dataclasses.replace(auto, meta=rerouted.meta).to_json() == rerouted.to_json()


def _weighing(static: float) -> LayerCosts:
    """2 layers per stage of the unit model (3 stages), each holding `static` (weights, gradients, optimizer
    state)."""
    return LayerCosts(LayerCosts.even(CostModel.uniform(3), 2).costs, static=(static,) * 6)


def test_a_re_formed_candidate_over_the_memory_limit_never_wins() -> None:
    job = {**JOB, "failed": ["1:0", "1:1"]}  # pipeline 1's last worker would hold all 6 layers
    light = compile(**{**job, "layers": _weighing(0.0)})
    assert light.meta["choice"]["kept"] == "re-form"  # 20 against 25.5 without weights
    # With weights of 0.5 a layer, 6 layers leave that device no room for activations: re-routing is kept.
    heavy = {**job, "layers": _weighing(0.5)}
    with pytest.raises(MemoryLimitError, match="no re-formed plan fits"):
        compile(**heavy, reform=(1,))
    plan = compile(**heavy)
    assert plan.meta["choice"] == {"kept": "re-route", "periods": {
        "re-route": _period(compile(**heavy, reform="never")), "re-form": None}}
    assert plan.partitions is None
    memory = simulate(plan).memory
    assert all(m <= plan.costs_of(w.pipeline).limit_at(w.stage) * (1 + 1e-9) for w, m in memory.items())


def test_when_no_candidate_compiles_the_error_is_re_routings() -> None:
    # Every worker of pipeline 1 lost as well as stage 2 of pipeline 0: neither re-routes nor re-forms.
    failed = [(1, s) for s in range(3)] + [(0, 2)]
    with pytest.raises(RecoveryError) as auto:
        compile(**JOB, failed=failed)
    with pytest.raises(RecoveryError) as never:
        compile(**JOB, failed=failed, reform="never")
    assert str(auto.value) == str(never.value)


def test_fastest_keeps_the_first_of_equal_periods_and_raises_the_first_error() -> None:
    plan = compile(pp=2, dp=2, microbatches=2)
    other = dataclasses.replace(plan, meta={"other": True})
    kept = fastest((("a", lambda: timed(plan)), ("b", lambda: timed(other))))
    assert kept.meta == {"choice": {"kept": "a", "periods": {"a": _period(plan), "b": _period(plan)}}}
    # `fastest` compares the periods the candidates hand over (it simulates nothing itself).
    slower = fastest((("a", lambda: Timed(plan, 2.0)), ("b", lambda: Timed(other, 1.0))))
    assert slower.meta == {"other": True, "choice": {"kept": "b", "periods": {"a": 2.0, "b": 1.0}}}

    def refused() -> Timed:
        raise ScheduleError("first")

    def also_refused() -> Timed:
        raise MemoryLimitError("second")

    assert fastest((("a", refused), ("b", lambda: timed(other)))).meta["choice"]["kept"] == "b"
    with pytest.raises(ScheduleError, match="first"):
        fastest((("a", refused), ("b", also_refused)))


def test_never_and_jobs_without_layer_costs_compile_as_before() -> None:
    rerouted = compile(**JOB, failed=["1:1"], reform="never")
    assert "choice" not in rerouted.meta and rerouted.partitions is None
    plain = {"pp": 3, "dp": 2, "microbatches": 4, "failed": ["1:1"], "solver": "greedy", "time_limit": 1.0}
    assert compile(**plain).to_json() == compile(**plain, reform="never").to_json()


@pytest.mark.parametrize(("reform", "error", "says"), [
    ("sometimes", ScheduleError, "'auto', 'never'"),
    (3, SchedcompTypeError, "'auto', 'never'"),
    ((3,), ScheduleError, "drop recut"),
])
def test_reform_values_are_checked_in_one_line(reform: object, error: type, says: str) -> None:
    with pytest.raises(error, match=says) as exc:
        compile(**JOB, failed=["1:1"], reform=reform, recut=True)  # type: ignore[arg-type]
    assert "\n" not in str(exc.value)


def test_recut_with_auto_is_legal_and_the_re_formed_candidate_ignores_it() -> None:
    plan = compile(**JOB, failed=["1:1"], recut=True)
    forced = compile(**JOB, failed=["1:1"], reform=(1,))
    assert plan.meta["choice"]["periods"]["re-form"] == _period(forced)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's refusals
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_the_cli_reform_flag(capsys: pytest.CaptureFixture[str]) -> None:
    job = ("compile", "--pp", "3", "--dp", "2", "-m", "4", "--fail", "1:1", "--layers", "2", "--solver", "greedy",
           "--time-limit", "1")
    status, out, _ = _cli(capsys, *job, "--json")
    auto = json.loads(out)
    assert status == 0 and auto["choice"]["kept"] in ("re-route", "re-form")
    status, out, _ = _cli(capsys, *job, "--reform", "never", "--json")
    assert status == 0 and "choice" not in json.loads(out)
    assert json.loads(out)["period"] == auto["choice"]["periods"]["re-route"]
    status, out, _ = _cli(capsys, *job, "--reform", "1", "--json")
    assert status == 0 and json.loads(out)["period"] == auto["choice"]["periods"]["re-form"]
    for bad, says in ((("--reform", "maybe"), "--reform"), (("--reform", "1", "--recut"), "drop recut"),
                      (("--reform", "2"), "lost no worker")):
        status, out, err = _cli(capsys, *job, *bad)
        assert status == 2 and out == "" and says in err and err.count("\n") == 1, (bad, err)


def test_compare_counts_re_forming_in_adaptive_and_reports_it_alone() -> None:
    rows = {o.strategy: o for o in compare(3, 2, 4, ["1:1"], layers=2, time_limit=1.0, strategies=(
        "fault-free", "adaptive", "adaptive-reformed", "oobleck"))}
    assert rows["adaptive"].reformed == rows["adaptive-reformed"].reformed == (1,)
    assert rows["adaptive"].period == rows["adaptive-reformed"].period == _period(compile(**JOB, failed=["1:1"]))
    assert rows["adaptive"].within_memory_limit is True and rows["adaptive"].partition == (2, 2, 2)
    assert rows["adaptive"].relative_throughput > rows["oobleck"].relative_throughput
    spread = {o.strategy: o for o in compare(4, 2, 8, ["1:1"], layers=4, memory_limit=None, time_limit=1.0,
                                             strategies=("fault-free", "adaptive", "adaptive-reformed"))}
    assert spread["adaptive"].reformed == () and spread["adaptive"].period < spread["adaptive-reformed"].period


def test_precompile_re_forms_by_default_and_re_routes_with_never(tmp_path) -> None:  # type: ignore[no-untyped-def]
    job = {"pp": 2, "dp": 2, "microbatches": 4, "max_failures": 1, "layers": 2, "solver": "greedy",
           "time_limit": 1.0}
    precompile(**job, directory=tmp_path)  # type: ignore[arg-type]
    loaded = PlanCache.load(tmp_path)  # (the index gives each re-formed plan's shares of the batch)
    # One live worker holds all 4 layers: 16.89 against re-routing's 19 and 23.
    for failed, partitions in ((["0:1"], ((4, 0), (2, 2))), (["1:0"], ((2, 2), (0, 4)))):
        plan = loaded.lookup(failed)
        assert plan.meta["choice"]["kept"] == "re-form" and plan.partitions == partitions
        assert plan.cut.shares and plan.meta["reform"]["pipelines"] == [int(failed[0][0])]
    never = precompile(**job, reform="never")  # type: ignore[arg-type]
    assert all(p.partitions is None and "choice" not in p.meta for p in never.plans.values()) and not never.partitions
    with pytest.raises(SchedcompTypeError, match="'auto' or 'never'"):
        precompile(**job, reform=(1,))  # type: ignore[arg-type]
    # without layer costs the default changes nothing: the plans of before, byte for byte
    plain = {"pp": 2, "dp": 2, "microbatches": 4, "max_failures": 1, "solver": "greedy", "time_limit": 1.0}
    default, before = precompile(**plain), precompile(**plain, reform="never")  # type: ignore[arg-type]
    assert len(default) == 3 and not default.partitions
    assert {k: p.to_json() for k, p in default.plans.items()} == {k: p.to_json() for k, p in before.plans.items()}


def test_the_precompile_cli_defaults_to_auto_and_indexes_plans_its_worker_processes_re_formed(
        capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    from schedcomp.cli import build_parser

    args = build_parser().parse_args(["precompile", "--pp", "2", "-m", "4", "-k", "1", "-o", "x"])
    assert args.reform == "auto"
    status, out, err = _cli(capsys, "precompile", "--pp", "2", "-m", "4", "-k", "1", "-o", "x", "--reform", "1")
    assert status == 2 and out == "" and "--reform" in err
    # -j 2: the plans are written by worker processes, which must still tell the index which ones re-form
    # (before, saving such a cache failed: their cuts have shares, read as re-cut ones without the partitions)
    job = ("precompile", "--pp", "2", "--dp", "2", "-m", "4", "-k", "1", "--layers", "2", "--time-limit", "1", "-q")
    status, out, _ = _cli(capsys, *job, "-j", "2", "-o", str(tmp_path / "auto"))
    assert status == 0 and out.splitlines()[-1] == ("2 plans re-form pipelines: rollback and restart run them; for "
                                                    "lossy or logging-based recovery precompile with --reform never")
    loaded = PlanCache.load(tmp_path / "auto")
    assert sorted(loaded.partitions.values()) == [((2, 2), (0, 4)), ((2, 2), (4, 0))]
    assert loaded.lookup(["1:0"]).partitions == ((2, 2), (0, 4))
    status, out, _ = _cli(capsys, *job, "--reform", "never", "-o", str(tmp_path / "never"))
    assert status == 0 and "re-form" not in out and not PlanCache.load(tmp_path / "never").partitions


def test_a_mistyped_solver_option_is_refused_not_dropped_as_a_candidate() -> None:
    # Re-routing refuses a bad solver or time limit with a ScheduleError, which `fastest` would have taken for
    # "this candidate cannot build the job" and kept the re-formed plan: checked before any candidate compiles.
    for options, says in (({"solver": "bogus"}, "unknown solver"), ({"time_limit": 0}, "time_limit"),
                          ({"time_limit": float("nan")}, "time_limit")):
        with pytest.raises(ScheduleError, match=says):
            compile(**{**JOB, **options}, failed=["1:1"])  # type: ignore[arg-type]


def test_reform_none_means_never_as_before_auto() -> None:
    assert compile(**JOB, failed=["1:1"], reform=None).to_json() == \
        compile(**JOB, failed=["1:1"], reform="never").to_json()  # type: ignore[arg-type]


def test_a_repair_does_not_carry_its_sources_choice() -> None:
    from schedcomp.repair import repair

    plan = compile(**{**JOB, "pp": 4, "dp": 2, "microbatches": 8, "layers": 4, "failed": ["1:1"],
                      "memory_limit": None})
    assert plan.meta["choice"]["kept"] == "re-route"
    assert "choice" not in repair(plan, Worker(0, 2), memory_limit=None).meta


@pytest.mark.parametrize("job", [
    {**JOB, "failed": ["1:1"]},  # re-forming kept
    {**JOB, "pp": 4, "microbatches": 8, "layers": 4, "failed": ["1:1"], "memory_limit": None},  # re-routing kept
    {**JOB, "failed": ["1:1"], "recut": True},  # re-routing's re-cut pieces (the general simulator path)
    {**JOB, "dp": 3, "failed": ["0:2", "2:0"]},  # two pipelines re-formed
])
def test_the_periods_handed_to_the_choice_are_the_plans_simulated_periods(job: dict[str, object]) -> None:
    # `fastest` simulates no plan: each candidate hands over the period it timed. Read back from JSON (nothing
    # remembered, so `simulate` checks the plan first), the kept plan passes `check` and has the period kept,
    # and the other candidate's period is its own compile's.
    auto = compile(**job)
    choice = auto.meta["choice"]
    fresh = Plan.from_json(auto.to_json())
    assert not is_checked(fresh)
    check(fresh)
    assert _period(fresh) == choice["periods"][choice["kept"]]
    other = "re-form" if choice["kept"] == "re-route" else "re-route"
    if other == "re-route":
        alone = compile(**job, reform="never")
    else:  # (forced re-forming refuses recut: the re-formed candidate ignores it)
        lost = sorted({w.pipeline for w in auto.topology.failed})
        alone = compile(**{k: v for k, v in job.items() if k != "recut"}, reform=lost)
    assert _period(Plan.from_json(alone.to_json())) == choice["periods"][other]


def test_timed_reformed_hands_over_its_plans_period() -> None:
    topology = Topology.of(3, 2, ["1:1"])
    layers = LayerCosts.even(CostModel.uniform(3), 2)
    costs = resolve_limit("fault-free", topology, 4, stage_costs(layers, (2, 2, 2)))
    timed = timed_reformed(topology, 4, costs, layers, (2, 2, 2), (1,), "adaptive")
    assert timed.period == _period(Plan.from_json(timed.plan.to_json()))


def test_finer_pieces_can_win_where_coarser_ones_fit_so_no_finer_level_is_skipped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Why `compile_reformed` times every FINER level that fits: pieces 4x finer shorten the re-formed pipelines'
    # fill and drain, so they beat 2x finer pieces that fit the limit too (31.4375 against 32.875).
    job = {**JOB, "pp": 8, "dp": 4, "microbatches": 8, "layers": 4, "failed": ["0:3", "1:3"], "reform": (0, 1)}
    finest = compile(**job)
    assert finest.meta["reform"]["finer"] == 4
    monkeypatch.setattr("schedcomp.reform.FINER", (1, 2))
    coarser = compile(**job)
    assert coarser.meta["reform"]["finer"] == 2
    assert _period(finest) < _period(coarser)
