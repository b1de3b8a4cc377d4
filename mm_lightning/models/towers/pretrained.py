"""What towers over pretrained libraries share, and how a module takes over a pretrained dual encoder.

Towers cut out of a pretrained dual encoder (``CLIPImageTower``/``CLIPTextTower``,
``OpenCLIPImageTower``/``OpenCLIPTextTower``) carry the source's ``projection`` into its shared space and its learned ``logit_scale`` (and ``logit_bias`` for sigmoid losses). A module that finds
them uses them instead of fresh projections and its initial temperature::

    self.image_proj = projection_for(self.image_encoder, self.image_encoder.pooled_dim, embed_dim)
    self.text_proj = projection_for(self.text_encoder, self.text_encoder.pooled_dim, embed_dim)
    take_over_logit_scale(self.contrastive, self.image_encoder, self.text_encoder)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mm_lightning.models.towers.base import Tower


class ConfiguredTower(Tower):
    """A tower whose data config is fixed at construction (read from the weights' own files)."""

    _data_config: dict[str, Any]

    @property
    def data_config(self) -> dict[str, Any]:
        """The preprocessing the weights expect (see :class:`Tower`)."""
        return dict(self._data_config)


def projection_for(
    tower: nn.Module, pooled_dim: int, embed_dim: int, project: bool = True, kind: str = "image"
) -> nn.Module:
    """Takes the tower's source projection when it has one (output width must be ``embed_dim``), else a new Linear;
    with ``project`` false, no projection at all (``nn.Identity``: the pooled output is the shared space).

    The projection moves out of the tower into the module, so freezing the tower (LiT) leaves it trainable and
    checkpoints hold it once.

    Args:
        tower: an image or text tower.
        pooled_dim: width of the tower's pooled vector.
        embed_dim: the module's shared embedding width.
        project: the tower config's ``project``.
        kind: ``image`` or ``text``, for the error messages.
    """
    projection = getattr(tower, "projection", None)
    if not project:
        if projection is not None:
            raise ValueError(
                f"model.{kind}.project is false but {type(tower).__name__} brings its pretrained projection to "
                f"{tower.embed_dim} dimensions, which would be dropped: leave model.{kind}.project true"
            )
        if pooled_dim != embed_dim:
            raise ValueError(
                f"model.{kind}.project false makes the {kind} tower's pooled output ({pooled_dim} dimensions) the "
                f"shared space: set model.embed_dim to {pooled_dim} (got {embed_dim})"
            )
        return nn.Identity()
    if projection is None:
        return nn.Linear(pooled_dim, embed_dim)
    if tower.embed_dim != embed_dim:
        raise ValueError(
            f"{type(tower).__name__} brings its pretrained projection to {tower.embed_dim} dimensions; set "
            f"model embed_dim to {tower.embed_dim} (got {embed_dim})"
        )
    del tower.projection
    return projection


@torch.no_grad()
def take_over_logit_scale(loss: nn.Module, *towers: nn.Module) -> None:
    """Copies a pretrained source's learned logit scale (and bias) into the loss, when a tower carries one."""
    source = next((t for t in towers if getattr(t, "logit_scale", None) is not None), None)
    if source is None:
        return
    scale = getattr(loss, "logit_scale", None)
    if isinstance(scale, torch.Tensor):
        scale.fill_(min(source.logit_scale, getattr(loss, "max_log_scale", math.inf)))
    bias = getattr(loss, "logit_bias", None)
    if isinstance(bias, torch.Tensor) and getattr(source, "logit_bias", None) is not None:
        bias.fill_(source.logit_bias)
