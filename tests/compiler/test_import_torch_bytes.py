"""`import-torch` writes the same bytes as the version that recorded `data/import_torch/*.json`.

The import path is tuned for speed (issue 17: a 200k-row CSV in under 10 s); these files pin its
output so that no shortcut changes a plan: zero-bubble (split B/W, PyTorch's I and W), 1F1B with a
fused backward run by two pipelines (`--dp 2`), and a CSV with idle cells.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from schedcomp.cli import main

DATA = Path(__file__).parent / "data" / "import_torch"


@pytest.mark.parametrize(("name", "args"), [("zb_h1", []), ("1f1b", ["--dp", "2"]), ("fused", [])])
def test_import_torch_writes_the_recorded_plan(tmp_path, capsys, name, args):
    out = tmp_path / "plan.json"
    assert main(["import-torch", str(DATA / f"{name}.csv"), *args, "-o", str(out)]) == 0
    assert out.read_bytes() == (DATA / f"{name}.json").read_bytes()


def test_import_torch_to_stdout_writes_the_same_bytes(capsys):
    assert main(["import-torch", str(DATA / "zb_h1.csv")]) == 0
    assert capsys.readouterr().out == (DATA / "zb_h1.json").read_text()
