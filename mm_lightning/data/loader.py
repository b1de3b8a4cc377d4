"""The built-in loaders: a training loader whose state saved at an epoch's end resumes at the next epoch, and
workers that a signal to the whole process group does not kill."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from typing_extensions import override

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGUSR1})


class StartsWorkersOutsideTheGroup:
    """For a loader whose ``worker_init_fn`` is :func:`ignore_stop_signals`: the stop signals are held back while it
    starts workers, until each worker has left the run's process group.

    Without this, a signal sent to the whole group just as workers start (a Ctrl-C at an epoch's end, when the
    validation workers do) kills the workers that have not left the group yet, and the run fails instead of saving.
    Forked workers inherit the blocked signals. ``spawn`` starts a worker with none blocked, and a forkserver
    passes on the mask it was started with, so with these a worker still importing its modules may not be covered.
    """

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
    """A ``DataLoader`` (validation, test, predict) whose workers a signal to the process group does not kill."""


class ResumableDataLoader(StartsWorkersOutsideTheGroup, StatefulDataLoader):
    """``StatefulDataLoader`` that also resumes exactly from a state saved after an epoch's last batch.

    Lightning ends an epoch after ``len(loader)`` batches without asking the iterator for one more, so torchdata's
    state saved there still reads "iterator not finished, every batch yielded"; loaded, it makes the next epoch
    yield nothing (meta-pytorch/data#1437) and a resume from an end-of-epoch ``last.ckpt`` silently skips an epoch.
    This loader counts the batches its iterator yields and stores the count with the state; loading a state whose
    epoch was complete runs the (empty) rest of that epoch at once, so the next ``iter`` starts the next epoch
    with the sampler's state as an uninterrupted run has it.

    It also stores the epoch of a sampler that has one (``DistributedSampler`` and its subclasses, whose order is
    a function of the epoch) and sets it on load: on a resume Lightning creates the iterator before it calls
    ``set_epoch``, so the saved position would otherwise be replayed in epoch 0's order.

    Takes exactly ``StatefulDataLoader``'s arguments (Lightning rebuilds the loader from them to add a
    distributed sampler).
    """

    BATCHES_KEY = "mm_lightning_batches_yielded"
    EPOCH_KEY = "mm_lightning_sampler_epoch"
    # batches the current epoch's iterator has yielded (those before a resume included), 0 once it ended by itself
    _yielded = 0
    # batches already yielded in the epoch a loaded state resumes
    _resumed_at = 0
    # whether a saved position was loaded (a resumed run checks that Lightning applied the checkpoint's)
    position_loaded = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with warnings.catch_warnings():
            # torchdata 0.11 calls a torch API that torch now flags as deprecated (set_vital); not the user's concern
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
    """The train loader's position, saved with the data module's checkpoint state and applied to the next train
    loader the data module builds.

    Lightning restores a loader's position itself only for a run stopped mid-epoch, and only into a loader set up
    after the checkpoint was read. Applied here, a run resumed at an epoch's end starts the next epoch in the
    order an uninterrupted run has, and a module that sets up the data early (``configure_optimizers`` reading
    ``trainer.estimated_stepping_batches``) resumes exactly too. Loading the same state twice changes nothing.
    """

    KEY = "train_loader"

    def __init__(self) -> None:
        self.loader: ResumableDataLoader | None = None
        self.pending: dict[str, Any] | None = None

    def track(self, loader: ResumableDataLoader, trainer: Any = None) -> ResumableDataLoader:
        """Remember ``loader`` as the one whose position is saved, after giving it the resumed run's position.

        Args:
            loader: The train loader just built.
            trainer: The trainer it is built for: a position is given only to a fit resumed from a checkpoint
                (not one read by an earlier ``validate``/``test`` in the same process).
        """
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
    """``worker_init_fn`` of the built-in loaders: a worker leaves the run's process group, ignores Ctrl-C and
    SIGUSR1, dies with the main process, and is seeded as Lightning seeds workers (``seed_everything(workers=True)``,
    what LightningCLI does) when it adds its own.

    A signal sent to the whole process group (a terminal's Ctrl-C, ``kill -- -PGID``, ``timeout``) would otherwise
    kill the workers first, and the main process would fail with "DataLoader worker ... killed by signal" before it
    could save. In a group of its own a worker gets only what is sent to it: its main process still stops it
    (queues, then SIGTERM), and it dies with the main process. SIGUSR1 (SLURM's warning signal) is ignored too.

    Args:
        worker_id: The worker's number.
        rank: The process's global rank, for the workers' seeds (Lightning passes its own the same way).
    """
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SLURM's --signal=USR1 reaches every process of the job step
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # Held back since the loader started this worker (see StartsWorkersOutsideTheGroup): a SIGTERM sent to the
    # group before the worker left it was for the main process, which gets it too.
    if signal.SIGTERM in signal.sigpending():
        signal.sigtimedwait({signal.SIGTERM}, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    _die_with_parent()
    # Lightning adds its own worker_init_fn only to loaders without one.
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (a SIGKILL to the main process no longer reaches
    workers in their own group; torch's watchdog would only notice between two batches)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The main process, which died before prctl took effect. (Not os.getppid(): a forkserver's worker is the
        # server's child.)
        parent = multiprocessing.parent_process()
        if parent is not None and not parent.is_alive():
            os._exit(1)
