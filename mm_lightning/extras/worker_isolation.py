"""Data-loader workers out of the way of a stop signal, for :class:`~mm_lightning.extras.PreemptionCheckpoint`.

A terminal's Ctrl-C, ``kill -- -PGID`` or ``timeout`` signals the whole process group: the loader workers too, which
then die before the main process has saved. While a run with preemption saves trains, each process forked from it
(the loader workers, under the ``fork`` start method, Linux's default) leaves the process group at once, ignores
Ctrl-C and SIGUSR1 and dies with its parent; stop signals are blocked while it forks, so a signal sent to the group
at that moment reaches the main process only. Workers started with ``spawn`` or ``forkserver`` are not covered.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGUSR1})
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_active = False
_installed = False
_forking: list[tuple[set[signal.Signals], int]] = []  # (the thread's signal mask before, the parent's pid)


def isolate_forked_workers(active: bool) -> None:
    """Isolate the processes forked from now on (``True``) or no longer (``False``)."""
    global _active, _installed
    _active = active
    if active and not _installed:  # fork hooks cannot be removed: installed once, switched by the flag
        os.register_at_fork(
            before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_in_child
        )
        _installed = True


def _before_fork() -> None:
    if _active:
        _forking.append((signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS), os.getpid()))


def _after_fork_in_parent() -> None:
    if _forking:
        signal.pthread_sigmask(signal.SIG_SETMASK, _forking.pop()[0])


def _in_child() -> None:
    if not _forking:
        return
    previous_mask, parent = _forking.pop()
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # SLURM's --signal=USR1 reaches every process of the step
    # A SIGTERM held back while forking was sent to the group: the main process has it too.
    if signal.SIGTERM in signal.sigpending():
        signal.sigtimedwait({signal.SIGTERM}, 0)
    signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
    if sys.platform.startswith("linux"):  # die with the parent: a kill sent to its group no longer reaches us
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)
