"""Run every benchmark in bench/, one after the other, printing each one's tables.

Reproduce:  make bench            (everything: about 35 minutes on a 2-core machine)
            python bench/run_all.py --quick     (the smaller variants, a few minutes)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (script, arguments for --quick); split backward runs its CPU variant when no GPU is present.
BENCHES = [
    ("bench_compiler.py", ["--quick"]),
    ("bench_compile_speed.py", ["--repeat", "1"]),
    ("bench_repair_sweep.py", []),
    ("bench_validate.py", ["--max-rows", "50000"]),
    ("bench_adaptive.py", ["--quick"]),
    ("bench_runtime.py", ["--repeats", "1"]),
    ("bench_split_backward.py", []),
    ("bench_training.py", ["--hidden", "256", "--repeats", "1"]),
    ("bench_fault.py", ["--quick"]),
    ("bench_rejoin.py", ["--quick"]),
    ("bench_moves.py", ["--hidden", "256", "--moved", "1", "--rounds", "2"]),
    ("bench_logging.py", ["--quick"]),
    ("bench_goodput.py", ["--quick"]),
    ("bench_checkpoint.py", ["--quick"]),
    ("bench_checkpoint_checks.py", ["--quick"]),
    ("bench_checkpoint_layers.py", ["--quick"]),
    ("bench_protocol_model.py", ["--members", "3", "4", "5"]),
    ("bench_timecore.py", ["--repeat", "1"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="run the smaller variant of each benchmark")
    args = parser.parse_args()
    failed = []
    for script, quick in BENCHES:
        command = [sys.executable, str(HERE / script), *(quick if args.quick else [])]
        print(f"\n=== {' '.join(command[1:])}", flush=True)
        if subprocess.run(command, check=False).returncode != 0:
            failed.append(script)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
