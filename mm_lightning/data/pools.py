"""Process pools for the offline data tools (audit, shard conversion) that are safe to start from any process."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

PRELOAD = (
    "mm_lightning.data.audit",
    "mm_lightning.data.sources.shard_audit",
    "mm_lightning.data.shard_writer",
)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool whose workers start from a clean ``forkserver`` process instead of forking the caller.

    The caller usually runs threads (torch's intra-op pool, a fast tokenizer's pool, a logger's or a server's), and a
    child forked while another thread holds a lock (the allocator's, a logging handler's) waits on it forever.
    Arguments and results are pickled either way, so only the start method changes.

    Args:
        workers: worker processes (at least 1).
    """
    context = multiprocessing.get_context("forkserver")
    # imported once in the server (before it starts), so each worker forks with them loaded instead of importing
    context.set_forkserver_preload(list(PRELOAD))
    return ProcessPoolExecutor(max_workers=max(1, workers), mp_context=context)
