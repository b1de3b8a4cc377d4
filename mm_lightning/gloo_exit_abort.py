"""Workaround: a gloo process aborts at interpreter exit right after its last collective (torch 2.14).

Reproduction (``repro.py``; run ``for i in 1 2 3 4 5 6; do torchrun --nproc_per_node 2 repro.py; done``)::

    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    tensor = torch.ones(1000)
    for _ in range(5):
        dist.all_reduce(tensor)
    # exit here: about 1 process in 3 prints "terminate called without an active exception" and dies with -6

Why: gloo's worker thread takes the GIL to release the tensors of a finished collective. When that collective is
the last thing a process does, the main thread may already be in ``Py_FinalizeEx``: Python then kills the waiting
thread inside a ``noexcept`` destructor and ``std::terminate`` aborts the process after its work is done.

Workaround: destroy the default process group from an exit hook, which joins those threads while the interpreter
is still whole. Lightning registers this only for NCCL, so it is done here, in every process of a distributed run:
by the CLI once it has built a trainer of more than one process (any strategy, any launcher) and by
``ExplicitAllReduceDDPStrategy`` (any module).
Importing the package installs nothing.

Bounded: a group whose collective is stuck (a peer died) would make the destroy wait for gloo's own timeout
(30 minutes by default). A watchdog (``faulthandler``'s, a C thread: Python threads cannot be started at exit on
Python >= 3.12) prints every thread's stack and exits with code 1 after ``MM_LIGHTNING_EXIT_TIMEOUT`` seconds
(default 30), so a crash never turns into a hang.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import os
import sys

TIMEOUT_ENV = "MM_LIGHTNING_EXIT_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0


def exit_timeout() -> float:
    """Seconds the exit hook may wait for the process group to close (``MM_LIGHTNING_EXIT_TIMEOUT``)."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        return float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        return DEFAULT_TIMEOUT_S


def destroy_process_group_at_exit() -> None:
    """Destroys the default process group if one is initialized; on timeout, exits the process with code 1."""
    dist = sys.modules.get("torch.distributed")  # never import torch just to find that nothing is running
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    watchdog = False
    try:
        # fd 2, not sys.stderr: under pytest or a notebook sys.stderr may have no file descriptor.
        faulthandler.dump_traceback_later(exit_timeout(), exit=True, file=2)
        watchdog = True
    except (ValueError, OSError, RuntimeError):
        pass  # no usable stderr: destroy unbounded rather than abort at exit
    try:
        # Objects in reference cycles (a trainer and its module; under FSDP2 the sharded parameters' device mesh)
        # can hold a group past this hook, to the collection at interpreter teardown: collect them first.
        gc.collect()
        dist.destroy_process_group()
    except Exception as err:  # exiting anyway: say so, do not mask the process's own exit status
        print(f"mm_lightning: destroying the process group at exit failed: {err!r}", file=sys.__stderr__)
    finally:
        if watchdog:
            faulthandler.cancel_dump_traceback_later()


_installed = False


def install() -> None:
    """Registers :func:`destroy_process_group_at_exit` once per process."""
    global _installed
    if not _installed:
        atexit.register(destroy_process_group_at_exit)
        _installed = True
