"""Tiny exact MultimodalModule runs for the gradient-caching tests (one Lightning optimizer step)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from mm_lightning.extras import NaNGuard
from mm_lightning.models import MultimodalModule
from tests.models.helpers import make_batch


class SGDModule(MultimodalModule):
    """Plain SGD, so parameters after one step differ exactly as the gradients do (Adam's first step is
    ``lr * sign(grad)``, which hides gradient errors)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Rows(Dataset):
    """The rows of one ``make_batch`` batch (captions of different lengths, two captions per image)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.batch = make_batch(size=size, length=9, seed=seed, captions_per_image=2)

    def __len__(self) -> int:
        return len(self.batch["index"])

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def fit_one_step(
    model: MultimodalModule, loader: DataLoader, accumulate: int = 1, **trainer_args: Any
) -> dict[str, Tensor]:
    """One optimizer step (with gradient clipping and the NaN guard on); returns the parameters after it."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1.0,
        callbacks=[NaNGuard()],
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer = Trainer(**(defaults | trainer_args))
    trainer.fit(model, loader)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_param_diff(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)
