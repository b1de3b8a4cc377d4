"""Signals the whole process group while a loader's workers start, and prints which workers lived and what
each loader then yielded: with the workers isolated as preemption saves isolate them, and without (the control).

Run in a session of its own. Each worker waits before it leaves the group, so the signal reaches it there.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
from torch.utils.data import DataLoader

from mm_lightning.data.order import GlobalOrderSampler
from mm_lightning.data.resume import ResumableDataLoader
from mm_lightning.extras import worker_isolation
from mm_lightning.extras.worker_isolation import isolate_forked_workers


class SlowToLeaveTheGroup:
    """``os`` as the isolation module sees it, with a ``setpgid`` that waits first."""

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    @staticmethod
    def setpgid(pid: int, pgid: int) -> None:
        time.sleep(0.5)
        os.setpgid(pid, pgid)


def main() -> None:
    received: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    worker_isolation.os = SlowToLeaveTheGroup()  # type: ignore[assignment]
    results: dict[str, object] = {}
    for name, loader_class, isolated in (
        ("DataLoader", DataLoader, True),
        ("ResumableDataLoader", ResumableDataLoader, True),
        ("not isolated", DataLoader, False),
    ):
        isolate_forked_workers(isolated)
        sampler = GlobalOrderSampler(8, 2, shuffle=False) if loader_class is ResumableDataLoader else None
        loader = loader_class(
            list(range(8)), batch_size=2, num_workers=2, multiprocessing_context="fork", sampler=sampler
        )
        batches = iter(loader)
        os.killpg(0, signal.SIGTERM)
        time.sleep(1.0)  # the workers have left the group, or died
        workers = [w for w in psutil.Process().children() if w.status() != psutil.STATUS_ZOMBIE]
        results[name] = {
            "workers_alive": len(workers),
            # a loader with a dead worker would wait for it before it fails
            "batches": [batch.tolist() for batch in batches] if len(workers) == 2 else None,
        }
        del batches
    print(json.dumps({"received": len(received), "results": results}))


if __name__ == "__main__":
    main()
