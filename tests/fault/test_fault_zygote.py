"""Workers forked from a process that imported torch (`launch --preload`, `fault.zygote`) behave as started afresh.

The chaos, lossy, restart, SWIFT and host tests run their workers this way (`fault_procs.run_job`);
these tests check the zygote itself on cheap workers, in a process of its own (a zygote makes its
parent a child subreaper).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fault_procs import HERE

from schedcomp.errors import SchedcompError
from schedcomp.runtime.fault.launch_args import parse_args
from schedcomp.runtime.fault.zygote import python_target

SUPPORT = HERE.parent


@pytest.mark.slow  # over ~5 s: make test-fast leaves it to make test
def test_forked_workers_get_their_own_environment_arguments_and_exit_status(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SUPPORT / "zygote_check.py"), str(tmp_path)], cwd=SUPPORT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # exit statuses as a fresh interpreter gives them: sys.exit(3), an uncaught exception, SIGKILL; read
    # with waitpid by the checking process, so the workers were its children (not the zygote's)
    # and ^C: the zygote ignores it, a worker dies by it as an interpreter does after its KeyboardInterrupt
    assert got["codes"] == {"script": 0, "module": 0, "exit": 3, "raise": 1, "sleep": -9, "interrupted": -2}
    assert "KeyboardInterrupt" in run.stderr
    assert "ValueError: boom" in run.stderr and got["zygote"] == 0
    script, module = (json.loads((tmp_path / name).read_text()) for name in ("script", "module"))
    assert (script["x"], module["x"]) == ("1", "2")  # each its own environment
    assert script["argv"][1:] == ["report", str(tmp_path / "script")] and script["argv"][0].endswith("zygote_worker.py")
    assert module["argv"][1:] == ["report", str(tmp_path / "module")]
    assert script["path0"] == str(SUPPORT) and module["path0"] == str(SUPPORT)  # the script's folder; the cwd for -m
    assert script["name"] == module["name"] == "__main__"
    assert script["random"] != module["random"]  # reseeded, not the zygote's generator state
    for name in ("script", "module"):  # non-daemon threads joined and atexit handlers run before the exit
        assert (tmp_path / f"{name}.thread").read_text() == "done"
        assert (tmp_path / f"{name}.atexit").exists()


def test_python_target_recognises_only_this_interpreter_on_a_script_or_module() -> None:
    assert python_target([sys.executable, "train.py", "--x"]) == ("train.py", None, ["--x"])
    assert python_target([sys.executable, "-m", "pkg.mod", "a"]) == (None, "pkg.mod", ["a"])
    assert python_target([sys.executable, "-c", "pass"]) is None
    assert python_target(["/bin/true", "x"]) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--pp", "1", "--preload", "torch", "--", "/bin/true"], "must be this interpreter"),
    (["--pp", "1", "--preload", "torch", "--", sys.executable, "-c", "pass"], "must be this interpreter"),
    (["--pp", "1", "--preload", "torch;rm", "--", sys.executable, "x.py"], "is not a module name"),
])
def test_preload_refuses_what_it_cannot_fork_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(SchedcompError, match=message) as e:
        parse_args(argv)
    assert "\n" not in str(e.value)
