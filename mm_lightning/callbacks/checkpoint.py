"""Checkpoint callbacks for stopped runs: exact RNG resume, and saving when the job is told to stop.
Resume with ``python -m mm_lightning fit --config ... --ckpt_path last``."""

from __future__ import annotations

import os
import random
import signal
import threading
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from mm_lightning.data.loader import derive_seed, global_seed
from mm_lightning.data.torchdata_epoch_end import ResumableDataLoader


class ExactResume(Callback):
    """Make a resumed run continue exactly like an uninterrupted one: the train loader's position and the RNG
    states in checkpoints. ``MultimodalModule`` seeds each training batch's draws itself (``batch_draws``).

    Args:
        seed: Base seed of ``reseed_every_batch``; ``None`` uses the one ``seed_everything`` set (0 if none).
        reseed_every_batch: Also reseed the global Python/NumPy/torch generators at each training batch, for a
            module of your own that draws from them (dropout outside ``batch_draws``)."""

    def __init__(self, seed: int | None = None, reseed_every_batch: bool = False) -> None:
        self.seed = seed
        self.reseed_every_batch = reseed_every_batch
        self._saved_position = False  # the checkpoint being resumed holds a train-loader position

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.seed is None:
            self.seed = global_seed()

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        self._saved_position = bool(fit_loop.get("combined_loader"))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loader = trainer.train_dataloader
        if self._saved_position and isinstance(loader, ResumableDataLoader) and not loader.position_loaded:
            rank_zero_warn(
                "The checkpoint's position in the training data was not restored, so this epoch starts over with"
                " a new order. Lightning restores it only mid-epoch and only into a loader set up after the"
                " checkpoint is read (configure_optimizers reading trainer.estimated_stepping_batches sets it up"
                " earlier); the built-in data modules keep it themselves, in checkpoints written since they do."
            )
        self._saved_position = False

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.reseed_every_batch:
            # total_batch_idx is restored from the checkpoint, so the seed of a batch survives a resume.
            batch_seed = derive_seed(self.seed, (trainer.fit_loop.total_batch_idx, trainer.global_rank))
            random.seed(batch_seed)
            np.random.seed(batch_seed)
            reseed_torch(batch_seed)

    @override
    def state_dict(self) -> dict[str, Any]:
        np_state = np.random.get_state()
        state: dict[str, Any] = {
            "seed": self.seed,
            "python": random.getstate(),
            # NumPy's state holds an ndarray: a tensor here, so the checkpoint loads with weights_only=True.
            "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["seed"] != global_seed(state_dict["seed"]):
            rank_zero_warn(
                f"Resuming a run seeded {state_dict['seed']} with seed {global_seed()}: the batches from here on"
                f" draw other crops, captions and dropout than the run would have; to continue it exactly, pass"
                f" --seed_everything {state_dict['seed']}."
            )
        self.seed = state_dict["seed"]
        random.setstate(state_dict["python"])
        name, keys, *rest = state_dict["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
        torch.set_rng_state(state_dict["torch"])
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state_dict["cuda"])


def reseed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the generators in use, without its per-call cost on CPU-only runs."""
    if torch.cuda.is_initialized() or not _only_cpu_or_cuda():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def _only_cpu_or_cuda() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return not (mps is not None and mps.is_available()) and not (xpu is not None and xpu.is_available())


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

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._install()  # Lightning's handler (registered after `setup`) would raise mid-validation

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.save_at_end and not trainer.fast_dev_run:
            self._save_last(trainer)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._active = False
        for signum, previous in self._previous.items():
            if previous is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signum, previous)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._active = False  # Lightning restores our handler at its teardown; it then delegates (see above)

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
        folders = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        folders.sort(key=lambda c: c.filename != ModelCheckpoint.CHECKPOINT_NAME_LAST and not c.save_last)
        if folders:
            path = folders[0].format_checkpoint_name({}, ModelCheckpoint.CHECKPOINT_NAME_LAST)
        else:
            path = os.path.join(trainer.default_root_dir, "checkpoints", "last.ckpt")
        trainer.save_checkpoint(path)
        return path
