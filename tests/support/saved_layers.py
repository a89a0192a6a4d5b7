"""Multi-process runtime tests save, per process, its worker, losses and the layers it holds; this checks
them against one process's reference model (`compare_saved`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from schedcomp.ir import Plan

TOL = 1e-10


def compare_saved(outdir: Path, plan: Plan, net: nn.Sequential, want_losses: list[float] | None) -> list[int]:
    """Every saved layer (and loss, unless `want_losses` is None) against the reference `net`, within 1e-10;
    returns the layers seen, with repeats (one per holder), sorted."""
    results = [torch.load(f) for f in sorted(outdir.glob("*.pt"))]
    assert sorted(r["worker"] for r in results) == sorted(map(str, plan.workers))
    seen = []
    for result in results:
        if want_losses is not None:
            assert result["losses"] == pytest.approx(want_losses, abs=TOL, rel=0), result["worker"]
        for layer, state in result["held"].items():
            seen.append(layer)
            for name, want in net[layer].state_dict().items():
                err = (state[name] - want).abs().max().item()
                assert err <= TOL, f"{result['worker']} layer {layer} {name} is off by {err:.3g}"
    return sorted(seen)
