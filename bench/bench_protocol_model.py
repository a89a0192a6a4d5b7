"""The recovery protocol's exhaustive model (issue 11): states explored and time, per scenario, job size and deaths.

Every interleaving of every worker's steps, with up to `deaths` deaths at every step, checked for
agreement, termination and that nobody waits on a dead member (`tests/support/protocol_model.py`). States
are counted after the reductions (one state per renaming class, one local step alone where there
is one, store keys nobody reads again forgotten); `plain` is the same search without them (only for
small jobs: it grows much faster). A property that fails stops the script with its violation.

Reproduce (one process; about 6 minutes on the shared 2-core machine, most of it 6 members with 2 deaths):

    python bench/bench_protocol_model.py                      # 3-6 members, 1 and 2 deaths, every scenario
    python bench/bench_protocol_model.py --members 3 4 5      # the quick variant (`run_all.py --quick`), ~15 s
    python bench/bench_protocol_model.py --members 4 --scenarios recovery --deaths 2 --plain-up-to 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from protocol_model import SCENARIOS, search  # the model lives with the tests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[3, 4, 5, 6], choices=[3, 4, 5, 6])
    parser.add_argument("--deaths", type=int, nargs="+", default=[1, 2], choices=[0, 1, 2, 3])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--plain-up-to", type=int, default=3, metavar="MEMBERS",
                        help="also search without reductions for jobs up to this many members (default 3)")
    args = parser.parse_args()
    print("| scenario | members | deaths | states | quiescent | seconds | plain states | plain seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for members in args.members:
        for scenario in args.scenarios:
            for deaths in args.deaths:
                model = search(scenario, members, deaths)
                plain = ["", ""]
                if members <= args.plain_up_to:
                    full = search(scenario, members, deaths, reduced=False)
                    plain = [f"{full.explored:,}", f"{full.seconds:.1f}"]
                print(f"| {scenario} | {members} | {deaths} | {model.explored:,} | {model.quiescent:,} | "
                      f"{model.seconds:.1f} | {' | '.join(plain)} |", flush=True)
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"\ntotal {time.perf_counter() - start:.0f} s", file=sys.stderr)
    raise SystemExit(code)
