"""When one ddp_explicit rank dies or freezes mid-training, the others fail fast with a clear message."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.strategies.launch import kill_all, start_ranks

COLLECTIVE_TIMEOUT_S = 6.0


def wait_for(paths: list[Path], procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert all(proc.poll() is None for proc in procs), "a rank exited before training got under way"
        assert time.monotonic() < deadline, "ranks did not start training in time"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("victim", "sig"),
    [(1, signal.SIGKILL), (0, signal.SIGKILL), (1, signal.SIGSTOP)],
    ids=["kill-rank1", "kill-rank0", "freeze-rank1"],
)
def test_survivor_exits_nonzero_with_clear_message(tmp_path: Path, victim: int, sig: signal.Signals) -> None:
    procs = start_ranks(
        ["tests/strategies/failure_worker.py", str(tmp_path), str(COLLECTIVE_TIMEOUT_S)], tmp_path
    )
    survivor = 1 - victim
    try:
        wait_for([tmp_path / f"rank{r}.pid" for r in (0, 1)], procs, timeout=180)
        os.kill(procs[victim].pid, sig)
        killed_at = time.monotonic()
        # A dead peer closes its sockets (fails at once); a frozen one is caught by the collective timeout.
        returncode = procs[survivor].wait(timeout=COLLECTIVE_TIMEOUT_S + 60)
        elapsed = time.monotonic() - killed_at
    finally:
        kill_all(procs)
    output = (tmp_path / f"rank{survivor}.log").read_text()
    assert returncode != 0, output[-3000:]
    print(
        f"survivor rank {survivor} exited {returncode} {elapsed:.1f} s after signal {sig.name} to rank {victim}"
    )
    if sig == signal.SIGKILL:  # closed sockets are noticed at the next collective, long before the timeout
        assert elapsed < COLLECTIVE_TIMEOUT_S
    else:  # only the configured timeout can end the wait for a frozen peer
        assert COLLECTIVE_TIMEOUT_S - 1 < elapsed < COLLECTIVE_TIMEOUT_S + 60
    assert "ExplicitAllReduceDDPStrategy" in output and "died, was killed or stopped responding" in output, (
        output[-3000:]
    )
