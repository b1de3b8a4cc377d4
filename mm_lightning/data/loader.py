"""Loaders whose workers survive group-wide signals, the train loader (which also resumes at an epoch's end)
and its saved position, and the run's seed (:func:`global_seed`) and seeds derived from it, so per-batch draws
depend only on it and the batch."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import warnings
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

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


# Workaround: torchdata's ``StatefulDataLoader`` resumed from a state saved after an epoch's last batch yields an
# empty next epoch (torchdata 0.11; meta-pytorch/data#1437).
#
# Reproduction::
#
#     from torchdata.stateful_dataloader import StatefulDataLoader
#     loader = StatefulDataLoader(range(8), batch_size=2)
#     batches = iter(loader)
#     [next(batches) for _ in range(4)]  # the epoch's 4 batches, taken by count as Lightning does
#     resumed = StatefulDataLoader(range(8), batch_size=2)
#     resumed.load_state_dict(loader.state_dict())
#     list(resumed)  # the next epoch: [] instead of its 4 batches (a second epoch then has them)
#
# Why: the iterator never saw its own end (Lightning stops after ``len(loader)`` batches without asking for one more),
# so the saved state says "4 of 4 yielded, not finished"; loading it fast-forwards a fresh iterator past the end.
#
# Workaround: :class:`ResumableDataLoader` counts the batches it yielded and, when a loaded state is at the epoch's
# end, runs that iterator to its end at load, so the next ``iter`` starts the next epoch.
class ResumableDataLoader(StartsWorkersOutsideTheGroup, StatefulDataLoader):
    """``StatefulDataLoader`` that also resumes from a state saved after an epoch's last batch, and that saves and
    restores the sampler's epoch (Lightning calls ``set_epoch`` only after creating the iterator)."""

    BATCHES_KEY = "mm_lightning_batches_yielded"
    EPOCH_KEY = "mm_lightning_sampler_epoch"
    _yielded = 0  # batches this epoch's iterator yielded (incl. before a resume); 0 once it ended by itself
    _resumed_at = 0  # batches already yielded in the epoch a loaded state resumes
    position_loaded = False  # a resumed run checks that Lightning applied the saved position

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # torchdata 0.11 calls set_vital, which torch flags as deprecated; not the user's concern
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            super().__init__(*args, **kwargs)

    @override
    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()
        self._yielded, self._resumed_at = self._resumed_at, 0
        return self._counted(batches)

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._yielded += 1
            yield batch
        self._yielded = 0  # ended by itself: torchdata's own state then starts the next epoch

    def _epoch_samplers(self) -> list[Any]:
        samplers = (self.sampler, getattr(self.batch_sampler, "sampler", None))
        return [s for s in samplers if hasattr(s, "set_epoch") and isinstance(getattr(s, "epoch", None), int)]

    def _set_epoch(self, epoch: int) -> None:
        for sampler in self._epoch_samplers():
            sampler.set_epoch(epoch)

    @override
    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), self.BATCHES_KEY: self._yielded}
        for sampler in self._epoch_samplers()[:1]:
            state[self.EPOCH_KEY] = sampler.epoch
        return state

    @staticmethod
    def _torchdata_count(state: dict[str, Any]) -> int:
        """Batches yielded in the epoch by torchdata's state (0 once its iterator had ended by itself)."""
        if state.get("_iterator_finished"):
            return 0
        if "_snapshot" in state:  # with workers
            snapshot_step = int(state["_snapshot"].get("_snapshot_step", 0))
            return snapshot_step + int(state.get("_steps_since_snapshot", 0))
        return int(state.get("_num_yielded", 0))

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        yielded = state.pop(self.BATCHES_KEY, None)
        if yielded is None:  # a state saved by a plain StatefulDataLoader: torchdata's own count
            yielded = self._torchdata_count(state)
        epoch = state.pop(self.EPOCH_KEY, None)
        super().load_state_dict(state)
        self.position_loaded = True
        if epoch is not None:
            self._set_epoch(epoch)
        if yielded and yielded >= len(self):
            for _ in super().__iter__():  # the epoch's rest: nothing left, only the iterator's end is reached
                pass
            self._resumed_at = self._yielded = 0
            if epoch is not None:
                self._set_epoch(epoch + 1)
        else:  # also what state_dict reports until the next iterator starts
            self._resumed_at = self._yielded = yielded


class TrainPosition:
    """The train loader's position, saved with the data module and applied to the next train loader: unlike
    Lightning's, also at an epoch's end and for data set up early. Loading a state twice changes nothing."""

    KEY = "train_loader"

    def __init__(self) -> None:
        self.loader: StatefulDataLoader | None = None
        self.pending: dict[str, Any] | None = None

    def track(self, loader: StatefulDataLoader, trainer: Any = None) -> StatefulDataLoader:
        """Remember ``loader``, first giving it the pending position if ``trainer`` resumes a checkpoint."""
        if self.pending is not None and getattr(trainer, "ckpt_path", None) is not None:
            loader.load_state_dict(self.pending)
        self.pending = None
        self.loader = loader
        return loader

    def state_dict(self) -> dict[str, Any]:
        return {} if self.loader is None else {self.KEY: self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = state_dict.get(self.KEY)


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


def global_seed(default: int = 0) -> int:
    """The seed ``seed_everything`` set for this run (``default`` if none was set)."""
    return int(os.environ.get("PL_GLOBAL_SEED", default))


def derive_seed(base: int, values: Sequence[int] | np.ndarray | int) -> int:
    """A 32-bit seed that is a pure function of ``base`` and ``values`` (a batch index, item indices...)."""
    data = np.asarray(values, dtype=np.int64).reshape(-1).tobytes()
    return zlib.crc32(data, base & 0xFFFFFFFF)  # not hash(): stable across processes and Python versions


def derived_rng(base: int, *values: int) -> np.random.Generator:
    """A NumPy generator that is a pure function of ``base`` (low 32 bits) and ``values`` (epoch, item...)."""
    return np.random.default_rng([base & 0xFFFFFFFF, *values])
