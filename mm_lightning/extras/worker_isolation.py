"""Data-loader workers out of the way of a stop signal, for :class:`~mm_lightning.extras.PreemptionCheckpoint`.

A terminal's Ctrl-C, ``kill -- -PGID`` or ``timeout`` signals the whole process group: the loader workers too, which
then die before the main process has saved. While a run with ``PreemptionCheckpoint`` trains, every process Python
forks (``os.fork``: the loader workers under the ``fork`` start method, Linux's default before Python 3.14) leaves
the process group at once, ignores Ctrl-C and SIGUSR1 and dies with its parent; stop signals are blocked while it
forks, so a signal sent to the group at that moment reaches the main process only. Workers started by ``spawn`` or
``forkserver`` are not covered (``PreemptionCheckpoint`` says so when a run's train loader uses one).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGUSR1})
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_active = False
_installed = False
_libc: Any = None  # loaded before any fork: no dlopen in a forked child
_forking = threading.local()  # per forking thread: (its signal mask before, the parent's pid)


def isolate_forked_workers(active: bool) -> None:
    """Isolate the processes forked from now on (``True``) or no longer (``False``)."""
    global _active, _installed, _libc
    _active = active
    if active and not _installed:  # fork hooks cannot be removed: installed once, switched by the flag
        if sys.platform.startswith("linux"):
            _libc = ctypes.CDLL(None, use_errno=True)
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_in_child
        )
        _installed = True


def _before_fork() -> None:
    _forking.saved = None
    if _active:
        _forking.saved = (signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS), os.getpid())


def _after_fork_in_parent() -> None:
    saved, _forking.saved = getattr(_forking, "saved", None), None
    if saved is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, saved[0])


def _in_child() -> None:
    saved, _forking.saved = getattr(_forking, "saved", None), None
    if saved is None:
        return
    previous_mask, parent = saved
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(
            signal.SIGUSR1, signal.SIG_IGN
        )  # SLURM's --signal=USR1 reaches every process of the step
        # A SIGTERM held back while forking was sent to the group: the main process has it too.
        if signal.SIGTERM in signal.sigpending():
            signal.sigtimedwait({signal.SIGTERM}, 0)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    if _libc is not None:  # die with the parent: a kill sent to its group no longer reaches this process
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
