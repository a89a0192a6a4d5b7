"""The distribution installs as `schedcomp`, `schedcomp.schedules` and `schedcomp.runtime`, with no
generic top-level name, both as a normal install and as the editable one the test suite runs on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import schedcomp
import schedcomp.runtime
import schedcomp.schedules

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_maps_the_three_folders() -> None:
    assert Path(schedcomp.__file__).parent == ROOT / "schedcomp"
    assert Path(schedcomp.schedules.__file__).parent == ROOT / "schedules"
    assert Path(schedcomp.runtime.__file__).parent == ROOT / "runtime"


@pytest.mark.slow  # > 5 s: a pip install in a subprocess
def test_normal_install_imports_from_site_packages_only(tmp_path: Path) -> None:
    target = tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT)],
        check=True, capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )
    assert "project.license" not in built.stderr  # the license is an SPDX string, not the deprecated table
    assert (target / "schedcomp" / "draw" / "timeline.html").is_file()  # the HTML view's page template
    # Only the schedcomp package (and its metadata) lands at the top level: no `runtime` or `schedules`.
    top = {p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info")) and p.name != "bin"}
    assert top == {"schedcomp"}
    probe = (
        "import sys, schedcomp, schedcomp.schedules, schedcomp.runtime, schedcomp.cli, schedcomp.runtime.fault;"
        "print(schedcomp.__file__); print(schedcomp.schedules.FAMILIES['zb-h1'].name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path[:0] = [{str(target)!r}]; {probe}"],
        check=True, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    ).stdout.split()
    assert out[0].startswith(str(target))
    assert out[1] == "zb-h1"
