"""Fork workers of every kind from a zygote (`fault.zygote`) and print what happened, as one JSON line.

Run as a process of its own (`python zygote_check.py OUTDIR`): a zygote makes its parent a child
subreaper, which should not outlive this check (the test runner must stay an ordinary process).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from schedcomp.runtime.fault.zygote import Zygote

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "zygote_worker.py")

if __name__ == "__main__":
    out = Path(sys.argv[1])
    zygote = Zygote(["json"])
    env = dict(os.environ)
    procs = {
        "script": zygote.spawn([sys.executable, WORKER, "report", str(out / "script")], {**env, "ZYGOTE_X": "1"}),
        "module": zygote.spawn([sys.executable, "-m", "zygote_worker", "report", str(out / "module")],
                               {**env, "ZYGOTE_X": "2"}),
        "exit": zygote.spawn([sys.executable, WORKER, "exit", "3"], env),
        "raise": zygote.spawn([sys.executable, WORKER, "raise"], env),
        "sleep": zygote.spawn([sys.executable, WORKER, "sleep"], env),
    }
    procs["sleep"].kill()
    os.kill(zygote.proc.pid, signal.SIGINT)  # ^C reaches the whole process group: the zygote carries on
    ready = out / "sleeping"
    procs["interrupted"] = zygote.spawn([sys.executable, WORKER, "sleep", str(ready)], env)
    while not ready.exists():  # interrupt it in its own code, not while it is still becoming the worker
        time.sleep(0.01)
    os.kill(procs["interrupted"].pid, signal.SIGINT)
    codes = {name: p.wait(timeout=60) for name, p in procs.items()}
    zygote.close()
    print(json.dumps({"codes": codes, "zygote": zygote.proc.returncode}))
