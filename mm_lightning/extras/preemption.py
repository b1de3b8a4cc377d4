"""Saving when the job is told to stop: ``last.ckpt`` after the current batch on SIGTERM, SIGUSR1 or Ctrl-C, the
same step on every rank, exit 0 (requeueable).

Lightning's own path does not cover this (2.6): on SIGTERM it saves nothing; only under SLURM's auto-requeue does
its SIGUSR1 handler save (inside the handler) and requeue; elsewhere SIGUSR1 kills the process and a first Ctrl-C
exits 1, unsaved. Its SIGTERM handler runs a collective inside the signal handler, and a signal on a rank other than
0 stops that rank alone. This callback's handlers replace Lightning's from the sanity check on, and it raises
Lightning's ``SIGTERMException`` once saved. ``OnExceptionCheckpoint`` saves where an exception stops the step,
which a resume cannot continue exactly; this one saves between batches, as ``ModelCheckpoint`` does."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader
from typing_extensions import override

from mm_lightning.extras.worker_isolation import isolate_forked_workers


class PreemptionCheckpoint(Callback):
    """Save ``last.ckpt`` and exit 0 when the job is told to stop (SIGTERM, SIGUSR1, Ctrl-C) or training ends.

    After each batch ranks agree on any signal; all save and raise ``SIGTERMException`` (exit 0, requeueable).

    Args:
        signals: Names of the signals that mean "save and stop" (a 2nd Ctrl-C stops at once, unsaved).
        save_at_end: Also write ``last.ckpt`` when training ends."""

    def __init__(
        self, signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGINT"), save_at_end: bool = True
    ) -> None:
        self.signals = tuple(signal.Signals[name] for name in signals)
        self.save_at_end = save_at_end
        self.received: signal.Signals | None = None
        self._active = False
        self._previous: dict[signal.Signals, Any] = {}
        self._group: Any = None  # gloo group of the flag exchange when the default group is not gloo

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._active:
            if signum == signal.SIGINT and self.received == signal.SIGINT:
                self._active = False
                raise KeyboardInterrupt
            self.received = signal.Signals(signum)  # only a flag: saving between two bytecodes is unsafe
            if signum == signal.SIGINT:
                # os.write: a handler that prints could interrupt a write to the same stream (reentrant call)
                os.write(
                    2,
                    b"Ctrl-C: saving last.ckpt after this batch, then stopping (Ctrl-C again to stop at once,"
                    b" without saving).\n",
                )
            return
        # Outside fit (Lightning may reinstall this handler at teardown): behave as before we were installed.
        previous = self._previous.get(signal.Signals(signum), signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _install(self) -> None:
        for signum in self.signals:
            try:
                self._previous.setdefault(signum, signal.getsignal(signum))
                signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread (e.g. a notebook's worker thread): nothing to install
                return

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.received, self._active, self._previous = None, True, {}
        self._install()  # before Lightning's: loader workers forked later inherit a handler that spares them
        isolate_forked_workers(True)  # and leave the process group: a signal to the group misses them

    @override
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install()  # over Lightning's handler, registered after `setup`

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install()  # also when there is no sanity check; Lightning's would raise mid-validation
        loader = trainer.train_dataloader
        if isinstance(loader, DataLoader) and loader.num_workers > 0:
            context = loader.multiprocessing_context or multiprocessing.get_context()
            if context.get_start_method() != "fork":
                rank_zero_warn(
                    f"The train loader's workers start by {context.get_start_method()!r}: a stop signal sent to the"
                    " whole process group (Ctrl-C in a terminal, kill -- -PGID) reaches them too and may kill them"
                    " before last.ckpt is saved; --data.loader.multiprocessing_context fork keeps them out of it."
                )

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_at_end and not trainer.fast_dev_run:
            self._save_last(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._active = False
        isolate_forked_workers(False)
        for signum, previous in self._previous.items():
            if previous is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signum, previous)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._active = False  # Lightning restores our handler at its teardown; it then delegates (see above)
        isolate_forked_workers(False)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._save_and_exit_if_signalled(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        # A long validation must not hold a signal until the SIGKILL comes; a resume reruns it from its start.
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._save_and_exit_if_signalled(trainer)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._save_and_exit_if_signalled(trainer)

    def _any_rank_signalled(self, trainer: Trainer) -> bool:
        """Whether any rank got a signal (a collective; reduced on CPU over gloo: never waits on the GPU)."""
        local = self.received is not None
        if trainer.world_size == 1:
            return local
        if not (dist.is_available() and dist.is_initialized()):
            return trainer.strategy.reduce_boolean_decision(local, all=False)
        if self._group is None and dist.get_backend() != "gloo":
            self._group = dist.new_group(backend="gloo")
        flag = torch.tensor([int(local)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def _save_and_exit_if_signalled(self, trainer: Trainer) -> None:
        if not self._any_rank_signalled(trainer):
            return
        what = self.received.name if self.received is not None else "another rank's signal"
        path = self._save_last(trainer)
        rank_zero_info(f"Received {what}: saved {path} at global step {trainer.global_step}; exiting.")
        raise SIGTERMException

    @staticmethod
    def _save_last(trainer: Trainer) -> str:
        """Writes ``last.ckpt`` in the folder of the ``ModelCheckpoint`` that keeps one (else the first's; every
        rank calls this)."""
        folders = [
            c
            for c in trainer.checkpoint_callbacks
            if isinstance(c, ModelCheckpoint) and c.dirpath and (c.save_top_k != 0 or c.save_last)  # not off
        ]
        folders.sort(key=lambda c: c.filename != ModelCheckpoint.CHECKPOINT_NAME_LAST and not c.save_last)
        if folders:
            path = folders[0].format_checkpoint_name({}, ModelCheckpoint.CHECKPOINT_NAME_LAST)
        else:
            path = os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")
        trainer.save_checkpoint(path)
        return path
