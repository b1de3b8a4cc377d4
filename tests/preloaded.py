"""Start ``python -m mm_lightning ...`` or ``python benchmarks/<name>.py`` without importing torch and Lightning again.

Each Python process a test starts spends about 5 s of the machine's 2 cores importing torch, Lightning, torchmetrics
and torchvision before it runs a line of its own. A server, one per test process, imports them once; each command
is forked from it and runs as ``__main__`` with its own arguments, environment, working directory and output files,
then exits the way Python exits (``atexit`` handlers, finalization). The test gets a ``subprocess.Popen``-like
handle: pid, ``poll``, ``wait``, ``kill``, signals, ``start_new_session``.

Only for commands whose check is not about importing or starting Python: a forked process has the server's modules
imported already (importing the package changes nothing in a process, ``tests/test_import_effects.py``), and every
command of a test process shares the server's string-hash seed, so the ranks of one run iterate sets alike. A command
whose environment differs from the server's in what Python, the C runtime, torch, OpenMP or Hugging Face read at
start or import, or whose output is piped, runs as a plain subprocess, as does every command when
``MM_TESTS_PRELOAD=0`` or the server is not single-threaded (``OMP_NUM_THREADS=1`` keeps it so).
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import io
import json
import multiprocessing.process
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import IO, Any

import numpy
from lightning_utilities.core.rank_zero import rank_zero_only
from torchmetrics.utilities.prints import rank_zero_only as torchmetrics_rank_zero_only

REPO = Path(__file__).resolve().parents[1]
PRELOAD = ("torch", "torchvision", "lightning.pytorch", "mm_lightning.cli")
# read at start-up or import, so a forked process could not honour a change (the three handled here can): by Python,
# the C library, GNU OpenMP and OpenBLAS (what torch, numpy and scipy load; no Intel OpenMP, so no KMP_*), torch,
# matplotlib, Hugging Face, tqdm and Lightning
HANDLED_AT_START = {"PYTHONPATH", "PYTHONFAULTHANDLER", "PYTHONUNBUFFERED"}
READ_AT_START = (
    "PYTHON", "LD_", "GLIBC_", "MALLOC_", "LANG", "LC_", "TZ", "TMPDIR", "XDG_", "OMP_", "GOMP_", "OPENBLAS_", "MKL_",
    "TORCH", "PYTORCH_", "MPL", "HF_", "TRANSFORMERS_", "TQDM_", "POSSIBLE_USER_WARNINGS",
)  # fmt: skip
# set in the test process by torch itself once it ran (a compile, a CUDA check) and read only when used
SET_BY_TORCH = {"TORCHINDUCTOR_CACHE_DIR", "PYTORCH_NVML_BASED_CUDA_CHECK"}
# where Lightning learns a process's rank at import, until its Trainer sets it
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def read_at_start(env: dict[str, str]) -> dict[str, str]:
    ignored = HANDLED_AT_START | SET_BY_TORCH
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START) and k not in ignored}


# --- the server: ``python -m tests.preloaded FD`` -------------------------------------------------------------------

status_files: dict[int, str] = {}
ended: dict[int, int] = {}  # reaped before their status file was known


def write_status(path: str, code: int) -> None:
    Path(path + ".part").write_text(str(code))
    os.replace(path + ".part", path)


def reap(signum: int, frame: object) -> None:
    """Writes each ended child's return code, as ``Popen.returncode`` has it (minus the signal that ended it)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        if pid in status_files:
            write_status(status_files.pop(pid), code)
        else:
            ended[pid] = code


def serve(channel_fd: int) -> None:
    """Forks one command per request (JSON and the command's stdout and stderr descriptors), answering its pid once
    it has its session, folder and output, or the error that stopped it; ends when the test process goes."""
    channel = socket.socket(fileno=channel_fd)
    for name in PRELOAD:
        __import__(name)
    # a fork copies only the forking thread: a second one (a pool some import started) would be lost
    channel.send(f"ready {len(os.listdir('/proc/self/task'))}".encode())
    signal.signal(signal.SIGCHLD, reap)
    while True:
        message, outputs, _, _ = socket.recv_fds(channel, 1 << 20, 2)
        if not message:
            return
        request = json.loads(message)
        if len(outputs) != 2:
            for fd in outputs:
                os.close(fd)
            channel.send(f"received {len(outputs)} output descriptors, not 2".encode())
            continue
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # registered before it is reaped
        ready_read, ready_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            channel.close()
            os.close(ready_read)
            become(request, outputs, ready_write)
        os.close(ready_write)
        for fd in outputs:
            os.close(fd)
        with os.fdopen(ready_read, "rb") as ready:
            answer = ready.read().decode()
        if answer == "ready":
            status_files[pid] = request["status"]
            if pid in ended:
                write_status(status_files.pop(pid), ended.pop(pid))
            answer = str(pid)
        else:  # reaped here, so that no later child with the same pid finds its status
            os.waitpid(pid, 0)
            answer = answer or "it ended before it started"
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        channel.send(answer.encode())


def become(request: dict[str, Any], outputs: list[int], ready: int) -> None:
    """Turns the forked server into the command; it ends by raising, as the command ends (``SystemExit`` or its
    error, which Python prints and exits 1 with)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    server_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = request["env"]
    try:
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        for fd, target in zip((1, 2), outputs, strict=True):
            os.dup2(target, fd)
            os.close(target)
    except BaseException as error:
        os.write(ready, f"{type(error).__name__}: {error}".encode())
        os._exit(1)
    os.write(ready, b"ready")
    os.close(ready)
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # where a spawned child finds a relative script
    rank_zero_only.rank = next((int(env[k]) for k in RANK_VARIABLES if k in env), 0)
    torchmetrics_rank_zero_only.rank = int(env.get("LOCAL_RANK", 0))  # torchmetrics' own, read the same way
    numpy.random.seed()  # a fresh process draws its own unseeded numbers; Python's random reseeds at fork itself
    if env.get("PYTHONUNBUFFERED"):
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            raw = io.FileIO(stream.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, stream.encoding, stream.errors, write_through=True))
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
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.preloaded", str(theirs.fileno())], cwd=REPO, env=self.env,
                pass_fds=[theirs.fileno()],
            )  # fmt: skip
        self.channel = ours
        self.lock = threading.Lock()
        ready = self.channel.recv(64).decode().split()
        self.usable = ready == ["ready", "1"]
        self.status_dir = Path(tempfile.mkdtemp(prefix="preloaded-"))
        atexit.register(self.close)

    def close(self) -> None:
        """Ends the server (it ends when its channel closes); commands still running go on."""
        self.channel.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.status_dir, ignore_errors=True)

    def fork(
        self, command: list[str], cwd: Path, env: dict[str, str], outputs: list[int], new_session: bool
    ) -> tuple[int, str]:
        with self.lock:
            status = str(self.status_dir / f"{time.monotonic_ns()}")
            request = dict(command=command, cwd=str(cwd), env=env, status=status, new_session=new_session)
            try:
                socket.send_fds(self.channel, [json.dumps(request).encode()], outputs)
                answer = self.channel.recv(4096).decode()
            except BaseException:
                # interrupted between request and answer: the next answer read would not be its own
                self.process.kill()
                self.process.wait()
                raise
        if not answer:
            raise RuntimeError("the preloaded Python server has ended")
        if not answer.isdigit():
            raise OSError(f"{command}: {answer}")
        return int(answer), status


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

    def __init__(self, args: list[str], pid: int, status: str, server: Server) -> None:
        self.args, self.pid, self.status, self.server, self.returncode = args, pid, status, server, None

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self.status):
            self.returncode = int(Path(self.status).read_text())
        elif self.returncode is None and self.server.process.poll() is not None:
            if not os.path.exists(f"/proc/{self.pid}"):  # ended, and nobody is left to say how
                raise RuntimeError(
                    f"{self.args}: the preloaded Python server ended first; its exit status is lost"
                )
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
    object, a descriptor, ``DEVNULL`` (``STDOUT`` for ``stderr`` too), or None for the test process's own; the
    command writes to the same open file, as a ``Popen`` child does."""
    env = dict(os.environ if env is None else env)
    command = python_command(args)
    piped = subprocess.PIPE in (stdout, stderr)  # forked commands write to files only
    preloaded = server() if command is not None and not piped else None
    changed = preloaded is not None and read_at_start(env).items() ^ read_at_start(preloaded.env).items()
    if changed:  # named, so that a variable a library sets at run time does not quietly slow the suite down
        warnings.warn(
            f"run as a plain subprocess: {sorted({k for k, _ in changed})} differ from the server's",
            stacklevel=2,
        )
    if preloaded is None or changed:
        return subprocess.Popen(
            args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=start_new_session
        )
    with open(os.devnull, "w") as null:
        out = descriptor(stdout, 1, null)
        err = out if stderr == subprocess.STDOUT else descriptor(stderr, 2, null)
        pid, status = preloaded.fork(command, Path(cwd), env, [out, err], start_new_session)
    return Forked(args, pid, status, preloaded)


def descriptor(target: IO | int | None, own: int, null: IO) -> int:
    if target is None:
        return own
    if target == subprocess.DEVNULL:
        return null.fileno()
    return target if isinstance(target, int) else target.fileno()


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
    serve(int(sys.argv[1]))
