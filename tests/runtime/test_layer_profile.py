"""Per-layer costs measured by `schedcomp.runtime.layer_profile` (one process, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from schedcomp.compiler import compile
from schedcomp.errors import RuntimeSetupError
from schedcomp.layers import LayerCosts
from schedcomp.runtime.layer_profile import FORMAT, main, profile_layers

ROWS, WIDTH, HIDDEN = 5, 4, 6
F64 = 8  # bytes


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 3)).double()


def test_memory_per_layer_is_what_each_layer_holds() -> None:
    model = _model()
    x, y = torch.randn(ROWS, WIDTH, dtype=torch.float64), torch.randn(ROWS, 3, dtype=torch.float64)
    prof = profile_layers(model, x, y, nn.functional.mse_loss, lambda p: torch.optim.Adam(p, lr=1e-3), repeats=2)
    assert len(prof.forward) == len(model) and min(prof.forward) > 0 and min(prof.backward_input) > 0
    # F of a split linear saves its input (for W); tanh saves its output; the last linear its input, and
    # the MSE loss its input and target.
    assert prof.activation == (ROWS * WIDTH * F64, ROWS * HIDDEN * F64, ROWS * HIDDEN * F64 + 2 * ROWS * 3 * F64)
    # Static: weights, their gradients and Adam's two moments (4 copies) plus Adam's step counters.
    linear = [(WIDTH * HIDDEN + HIDDEN) * F64, 0, (HIDDEN * 3 + 3) * F64]
    steps = [2 * 4, 0, 2 * 4]  # one float32 `step` per parameter tensor (weight, bias), stored apart
    assert list(prof.static) == [4 * b + s for b, s in zip(linear, steps, strict=True)]
    assert prof.b_frees[1] == 1.0  # tanh's backward keeps nothing for W
    assert all(0.0 <= f <= 1.0 for f in prof.b_frees)


def test_the_file_is_a_layer_cost_file(tmp_path) -> None:
    out = tmp_path / "layers.json"
    lines: list[str] = []
    assert main(["-o", str(out), "--repeats", "1", "--rows", "2"], out=lines.append) == 0
    data = json.loads(out.read_text())
    assert data["format"] == FORMAT and data["memory_unit"] == "bytes"
    layers = len(data["forward"])
    assert layers >= 3 and all(len(data[k]) == layers for k in ("backward_input", "activation", "static"))
    assert data["allreduce"] == [0.0] * layers and "layers" in lines[0]
    # the compiler reads it as per-layer costs, and plans with it (its stage model sums the layers)
    costs = LayerCosts.load(out)
    assert costs.layers == layers and costs.static == tuple(data["static"])
    plan = compile(2, 2, 4, failed=["1:1"], layers=costs, memory_limit=None)
    assert sum(plan.partition) == layers and plan.costs.memory_unit == "bytes"


@pytest.mark.parametrize("bad", [nn.Linear(2, 2), nn.Sequential()])
def test_a_model_that_is_not_a_sequential_is_refused(bad: nn.Module) -> None:
    with pytest.raises(RuntimeSetupError, match=r"nn\.Sequential"):
        profile_layers(bad, torch.zeros(1, 2), None, nn.functional.mse_loss,  # type: ignore[arg-type]
                       lambda p: torch.optim.SGD(p, lr=0.1))


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["-o", str(tmp_path / "x.json"), "--repeats", "0"])
    assert exc.value.code == 2 and "--repeats must be positive" in capsys.readouterr().err
    missing = tmp_path / "no-such-dir" / "layers.json"
    assert main(["-o", str(missing), "--repeats", "1", "--rows", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err and not missing.exists()
