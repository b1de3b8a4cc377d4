"""Start ``python -m mm_lightning ...`` or ``python benchmarks/<name>.py`` without importing torch and Lightning again.

Each Python process a test starts spends about 5 s of the machine's 2 cores importing torch, Lightning, torchmetrics
and torchvision before it runs a line of its own. A server, one per test process, imports them once; each command
is forked from it and runs as ``__main__`` with its own arguments, environment, working directory and output files,
then exits the way Python exits (``atexit`` handlers, finalization). The test gets a ``subprocess.Popen``-like
handle: pid, ``poll``, ``wait``, ``kill``, signals, ``start_new_session``.

Only for commands whose check is not about importing or starting Python: a forked process has the server's modules
imported already (importing the package changes nothing in a process, ``tests/test_import_effects.py``). A command
whose environment differs from the server's in what Python, torch, OpenMP, Hugging Face or Lightning read at start
or import runs as a plain subprocess, as does every command when ``MM_TESTS_PRELOAD=0``.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "torchvision", "lightning.pytorch", "mm_lightning.cli")
# read at start-up or import, so a forked process could not honour a change; the three handled here can
HANDLED_AT_START = {"PYTHONPATH", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED"}
READ_AT_START = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "HF_", "TRANSFORMERS_", "PL_", "LIGHTNING_")


def read_at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k not in HANDLED_AT_START}


# --- the server: ``python -m tests.preloaded`` ----------------------------------------------------------------------

status_files: dict[int, str] = {}


def reap(signum: int, frame: object) -> None:
    """Writes each ended child's return code, as ``Popen.returncode`` has it (minus the signal that ended it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = status_files.pop(pid, None)
        if path is not None:
            Path(path + ".part").write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(path + ".part", path)


def serve() -> None:
    """Reads one JSON request a line, forks it, answers its pid; ends when the test process closes the pipe."""
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (
        0,
        1,
    ):  # sys.stdin and sys.stdout stay Python's own objects; a command's output is dup'ed onto them
        os.dup2(null, fd)
    os.close(null)
    for name in PRELOAD:
        __import__(name)
    # a fork copies only the forking thread: a second one (a pool some import started) would be lost
    threads = len(os.listdir("/proc/self/task"))
    replies.write(f"ready {threads}\n")
    replies.flush()
    signal.signal(signal.SIGCHLD, reap)
    for line in requests:
        request = json.loads(line)
        # opened here, while the test process waits for the pid: its file objects are open until then
        outputs = [
            os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND) for name in ("stdout", "stderr")
        ]
        signal.pthread_sigmask(
            signal.SIG_BLOCK, {signal.SIGCHLD}
        )  # its status file is known before it is reaped
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            become(request, outputs)
        for fd in outputs:
            os.close(fd)
        status_files[pid] = request["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        replies.write(f"{pid}\n")
        replies.flush()


def become(request: dict[str, Any], outputs: list[int]) -> None:
    """Turns the forked server into the command; it ends by raising, as the command ends (``SystemExit`` or its
    error, which Python prints and exits 1 with)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if request["new_session"]:
        os.setsid()
    server_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for fd, target in zip((1, 2), outputs, strict=True):
        os.dup2(target, fd)
        os.close(target)
    if env.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
    faulthandler.disable()
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    user_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    importlib.invalidate_caches()  # files written since the server started
    command = request["command"]
    if command[0] == "-m":
        sys.argv = ["-m", *command[2:]]
        sys.path[:] = [os.getcwd(), *user_path, *server_path]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        sys.path[:] = [str(Path(command[0]).resolve().parent), *user_path, *server_path]
        runpy.run_path(command[0], run_name="__main__")
    sys.exit(0)


# --- the test side --------------------------------------------------------------------------------------------------


# the test process's environment before any test changed it, which the server imports with
SERVER_ENV = dict(os.environ)


class Server:
    def __init__(self) -> None:
        self.env = SERVER_ENV
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.preloaded"], cwd=REPO, env=self.env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lock = threading.Lock()
        ready = self.process.stdout.readline().split()
        self.usable = ready[:1] == ["ready"] and ready[1:] == ["1"]
        self.status_dir = Path(tempfile.mkdtemp(prefix="preloaded-"))
        atexit.register(shutil.rmtree, self.status_dir, True)

    def fork(
        self, command: list[str], cwd: Path, env: dict[str, str], stdout: str, stderr: str, new_session: bool
    ) -> tuple[int, str]:
        with self.lock:
            status = str(self.status_dir / f"{time.monotonic_ns()}")
            request = dict(command=command, cwd=str(cwd), env=env, stdout=stdout, stderr=stderr, status=status,
                           new_session=new_session)  # fmt: skip
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            return int(self.process.stdout.readline()), status


_server: Server | None = None


def server() -> Server | None:
    global _server
    if os.environ.get("MM_TESTS_PRELOAD", "1") == "0":
        return None
    if _server is None or _server.process.poll() is not None:
        _server = Server()
    return _server if _server.usable else None


class Forked:
    """A forked command, handled as ``subprocess.Popen`` handles its child."""

    def __init__(self, args: list[str], pid: int, status: str) -> None:
        self.args, self.pid, self.status, self.returncode = args, pid, status, None

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self.status):
            self.returncode = int(Path(self.status).read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


Process = Forked | subprocess.Popen


def python_command(args: list[str]) -> list[str] | None:
    """``args`` past ``sys.executable`` if they are ``-m module ...`` or ``script.py ...``, else None."""
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and len(args) > 2:
        return args[1:]
    return args[1:] if not args[1].startswith("-") and args[1].endswith(".py") else None


def output_path(target: IO | int | None, default: str) -> str:
    """Where a command's output goes: a file object's or descriptor's own file (through ``/proc``), ``DEVNULL``'s,
    or ``default``."""
    if target is None:
        return default
    if target == subprocess.DEVNULL:
        return os.devnull
    fileno = target if isinstance(target, int) else target.fileno()
    return f"/proc/{os.getpid()}/fd/{fileno}"


def popen(
    args: list[str],
    *,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
    stdout: IO | int | None = None,
    stderr: IO | int | None = None,
    start_new_session: bool = False,
) -> Process:
    """``subprocess.Popen(args, ...)``, forked from the server where it can be. ``stdout`` and ``stderr``: a file
    object or descriptor (``subprocess.STDOUT`` for ``stderr`` too), or None for the test process's own."""
    env = dict(os.environ if env is None else env)
    command, preloaded = python_command(args), server()
    piped = subprocess.PIPE in (stdout, stderr)  # a forked command writes to files only
    if command is None or preloaded is None or piped or read_at_start(env) != read_at_start(preloaded.env):
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=start_new_session
        )
    out = output_path(stdout, f"/proc/{os.getpid()}/fd/1")
    err = out if stderr == subprocess.STDOUT else output_path(stderr, f"/proc/{os.getpid()}/fd/2")
    pid, status = preloaded.fork(command, Path(cwd), env, out, err, start_new_session)
    return Forked(args, pid, status)


def run(
    args: list[str],
    *,
    cwd: Path | str = REPO,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    capture_output: bool = False,
    start_new_session: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ..., text=True)``, forked from the server where it can be; on timeout the command
    is killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        streams = dict(stdout=out, stderr=err) if capture_output else {}
        process = popen(args, cwd=cwd, env=env, start_new_session=start_new_session, **streams)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, process.returncode, out.read(), err.read())


if __name__ == "__main__":
    serve()
