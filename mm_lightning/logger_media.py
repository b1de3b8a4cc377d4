"""Text and images to every logger of the run that takes them: TensorBoard, MLflow and W&B (CSV takes numbers only).

Call on rank 0: the loggers write there only.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger


def _is_tensorboard_like(logger: Logger) -> bool:
    return hasattr(logger.experiment, "add_image")  # a SummaryWriter


def takes_images(trainer: pl.Trainer) -> bool:
    """Whether any logger of the run would receive :func:`log_image`'s picture."""
    return any(
        isinstance(logger, (MLFlowLogger, WandbLogger)) or _is_tensorboard_like(logger)
        for logger in trainer.loggers
    )


def log_text(trainer: pl.Trainer, key: str, text: str) -> None:
    """Markdown ``text`` under ``key`` at the current step: a TensorBoard text, an MLflow artifact
    ``<key>/step_<N>.md`` or a one-cell W&B table."""
    step = trainer.global_step
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_text(logger.run_id, text, f"{key}/step_{step}.md")
        elif isinstance(logger, WandbLogger):
            logger.log_text(key=key, columns=["text"], data=[[text]], step=step)
        elif hasattr(logger.experiment, "add_text"):
            logger.experiment.add_text(key, text.replace("\n", "  \n"), step)  # Markdown line breaks


def log_image(trainer: pl.Trainer, key: str, image: torch.Tensor) -> None:
    """A uint8 (3, H, W) ``image`` under ``key`` at the current step (MLflow: an image artifact with its step)."""
    step = trainer.global_step
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_image(logger.run_id, image.permute(1, 2, 0).numpy(), key=key, step=step)
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=key, images=[image.permute(1, 2, 0).numpy()], step=step)
        elif _is_tensorboard_like(logger):
            logger.experiment.add_image(key, image, step)
