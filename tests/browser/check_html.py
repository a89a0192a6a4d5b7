"""Check `schedcomp show --html` in a real headless browser: the page's self-test (hover, zoom, pan,
reset) must pass, with boxes, labels and the failed worker's row drawn in the planned and the measured
panel, and a screenshot is taken.

    python tests/browser/check_html.py [OUT_DIR]     # exit 0: pass; 1: fail; 77: no Chromium (skipped)

It writes a failure plan's page to OUT_DIR (default: a temporary folder), opens it as
`page.html#selftest` with `chromium --headless --dump-dom`, which runs the page's script, reads the
JSON the self-test wrote into `<pre id="selftest">`, and saves `page.png` with `--screenshot`.
Needs Chromium from the OS packages (`apt-get install chromium`); no Python package beyond schedcomp.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SKIPPED = 77
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
SHOW = ["show", "--schedule", "adaptive", "--pp", "4", "--dp", "2", "-m", "8", "--fail", "1:2", "--json"]


def browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def run_browser(exe: str, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--virtual-time-budget=5000", "--window-size=1400,900"]
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=120)


def check(out: Path) -> tuple[bool, dict]:
    from schedcomp.cli import main

    page, trace = out / "page.html", out / "trace.json"
    with contextlib.redirect_stdout(io.StringIO()):  # the summaries: not what is checked
        # the plan's own simulated trace stands in for a measured run: the page draws both
        status = main([*SHOW, "--trace", str(trace)]) or main([*SHOW, "--measured", str(trace), "--html", str(page)])
    if status != 0:
        return False, {"error": f"schedcomp show exited {status}"}
    exe = browser()
    assert exe is not None
    dom = run_browser(exe, "--dump-dom", page.as_uri() + "#selftest").stdout
    found = re.search(r'<pre id="selftest">(.*?)</pre>', dom, re.S)
    if not found or not found.group(1).strip():
        return False, {"error": "the page's self-test wrote nothing (did its script run?)", "dom": dom[:500]}
    result = json.loads(html.unescape(found.group(1)))
    run_browser(exe, f"--screenshot={out / 'page.png'}", page.as_uri())
    result["screenshot"] = str(out / "page.png") if (out / "page.png").exists() else None
    ok = (result.get("pass") is True and result["panels"] == 2 and min(result["boxes"]) > 0 and result["labels"][0] > 0
          and result["failed_rows"][0] == 1 and result["rerouted"] and result["screenshot"] is not None)
    return ok, result


def main(argv: list[str]) -> int:
    if browser() is None:
        print(f"skipped: no Chromium ({', '.join(BROWSERS)}) on PATH; apt-get install chromium")
        return SKIPPED
    if argv:
        out = Path(argv[0])
        out.mkdir(parents=True, exist_ok=True)
        ok, result = check(out)
    else:
        with tempfile.TemporaryDirectory(prefix="schedcomp-html-") as folder:
            ok, result = check(Path(folder))
    print(json.dumps(result, indent=1))
    print("pass" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
