#!/usr/bin/env bash
# Run the GPU suite (tests/gpu) and then bench/bench_gpu.py on a machine with CUDA, without installing
# the repository; everything printed also goes to one results file.
#
#   tests/gpu/run.sh                 # results in $OUT/gpu-results.txt if $OUT is set, else bench/results/
#   PYTHON=python3.11 tests/gpu/run.sh
#
# Needs python with torch (CUDA), numpy, networkx and pytest. No OR-tools: the plans that need the
# adaptive compiler are shipped in tests/gpu/plans/ (tests/gpu/make_plans.py writes them).
set -uo pipefail
# PYTHON and OUT as the caller gave them, from the caller's folder; made absolute (links kept: a venv's
# python is a link) because the script then runs from the repository and Python from a shim's folder.
PY=${PYTHON:-python3}
[[ $PY == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
if [[ -n ${OUT:-} ]]; then
  mkdir -p "$OUT" && RESULTS_DIR=$(cd "$OUT" && pwd) || exit 2
fi
cd "$(dirname "$0")/../.."
REPO=$PWD
RESULTS_DIR=${RESULTS_DIR:-$REPO/bench/results}
mkdir -p "$RESULTS_DIR"
RESULTS=$RESULTS_DIR/gpu-results.txt

# pyproject.toml maps schedcomp.schedules -> schedules/ and schedcomp.runtime -> runtime/ (package-dir):
# a folder of links gives Python the installed layout with no pip, no build and no network.
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir "$SHIM/schedcomp"
for entry in "$REPO"/schedcomp/*; do ln -s "$entry" "$SHIM/schedcomp/"; done
ln -s "$REPO/schedules" "$SHIM/schedcomp/schedules"
ln -s "$REPO/runtime" "$SHIM/schedcomp/runtime"
export PYTHONPATH=$SHIM${PYTHONPATH:+:$PYTHONPATH}
# `python -` and `python -m pytest` put the working directory first on the path: the repository root's
# schedcomp/ lacks schedules/ and runtime/. PYTHONSAFEPATH (Python >= 3.11) stops that, and Python runs from
# the shim's folder, whose schedcomp/ is the whole package, where it does not apply (3.10).
export PYTHONSAFEPATH=1
cd "$SHIM"

{
  echo "== GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$PY" - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "numpy", "networkx", "pytest") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)}: install them for {sys.executable}")
import torch
import schedcomp, schedcomp.runtime  # the shim works, without OR-tools
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if gpus else 'n/a'}, {len(gpus)} GPU(s): {', '.join(gpus)}")
print(f"schedcomp from {schedcomp.__file__}")
PY
} 2>&1 | tee "$RESULTS"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2

echo "== pytest tests/gpu" | tee -a "$RESULTS"
# --confcutdir: tests/conftest.py (hypothesis profiles) is not needed here; -p no:cacheprovider: read-only trees
"$PY" -m pytest "$REPO/tests/gpu" -q -rs --confcutdir="$REPO/tests/gpu" -p no:cacheprovider -o addopts="" 2>&1 | tee -a "$RESULTS"
status=${PIPESTATUS[0]}

echo "== python bench/bench_gpu.py ${BENCH_ARGS:-}" | tee -a "$RESULTS"
# shellcheck disable=SC2086
"$PY" "$REPO/bench/bench_gpu.py" ${BENCH_ARGS:-} 2>&1 | tee -a "$RESULTS"
bench=${PIPESTATUS[0]}
echo "== pytest exit $status, bench exit $bench; results in $RESULTS" | tee -a "$RESULTS"
[ "$status" -eq 0 ] && [ "$bench" -eq 0 ]
