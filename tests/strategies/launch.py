"""Start N local processes the way torchrun would (env vars only), so Lightning uses them as-is.

Lightning's TorchElasticEnvironment picks up RANK/LOCAL_RANK/WORLD_SIZE/..., creates no processes itself and
joins one gloo process group; several ``Trainer.fit`` calls inside one worker then share that group, which
keeps multi-case parity tests to one process start-up.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests import preloaded

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


@dataclass
class RankResult:
    returncode: int
    output: str


def start_ranks(
    args: list[str], log_dir: Path, world_size: int = 2, extra_env: dict[str, str] | None = None
) -> list[preloaded.Process]:
    """Starts ``python *args`` as ``world_size`` ranks, forked from preloaded Python where they can be
    (``tests/preloaded.py``); each writes ``log_dir/rank<r>.log``."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        # Files, not pipes: an unread full pipe would block a rank mid-collective.
        with (log_dir / f"rank{rank}.log").open("w") as sink:
            procs.append(
                preloaded.popen(
                    [sys.executable, *args], env=rank_env(rank, world_size, port, **(extra_env or {})), cwd=REPO, stdout=sink,
                    stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
    return procs


def kill_all(procs: list[preloaded.Process]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def run_ranks(
    args: list[str], log_dir: Path, world_size: int = 2, timeout: float = 300.0
) -> list[RankResult]:
    """Runs ``python *args`` as ``world_size`` ranks; kills them all if any is still running after ``timeout``."""
    procs = start_ranks(args, log_dir, world_size)
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_all(procs)
    return [
        RankResult(proc.returncode, (log_dir / f"rank{rank}.log").read_text())
        for rank, proc in enumerate(procs)
    ]
