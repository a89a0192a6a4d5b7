"""The plans shipped for the GPU suite (tests/gpu/plans/, compiled here because the GPU machine has no
OR-tools) are what the compiler writes today: stale ones would test an old plan on the GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"


def test_shipped_gpu_plans_equal_a_fresh_compile(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("make_plans", GPU_TESTS / "make_plans.py")
    assert spec is not None and spec.loader is not None
    make_plans = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_plans)
    make_plans.write_plans(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    shipped = {p.relative_to(make_plans.PLANS): p.read_text() for p in make_plans.PLANS.rglob("*") if p.is_file()}
    assert sorted(shipped) == sorted(fresh), "run python tests/gpu/make_plans.py"
    stale = [str(name) for name, text in fresh.items() if shipped[name] != text]
    assert not stale, f"stale GPU plans {stale}: run python tests/gpu/make_plans.py"
