"""Commands forked from preloaded Python (``tests/preloaded.py``) run as a fresh ``python`` would run them: their own
arguments, environment, working directory, output and exit code, a signal's return code, their own session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import preloaded

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "env": os.environ.get("MM_PRELOADED_CHECK"), "torch": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
if sys.argv[1] == "fail":
    raise ValueError("failed as asked")
sys.exit(int(sys.argv[1]))
"""

# in the suite's worker processes the server is usable; in a single process (``-n 0``, torch's own thread count) or
# with MM_TESTS_PRELOAD=0 commands run as subprocesses
FORKED = "PYTEST_XDIST_WORKER" in os.environ and os.environ.get("MM_TESTS_PRELOAD", "1") != "0"


def test_a_script_gets_its_arguments_environment_folder_output_and_exit_code(tmp_path: Path) -> None:
    import json

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MM_PRELOADED_CHECK": "yes"}
    done = preloaded.run([sys.executable, str(script), "3"], cwd=tmp_path, env=env, capture_output=True)
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {
        "argv": [str(script), "3"], "cwd": str(tmp_path), "path0": str(tmp_path), "name": "__main__", "env": "yes",
        "torch": FORKED,  # already imported by the server
    }  # fmt: skip
    assert done.stderr == "to stderr\n"
    failed = preloaded.run([sys.executable, str(script), "fail"], capture_output=True)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: failed as asked"), (
        failed.stderr
    )


def test_a_killed_command_reports_the_signal_and_runs_in_its_own_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    # what torch writes into the test process's environment once it compiled: no reason for a plain subprocess
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    process = preloaded.popen([sys.executable, str(script)], start_new_session=True)
    assert isinstance(process, preloaded.Forked) == FORKED
    deadline = time.monotonic() + 30
    while os.getpgid(process.pid) != process.pid:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert process.poll() is None
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL


def test_control_a_change_read_at_import_runs_a_plain_subprocess(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    with pytest.warns(UserWarning, match="OMP_NUM_THREADS") if FORKED else contextlib.nullcontext():
        process = preloaded.popen([sys.executable, str(script), "0"], env=env, stdout=subprocess.DEVNULL)
    assert isinstance(process, subprocess.Popen)
    assert process.wait(timeout=60) == 0


def test_output_shares_the_open_file_and_a_missing_folder_fails_the_start(tmp_path: Path) -> None:
    """Like a ``Popen`` child, the command writes through the test's own open file (one offset), so what the test
    writes after it follows its output; a working folder that does not exist fails the start, not the command."""
    script = tmp_path / "script.py"
    script.write_text("print('command')\n")
    with (tmp_path / "log").open("w+") as log:
        log.write("before\n")
        log.flush()
        assert preloaded.popen([sys.executable, str(script)], stdout=log).wait(timeout=60) == 0
        log.write("after\n")
        log.flush()
        log.seek(0)
        assert log.read() == "before\ncommand\nafter\n"
    with pytest.raises(OSError):
        preloaded.popen([sys.executable, str(script)], cwd=tmp_path / "missing")
