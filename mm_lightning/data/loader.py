"""Loaders whose workers survive group-wide signals: a stop signal sent to the whole process group reaches the
main process only, which saves and exits in order."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGUSR1})


class StartsWorkersOutsideTheGroup:
    """Blocks stop signals while a loader using :func:`ignore_stop_signals` starts workers, so a group-wide
    Ctrl-C kills none still in the group. Only forked workers inherit the mask: under ``spawn``/``forkserver``
    a worker still importing may not be covered."""

    num_workers: int
    worker_init_fn: Any

    def __iter__(self) -> Iterator[Any]:
        init = self.worker_init_fn
        if self.num_workers == 0 or getattr(init, "func", init) is not ignore_stop_signals:
            return super().__iter__()  # type: ignore[misc]
        # This thread's mask, which workers forked here inherit; the process still receives the signal.
        previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            return super().__iter__()  # type: ignore[misc]
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


class WorkerSafeDataLoader(StartsWorkersOutsideTheGroup, DataLoader):
    """A ``DataLoader`` (val, test, predict) whose workers a signal to the process group does not kill."""


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ignore_stop_signals(worker_id: int, rank: int | None = None) -> None:
    """``worker_init_fn``: leave the process group, ignore Ctrl-C and SIGUSR1, die with the parent, seed by
    ``rank`` as Lightning does. Else a group-wide Ctrl-C or ``timeout`` kills workers before the run saves."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # SLURM's --signal=USR1 reaches every process of the step
    # A SIGTERM held back since this worker started was sent to the group: the main process has it too.
    if signal.SIGTERM in signal.sigpending():
        signal.sigtimedwait({signal.SIGTERM}, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with_parent()
    # Lightning adds its own worker_init_fn only to loaders without one.
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank)


def _die_with_parent() -> None:
    """Linux: die with the parent (a kill sent to the parent's process group no longer reaches workers)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The parent died before prctl took effect (not os.getppid(): a forkserver's worker is its child).
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            os._exit(1)
