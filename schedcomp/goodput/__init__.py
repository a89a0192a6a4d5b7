"""Whole-run goodput: how much training each fault-tolerance strategy delivers under a failure process.

    from schedcomp.goodput import goodput, poisson_failures
    fails = poisson_failures(pp, dp, duration_s, gpu_mtbf_hours=50_000, repair_s=4 * 3600, seed=0)
    result = goodput(pp, dp, microbatches, fails, duration_s=..., checkpoint_s=60, restart_s=600,
                     system_mtbf_s=system_mtbf(pp, dp, 50_000))

`model` holds the door and the strategies, `replay_costs` logging-based recovery's terms, `failures`
the failure model and trace reader, `rates` each strategy's throughput per canonical failure set,
`engine` the walk through time. No torch.
"""

from schedcomp.goodput.failures import Failure, load_trace, observed_mtbf, parse_trace, poisson_failures, system_mtbf
from schedcomp.goodput.model import (
    MEASURED,
    STRATEGIES,
    GoodputResult,
    LoggingCosts,
    Recovery,
    StrategyRun,
    first_order,
    goodput,
    young_daly,
)

__all__ = [
    "MEASURED",
    "STRATEGIES",
    "Failure",
    "GoodputResult",
    "LoggingCosts",
    "Recovery",
    "StrategyRun",
    "first_order",
    "goodput",
    "load_trace",
    "observed_mtbf",
    "parse_trace",
    "poisson_failures",
    "system_mtbf",
    "young_daly",
]
