"""Multi-process runs end cleanly: the default process group is destroyed at exit (``mm_lightning.gloo_exit_abort``).

Without it, a gloo process whose last collective finishes just before interpreter exit aborts with "terminate
called without an active exception" (SIGABRT) in about one run of three, after its work is done. The CLI's own
2-process runs are checked the same way in tests/resilience/test_epoch_end_resume.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import preloaded
from tests.strategies.launch import REPO, kill_all, run_ranks, start_ranks

ABORT_MESSAGE = "terminate called"
STACKS_START = "\n--- process "  # the header of each process's stacks in a hang report


def exit_problems(returncode: int, output: str) -> list[str]:
    """Why a finished process did not end cleanly (empty when it did)."""
    problems = []
    if returncode != 0:
        name = f" ({signal.Signals(-returncode).name})" if returncode < 0 else ""
        problems.append(f"exit code {returncode}{name}")
    if ABORT_MESSAGE in output:
        problems.append(f"'{ABORT_MESSAGE}' in the output")
    return problems


def run_or_report_hang(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to its end; if it outlives ``timeout``, fails with every process's Python stacks.

    The command and the processes it starts (ranks, loader workers) share a new process group. On timeout the whole
    group is stopped, so the stacks are one moment's; then each process in turn gets SIGABRT, which
    ``faulthandler`` turns into a dump of all its threads' stacks, under a header naming the process.
    """
    with tempfile.TemporaryFile("w+") as log:
        process = preloaded.popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
        )  # fmt: skip
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            dump_stacks_one_by_one(process, log)
            log.seek(0)
            # faulthandler's list of loaded extension modules is long and says nothing about where a process waits
            text = "".join(line for line in log if not line.startswith("Extension modules:"))
            output, marker, stacks = text.partition(STACKS_START)
            pytest.fail(
                f"still running after {timeout:.0f} s; its output's end:\n{output[-6000:]}\n"
                f"the stacks of its processes:\n{marker}{stacks[-20000:]}"
            )
        log.seek(0)
        return subprocess.CompletedProcess(cmd, process.returncode, log.read(), "")


def dump_stacks_one_by_one(process: subprocess.Popen, log) -> None:
    group = process.pid
    os.killpg(group, signal.SIGSTOP)  # nobody reacts to another's death: each stack is where it waited
    pids = sorted(group_members(group), key=lambda pid: pid != group)  # the command first
    for pid in pids:
        log.write(f"{STACKS_START}{pid}: {command_line(pid)} ---\n")
        log.flush()
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, signal.SIGABRT)
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while process_state(pid) not in ("Z", None) and time.monotonic() < deadline:
            time.sleep(0.05)
    os.killpg(group, signal.SIGKILL)
    os.killpg(group, signal.SIGCONT)
    process.wait()


def group_members(group: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # after the command's name: state, parent, process group
            pids.append(int(stat.parent.name))
    return pids


def process_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )  # fmt: skip


def test_check_catches_an_abort_at_exit() -> None:
    """Control: the check used below flags a process that aborts after its work, and one that prints the message."""
    aborted = python(
        f"import os, sys; print('done', flush=True); sys.stderr.write('{ABORT_MESSAGE}\\n'); os.abort()"
    )
    assert exit_problems(aborted.returncode, aborted.stdout + aborted.stderr) == [
        "exit code -6 (SIGABRT)",
        f"'{ABORT_MESSAGE}' in the output",
    ]
    message_only = python(f"print('{ABORT_MESSAGE} without an active exception')")
    assert exit_problems(message_only.returncode, message_only.stdout) == [f"'{ABORT_MESSAGE}' in the output"]
    assert exit_problems(0, "done\n") == []


# A one-process gloo group; an exit hook registered *before* the package's runs *after* it (atexit runs hooks last
# in, first out) and reports whether the group is still there.
GROUP_AT_EXIT = """
import atexit, torch.distributed as dist
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
{install}
"""
INSTALL = "from mm_lightning import gloo_exit_abort; gloo_exit_abort.install()"


def test_a_hang_is_reported_with_the_stacks_of_every_process() -> None:
    """A hung command and the child it started both show where they wait; a finished one is returned as is."""
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(120)'])"
    with pytest.raises(pytest.fail.Exception) as failure:
        run_or_report_hang([sys.executable, "-c", child], timeout=3)
    report = str(failure.value)
    assert "still running after 3 s" in report
    assert "in wait" in report and "line 1 in <module>" in report  # the parent waits on the sleeping child
    assert report.count("Fatal Python error: Aborted") == 2, report
    assert report.count("--- process ") == 2, report
    done = run_or_report_hang([sys.executable, "-c", "print('done')"], timeout=60)
    assert (done.returncode, done.stdout) == (0, "done\n")


@pytest.mark.parametrize("install", [True, False], ids=["installed", "control-not-installed"])
def test_the_hook_destroys_the_group_at_exit(install: bool) -> None:
    result = python(GROUP_AT_EXIT.format(install=INSTALL if install else "import mm_lightning"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"initialized at exit: {not install}" in result.stdout, result.stdout + result.stderr


def test_the_cli_installs_it_for_a_run_of_more_than_one_process(tmp_path: Path) -> None:
    """Every process of a distributed CLI run builds its trainer, whatever the launcher: the hook goes in there."""
    code = f"""
from mm_lightning import gloo_exit_abort
from mm_lightning.cli import cli_main
base = ["--config", "configs/demo.yaml", "--trainer.default_root_dir", {str(tmp_path)!r}]
cli_main(base + ["--trainer.devices", "1"], run=False)
print("one process:", gloo_exit_abort._installed, flush=True)
cli_main(base + ["--trainer.devices", "2", "--trainer.strategy", "ddp"], run=False)
print("two processes:", gloo_exit_abort._installed, flush=True)
"""
    result = python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert (lines["one process"], lines["two processes"]) == ("False", "True"), result.stdout


def test_hook_is_a_no_op_without_a_group() -> None:
    result = python(f"{INSTALL}; import torch.distributed")
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bare_gloo_ranks_exit_cleanly_every_time(tmp_path: Path) -> None:
    """The race's own trigger (exit right after the last all-reduce), 5 times over (10 processes); without the hook
    ~1 process in 3 aborts, so all 10 exit cleanly without it about once in 60 runs (every multi-process test of
    the suite checks its exit too)."""
    for attempt in range(5):
        results = run_ranks(["tests/strategies/exit_worker.py", "clean"], log_dir=tmp_path, timeout=120)
        for rank, result in enumerate(results):
            assert "EXIT WORKER DONE" in result.output, result.output[-3000:]
            assert exit_problems(result.returncode, result.output) == [], (
                f"run {attempt}, rank {rank}:\n{result.output[-3000:]}"
            )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stuck_collective_exits_after_the_bound_not_gloo_timeout(tmp_path: Path) -> None:
    """Destroying a group whose collective never completes must not hang: the hook gives up after its bound."""
    bound_s = 3.0
    procs = start_ranks(
        ["tests/strategies/exit_worker.py", "stuck"],
        tmp_path,
        extra_env={"MM_LIGHTNING_EXIT_TIMEOUT": str(bound_s)},
    )
    try:
        deadline = time.monotonic() + 120
        log = tmp_path / "rank0.log"
        while True:
            exited = procs[0].poll() is not None
            output = log.read_text() if log.exists() else ""
            if "EXIT WORKER DONE" in output:
                break
            assert not exited, output[-3000:]
            assert time.monotonic() < deadline, "rank 0 never got to its exit"
            time.sleep(0.05)
        left = time.monotonic()
        returncode = procs[0].wait(timeout=60)
        waited = time.monotonic() - left
    finally:
        kill_all(procs)
    output = log.read_text()
    assert returncode == 1, output[-3000:]  # the watchdog's exit code, not a hang and not a signal
    assert bound_s - 0.5 < waited < bound_s + 20, waited
    assert "Timeout" in output and "gloo_exit_abort.py" in output, output[-3000:]  # says where it was stuck
