"""What the offline data tools (``audit``, ``shard``) share: the splits they read, and process pools that are safe
to start from any process."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor

from mm_lightning import ExplainedError


def process_pool(workers: int, preload: Iterable[str] = ()) -> ProcessPoolExecutor:
    """A pool whose workers start from a clean ``forkserver`` process instead of forking the caller.

    The caller usually runs threads (torch's intra-op pool, a fast tokenizer's pool, a logger's or a server's), and a
    child forked while another thread holds a lock (the allocator's, a logging handler's) waits on it forever.
    Arguments and results are pickled either way, so only the start method changes.

    Args:
        workers: worker processes (at least 1).
        preload: modules the workers' functions live in (the caller's ``__name__``): imported once in the server, so
            each worker forks with them loaded. The server starts once per process; a later caller's modules are
            imported by its workers instead.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return ProcessPoolExecutor(max_workers=max(1, workers), mp_context=context)


class MissingTrainingFile(ExplainedError, FileNotFoundError):
    """The training JSONL named in the config does not exist."""

    def __init__(self, command: str, path: str) -> None:
        super().__init__(
            f"{command}: train: {path} does not exist. Set --data.init_args.train_file to your JSONL."
        )


def splits_with_files(files: Mapping[str, str | None], splits: Iterable[str], command: str) -> list[str]:
    """The splits whose JSONL file exists (a missing val/test is left out with a message, train raises)."""
    chosen = []
    for split in splits:
        path = files.get(split)
        if path is None:
            continue
        if not os.path.exists(path):
            if split == "train":
                raise MissingTrainingFile(command, path)
            print(
                f"{command}: {split}: {path} does not exist: left out (--data.init_args.{split}_file sets it)"
            )
            continue
        chosen.append(split)
    return chosen
