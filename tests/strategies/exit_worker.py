"""One rank of a bare gloo run that ends right after its last collective (the exit race's trigger).

Usage: ``python tests/strategies/exit_worker.py MODE`` with torchrun-style environment variables
(``tests/strategies/launch.py``). Modes:

- ``clean``: a few all-reduces, then exit, with the package's exit hook installed (as a run's processes have it).
- ``stuck``: rank 0 leaves an all-reduce that rank 1 never joins, then exits; rank 1 sleeps. The exit hook must
  give up after ``MM_LIGHTNING_EXIT_TIMEOUT`` seconds rather than wait for gloo's own timeout.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from mm_lightning import gloo_exit_abort


def main(mode: str) -> None:
    dist.init_process_group("gloo")
    gloo_exit_abort.install()
    rank = dist.get_rank()
    tensor = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(tensor)
    if mode == "stuck":
        if rank == 0:
            dist.all_reduce(tensor, async_op=True)  # rank 1 never joins it
        else:
            time.sleep(120)
    print(f"EXIT WORKER DONE rank {rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
