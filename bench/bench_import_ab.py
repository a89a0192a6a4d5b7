"""`import-torch` of a large CSV, this checkout against another one, side by side in one process (issue 17).

On a shared machine CPU seconds swing by a fifth from run to run, so two separate benchmark runs cannot
show a 10% change. This script runs both versions in one process, alternating on the same CSV, so both
see the same load, and checks that they write the same bytes.

Reproduce (from the repository root; OTHER is a checkout of the version to compare with, e.g. main's
worktree):

    python bench/bench_import_ab.py OTHER                # 200,000 rows, 3 runs each
    python bench/bench_import_ab.py OTHER --rows 20000 --repeat 2
    python bench/bench_import_ab.py OTHER --phases       # and each phase's CPU seconds, alternating too

The other checkout's `schedcomp/` and `schedules/` are copied to a temporary directory as the package
`schedcomp_other` (its `schedcomp` imports renamed), so both import side by side without installing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from bench_validate import gpipe_csv

_IMPORT = re.compile(r"\bschedcomp(?=\.| import)")


def other_cli(checkout: Path, into: Path) -> ModuleType:
    """`checkout`'s `schedcomp.cli`, imported as `schedcomp_other.cli` from a renamed copy under `into`."""
    package = into / "schedcomp_other"
    shutil.copytree(checkout / "schedcomp", package)
    shutil.copytree(checkout / "schedules", package / "schedules")  # installed as schedcomp.schedules
    for source in package.rglob("*.py"):
        source.write_text(_IMPORT.sub("schedcomp_other", source.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module("schedcomp_other.cli")


def run(cli: ModuleType, csv: Path, out: Path) -> tuple[float, float, bytes]:
    """CPU and wall seconds of one `import-torch CSV -o OUT`, and the bytes it wrote."""
    c0, t0 = time.process_time(), time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["import-torch", str(csv), "-o", str(out)])
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"{cli.__name__}: import-torch exited {code}")
    return cpu, wall, out.read_bytes()


def phases(package: str, text: str) -> tuple[float, ...]:
    """CPU seconds of parse, lower, check, JSON and freeing the plan, in `package` (the collector paused)."""
    serialize, lower, check, costs, gcpause = (
        importlib.import_module(f"{package}.{m}") for m in ("serialize", "lower", "check", "costs", "gcpause"))
    with gcpause.paused_gc():
        c0 = time.process_time()
        order = serialize.order_from_torch_csv(text)
        c1 = time.process_time()
        plan = lower.lower(order, costs.CostModel.uniform(order.topology.pp))
        c2 = time.process_time()
        check.check(plan)
        c3 = time.process_time()
        serialize.plan_to_json(plan)
        c4 = time.process_time()
        del plan, order
        c5 = time.process_time()
    return c1 - c0, c2 - c1, c3 - c2, c4 - c3, c5 - c4


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its root, holding schedcomp/ and schedules/)")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="also time each phase, alternating, best of --repeat")
    args = ap.parse_args(argv)

    import schedcomp.cli as this

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        other = other_cli(args.other.resolve(), work)
        csv = work / "schedule.csv"
        csv.write_text(gpipe_csv(args.rows))
        times: dict[str, list[tuple[float, float]]] = {"other": [], "this": []}
        for _ in range(args.repeat):
            written = {}
            for name, cli in (("other", other), ("this", this)):
                cpu, wall, written[name] = run(cli, csv, work / f"{name}.json")
                times[name].append((cpu, wall))
            if written["other"] != written["this"]:
                raise SystemExit("the two checkouts wrote different plans")
        split: dict[str, list[tuple[float, ...]]] = {"other": [], "this": []}
        for _ in range(args.repeat if args.phases else 0):
            for name, package in (("other", "schedcomp_other"), ("this", "schedcomp")):
                split[name].append(phases(package, csv.read_text()))
    print(f"import-torch of a {args.rows:,}-row CSV, alternating, same bytes written ({len(written['this']):,})")
    for name, path in (("other", args.other), ("this", Path.cwd())):
        cpu = " ".join(f"{c:.2f}" for c, _ in times[name])
        wall = " ".join(f"{w:.1f}" for _, w in times[name])
        print(f"  {name:5} ({path}): CPU s {cpu} | wall s {wall}")
        if split[name]:
            best = [min(column) for column in zip(*split[name], strict=True)]
            print("        phases, best of {} (CPU s): parse {:.2f}, lower {:.2f}, check {:.2f}, JSON {:.2f}, "
                  "free {:.2f}".format(len(split[name]), *best))


if __name__ == "__main__":
    main()
