"""EMA: an exponential moving average of the weights, with Lightning's ``WeightAveraging``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from typing_extensions import override


class EMA(WeightAveraging):
    """Keeps ``average = decay_t * average + (1 - decay_t) * weights`` after every ``every_n_steps`` optimizer
    steps (torch's ``AveragedModel``, one copy of the module, on ``device``).

    What uses the average: validation (all of it, the module's own epoch-end work included), the checkpoints'
    ``state_dict`` (so ``test``, ``evaluate``, ``export`` and ``DualEncoder.from_checkpoint`` read the average), and
    the model after ``fit``. The trained weights stay in the checkpoints as ``current_model_state``: ``fit
    --ckpt_path`` resumes both exactly.

    Args:
        decay: The decay once warmed up.
        warmup: Grow the decay with the update count ``n`` as ``1 - (1 + n) ** -(2/3)`` up to ``decay`` (timm's
            ``ModelEmaV3`` warmup): early updates follow the weights closely, so a short fine-tune is not averaged
            towards its starting point. False: ``decay`` from the first update.
        every_n_steps: Optimizer steps between updates.
        device: Where the average lives (``"cpu"`` saves accelerator memory); default: the module's device.
    """

    def __init__(
        self, decay: float = 0.999, warmup: bool = True, every_n_steps: int = 1, device: str | None = None
    ) -> None:
        if not 0.0 <= decay < 1.0 or every_n_steps < 1:
            raise ValueError(
                f"EMA: decay must be in [0, 1) and every_n_steps >= 1 (got {decay}, {every_n_steps})"
            )
        super().__init__(device=device, use_buffers=True, multi_avg_fn=self.update)
        self.decay, self.warmup, self.every_n_steps = decay, warmup, every_n_steps
        self._swapped = False  # the module holds the average (during validation)

    def decay_at(self, num_averaged: int | torch.Tensor) -> float | torch.Tensor:
        """The decay of the update that follows ``num_averaged`` earlier ones (from a tensor, a tensor on its device:
        no host sync per step)."""
        if not self.warmup:
            return self.decay
        grown = 1.0 - (1.0 + num_averaged) ** (-2 / 3)
        return grown.clamp(max=self.decay) if isinstance(grown, torch.Tensor) else min(self.decay, grown)

    @torch.no_grad()
    def update(
        self, averaged: list[torch.Tensor], current: list[torch.Tensor], num_averaged: torch.Tensor
    ) -> None:
        weight = 1.0 - self.decay_at(num_averaged)
        for average, value in zip(averaged, current, strict=True):
            if average.is_floating_point():
                # exact where the weights did not move (frozen towers)
                average.lerp_(value, weight.to(average.dtype) if isinstance(weight, torch.Tensor) else weight)
            else:
                average.copy_(value)  # integer buffers (BatchNorm's step count)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, DeepSpeedStrategy) or not isinstance(
            strategy, (SingleDeviceStrategy, DDPStrategy)
        ):
            raise ValueError(
                f"EMA keeps a whole copy of the module in each process: it works with single-device and DDP"
                f" strategies, not {type(trainer.strategy).__name__}"
            )
        with warnings.catch_warnings():
            # its warning is about sharded layers, which the strategies above never have
            warnings.filterwarnings(
                "ignore", message="You're using the WeightAveraging callback with a model"
            )
            super().setup(trainer, pl_module, stage)

    @override
    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        return step_idx is not None and step_idx % self.every_n_steps == 0

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_epoch_start(trainer, pl_module)
        self._swapped = trainer.state.fn == "fit"  # the average exists in fit only

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Callbacks' epoch-end hooks run before the module's: the average stays until validation ends."""

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # before ModelCheckpoint's save (Lightning runs checkpoint callbacks last)
        super().on_validation_epoch_end(trainer, pl_module)
        self._swapped = False

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The average replaces the weights at ``on_fit_end``: a last checkpoint saved when training ends keeps
        the trained weights to resume from."""

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)

    @override
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == "fit":  # elsewhere the checkpoint's state_dict, the average, is what runs
            super().on_load_checkpoint(trainer, pl_module, checkpoint)

    @override
    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if (
            self._swapped and "current_model_state" in checkpoint
        ):  # saved mid-validation (a signal): swap back
            checkpoint["state_dict"], checkpoint["current_model_state"] = (
                checkpoint["current_model_state"],
                checkpoint["state_dict"],
            )
