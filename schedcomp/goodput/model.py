"""`goodput(...)`: how much training each strategy delivers over a whole run with failures.

Every strategy meets the same failures (`failures.py`); its throughput under each failure set comes
from `rates.Rates` (the compiler's plans and `compare`'s models, one evaluation per canonical
failure set); `engine.run` walks the run in time. Strategies:

- adaptive: re-route the failed workers' micro-batches (the plan cache's plan for the failed set),
  roll back the iteration in flight; recovery pause = detection + agreement + plan switch (the
  runtime's measured figures, `MEASURED`); a repaired worker rejoins after `repair` (plan switch).
- lossy: as adaptive, but the iteration in flight is finished without the lost micro-batches.
- checkpoint-restart: every failure restarts the job from its last checkpoint, on spares (restart
  cost S; without spares it waits for the repair), checkpointing at the Young/Daly interval
  sqrt(2 C M) for the system MTBF M; checkpoint-restart-best: at the best interval of a sweep
  (2^(k/4) times Young/Daly, k = -12..12) on the same failures.
- logging: as adaptive, but a stage that lost every replica is rebuilt on spares from its checkpoint
  by replaying its neighbours' logs (SWIFT, `runtime.fault.swift`) instead of restarting the job:
  the pause, `restart_s` for the replacements to start, then `replay_s` per iteration since the
  checkpoint (one stage's share of an iteration, all its micro-batches, from the cost model); every
  iteration costs logging's overhead more: measured, or modelled from the boundary tensors' bytes and
  the copy bandwidth, or an assumed 2 % (`replay_costs`). Two adjacent lost stages restart as adaptive does.
- drop-pipeline, oobleck, bamboo: `schedcomp.baselines`' models, recovering as adaptive does (the
  same measured pause: in their favour, as none of them was measured here).

The strategies that absorb failures restart from a checkpoint only when they cannot go on (a stage
lost every replica, two neighbouring stages for bamboo, ...). They checkpoint at the Young/Daly
interval for the mean time between *those* stops on this run's failures, and not at all when none
happens: an oracle in their favour, as the sweep's best interval is for checkpoint-restart.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from schedcomp.costs import CostModel
from schedcomp.errors import SchedcompError
from schedcomp.goodput.engine import Outcome, Policy, run
from schedcomp.goodput.failures import HOUR, Failure
from schedcomp.goodput.rates import Rates
from schedcomp.goodput.replay_costs import LOGGING, LoggingCosts, replay_seconds
from schedcomp.topology import Topology, Worker

STRATEGIES = ("adaptive", "lossy", "logging", "checkpoint-restart", "checkpoint-restart-best", "drop-pipeline",
              "oobleck", "bamboo")
_SOURCE = {"adaptive": "adaptive", "lossy": "adaptive", "logging": "adaptive", "drop-pipeline": "drop-pipeline",
           "oobleck": "oobleck", "bamboo": "bamboo"}
SWEEP = tuple(2 ** (k / 4) for k in range(-12, 13))
"""Checkpoint intervals tried by checkpoint-restart-best, as multiples of the Young/Daly interval."""


@dataclass(frozen=True)
class Recovery:
    """Seconds from a worker's death to training on the new plan, in three parts, and to rejoin."""

    detection_s: float
    agreement_s: float
    switch_s: float

    @property
    def pause_s(self) -> float:
        return self.detection_s + self.agreement_s + self.switch_s


MEASURED = Recovery(detection_s=0.041, agreement_s=0.047, switch_s=0.008)
"""Measured by `python bench/bench_fault.py --quick` (Table 1, 4 processes on CPU/gloo, death notice
path): broken 0.041 s, agreed 0.088 s, working on the new generation 0.096 s after the death."""


@dataclass(frozen=True)
class StrategyRun:
    """One strategy's whole run."""

    strategy: str
    goodput: float  # useful iterations per hour
    relative_goodput: float  # of the fault-free job's
    failures: int
    stops: int  # failures it met by restarting from a checkpoint
    lost_hours: float  # fault-free hours of training not delivered
    checkpoint_interval_s: float | None  # None: it took no checkpoints
    ceiling: float = 1.0  # its relative throughput without failures (its own schedule's cost)
    series: tuple[tuple[float, float], ...] = ()  # (seconds, useful iterations), when asked for

    def to_dict(self) -> dict[str, object]:
        return {"strategy": self.strategy, "goodput": self.goodput, "relative_goodput": self.relative_goodput,
                "failures": self.failures, "stops": self.stops, "lost_hours": self.lost_hours,
                "checkpoint_interval_s": self.checkpoint_interval_s, "ceiling": self.ceiling}


@dataclass(frozen=True)
class GoodputResult:
    """Every strategy's run on the same failures, and what they were measured against."""

    runs: tuple[StrategyRun, ...]
    fault_free_goodput: float  # iterations per hour
    iteration_s: float
    duration_s: float
    system_mtbf_s: float
    failures: tuple[Failure, ...]
    fidelity: str
    scenarios: int  # distinct canonical failure sets evaluated
    logging_overhead: float = 0.0  # the logging strategy's step-time overhead (a fraction; `replay_costs`)


def young_daly(checkpoint_s: float, mtbf_s: float) -> float:
    """The first-order optimal checkpoint interval sqrt(2 C M) (inf when nothing fails)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s) if math.isfinite(mtbf_s) else math.inf


def first_order(checkpoint_s: float, interval_s: float, restart_s: float, mtbf_s: float) -> float:
    """Relative goodput of checkpoint-restart to first order: 1 - C/tau - (tau/2 + S)/M."""
    return 1.0 - checkpoint_s / interval_s - (interval_s / 2.0 + restart_s) / mtbf_s


def goodput(pp: int, dp: int, microbatches: int, failures: Sequence[Failure], *, duration_s: float,
            checkpoint_s: float, restart_s: float, system_mtbf_s: float, costs: CostModel | None = None,
            iteration_s: float | None = None, recovery: Recovery = MEASURED, spares: bool = True,
            strategies: Sequence[str] = STRATEGIES, fidelity: str = "auto", samples: int = 0,
            progress: Callable[[int, int, str], None] | None = None, logging: LoggingCosts = LOGGING) -> GoodputResult:
    """Simulate each strategy over `duration_s` seconds of `failures` (see the module docstring).

    `iteration_s`: seconds per fault-free iteration (default: the fault-free plan's period, i.e. the
    cost model's unit is a second). `system_mtbf_s` sets the Young/Daly interval. `samples` > 0
    records each strategy's progress at that many times (for drawing). `progress(done, total, name)` is
    called after each strategy (the CLI's progress bar)."""
    _check(pp=pp, dp=dp, microbatches=microbatches)
    _check_seconds(duration_s=duration_s, positive=True)
    _check_seconds(system_mtbf_s=system_mtbf_s, positive=True, finite=False)
    _check_seconds(checkpoint_s=checkpoint_s, restart_s=restart_s, detection_s=recovery.detection_s,
                   agreement_s=recovery.agreement_s, switch_s=recovery.switch_s)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise SchedcompError(f"unknown strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)}")
    Topology(pp, dp)  # rejects a bad shape before any work
    costs = CostModel.uniform(pp) if costs is None else costs
    if costs.pp != pp:
        raise SchedcompError(f"the cost model has {costs.pp} stages but pp is {pp}: give one entry per stage")
    rates = Rates(pp, dp, microbatches, costs, fidelity, {_SOURCE[s] for s in strategies if s in _SOURCE})
    period = rates.fault_free_period()
    if iteration_s is None:
        iteration_s = period
    _check_seconds(iteration_s=iteration_s, positive=True)
    replay_s = replay_seconds(costs, dp, microbatches, period, iteration_s, logging.replay_speed)
    overhead = logging.step_overhead(microbatches, iteration_s)
    runs = []
    for name in strategies:
        outcome, interval = _strategy(name, failures, rates, recovery, duration_s=duration_s,
                                      checkpoint_s=checkpoint_s, restart_s=restart_s, mtbf_s=system_mtbf_s,
                                      iteration_s=iteration_s, spares=spares, samples=samples,
                                      replay=(replay_s, 1.0 + overhead))
        fault_free = duration_s / iteration_s  # iterations the fault-free job would deliver
        runs.append(StrategyRun(
            strategy=name, goodput=outcome.useful * HOUR / duration_s, relative_goodput=outcome.useful / fault_free,
            failures=sum(1 for f in failures if f.time < duration_s), stops=outcome.stops,
            lost_hours=(fault_free - outcome.useful) * iteration_s / HOUR,
            checkpoint_interval_s=interval if math.isfinite(interval) else None,
            ceiling=rates.relative(_SOURCE[name], frozenset()) if name in _SOURCE else 1.0, series=outcome.series))
        if progress is not None:
            progress(len(runs), len(strategies), name)
    return GoodputResult(tuple(runs), HOUR / iteration_s, iteration_s, duration_s, system_mtbf_s,
                         tuple(failures), rates.fidelity, rates.scenarios, overhead)


def _strategy(name: str, failures: Sequence[Failure], rates: Rates, recovery: Recovery, *, duration_s: float,
              checkpoint_s: float, restart_s: float, mtbf_s: float, iteration_s: float, spares: bool,
              samples: int, replay: tuple[float, float] = (0.0, 1.0)) -> tuple[Outcome, float]:
    """One strategy's run and the checkpoint interval it used."""
    def simulate(policy: Policy, n: int = 0) -> Outcome:
        return run(failures, relative, policy, duration_s=duration_s, iteration_s=iteration_s, dp=rates.dp,
                   samples=n)

    def interval(mtbf: float) -> float:
        return max(young_daly(checkpoint_s, mtbf), iteration_s)  # no finer than one iteration

    source = _SOURCE.get(name)

    def relative(failed: frozenset[Worker]) -> float:
        return rates.relative(source, failed) if source is not None else 1.0

    if source is None:  # checkpoint-restart
        tries = [interval(mtbf_s)] if name == "checkpoint-restart" else sorted(
            {max(interval(mtbf_s) * f, iteration_s) for f in SWEEP})
        policies = [Policy("restart", t, checkpoint_s, restart_s, spares=spares) for t in tries]
        best = max(policies, key=lambda p: simulate(p).useful)
        return simulate(best, samples), best.interval
    kind = {"lossy": "lossy", "logging": "replay"}.get(name, "rollback")
    extra = {"replay_s": replay[0], "slowdown": replay[1]} if kind == "replay" else {}
    policy = Policy(kind, math.inf, checkpoint_s, restart_s, recovery.pause_s, recovery.switch_s, **extra)
    first = simulate(policy)
    stops = first.stops + first.replays  # a replay's cost, like a restart's, grows with the checkpoint interval
    if stops:
        policy = Policy(kind, interval(duration_s / stops), checkpoint_s, restart_s, recovery.pause_s,
                        recovery.switch_s, **extra)
    return simulate(policy, samples), policy.interval


def _check(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SchedcompError(f"{name} must be a positive integer, got {v!r}")


def _check_seconds(*, positive: bool = False, finite: bool = True, **values: float) -> None:
    for name, v in values.items():
        ok = isinstance(v, (int, float)) and not math.isnan(v) and (v > 0 if positive else v >= 0)
        if not ok or (finite and not math.isfinite(v)):
            need = "a positive" if positive else "a non-negative"
            raise SchedcompError(f"{name} must be {need} {'finite ' if finite else ''}number of seconds, got {v!r}")
