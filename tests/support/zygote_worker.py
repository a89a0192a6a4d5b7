"""A worker the zygote tests fork (`fault.zygote`): `report OUT`, `exit N`, `raise` or `sleep [READY_FILE]`."""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
import time


def main(what: str, *args: str) -> None:
    if what == "report":
        out = args[0]

        def late() -> None:  # a non-daemon thread: the process must wait for it before it exits
            time.sleep(0.2)
            with open(out + ".thread", "w") as f:
                f.write("done")

        threading.Thread(target=late).start()
        atexit.register(lambda: open(out + ".atexit", "w").close())
        with open(out, "w") as f:
            json.dump({"x": os.environ.get("ZYGOTE_X"), "argv": sys.argv, "path0": sys.path[0],
                       "name": __name__, "random": random.random()}, f)
    elif what == "exit":
        sys.exit(int(args[0]))
    elif what == "raise":
        raise ValueError("boom")
    elif what == "sleep":
        if args:  # tell whoever waits that we are running our own code (signals are ours now)
            open(args[0], "w").close()
        time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:])
