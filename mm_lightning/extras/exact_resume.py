"""Exact resume: a resumed run continues like an uninterrupted one (the train loader's position and the RNG states
in checkpoints). Resume with ``python -m mm_lightning fit --config ... --ckpt_path last``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from mm_lightning.data.resume import ResumableDataLoader
from mm_lightning.data.seeding import derive_seed, global_seed


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
        # Lightning's copy of a loader's position: empty where a data module keeps it (and applies it itself)
        self._saved_position = any(fit_loop.get("combined_loader") or [])

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loader = trainer.train_dataloader
        if self._saved_position and isinstance(loader, ResumableDataLoader) and not loader.position_loaded:
            rank_zero_warn(
                "The checkpoint's position in the training data was not restored, so this epoch starts over with"
                " a new order. Lightning restores a loader passed to fit only mid-epoch and only if it is set up"
                " after the checkpoint is read (configure_optimizers reading trainer.estimated_stepping_batches sets"
                " it up earlier); a data module that keeps a mm_lightning.data.resume.TrainPosition, as the"
                " built-in ones do, restores it in every case."
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
