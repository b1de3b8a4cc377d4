"""What every tower is: an ``nn.Module`` returning an :class:`EncoderOutput`, with its widths and data config;
and the projections put on a pretrained tower (:func:`projection_for`)."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mm_lightning import ExplainedError
from mm_lightning.data.transforms import IMAGENET_MEAN, IMAGENET_STD


@dataclass
class EncoderOutput:
    """What a tower returns: (B, D) ``pooled``, (B, N, D_t) ``tokens``, (B, N) bool ``mask`` (True: real)."""

    pooled: Tensor
    tokens: Tensor
    mask: Tensor


class UnknownModelError(ExplainedError, ValueError):
    """A tower names a model its library does not have."""

    def __init__(self, tower: str, name: str, known: list[str], listing: str) -> None:
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"the {len(known)} it has: {listing}"
        super().__init__(f"{tower}: no model named {name!r}; {hint}")


def check_model_name(tower: str, name: str, known: list[str], listing: str) -> None:
    """Refuses a model name the library does not know, naming close ones (before the library's own error)."""
    if name not in known:
        raise UnknownModelError(tower, name, known, listing)


class Tower(nn.Module):
    """Base of the towers: subclasses set ``pooled_dim``, ``token_dim`` and define ``forward``."""

    pooled_dim: int
    token_dim: int

    @property
    def data_config(self) -> dict[str, Any]:
        """The preprocessing the weights expect (``mean``, ``std``, ``input_size``...; or ``tokenizer``)."""
        raise NotImplementedError(f"{type(self).__name__} does not define its data_config")

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        """Recompute activations in backward instead of storing them (saves memory, costs compute)."""
        raise NotImplementedError(f"{type(self).__name__} does not support gradient checkpointing")


def image_data_config(
    image_size: int,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
    interpolation: str = "bilinear",
) -> dict[str, Any]:
    """An image tower's ``data_config`` for square inputs (ImageNet statistics of 0-1 images by default)."""
    return {
        "mean": tuple(float(m) for m in mean),
        "std": tuple(float(s) for s in std),
        "input_size": (3, image_size, image_size),
        "interpolation": interpolation,
    }


WEIGHT_FILE_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")


def is_weights_file(weights: str | None) -> bool:
    """Whether ``weights`` names a local file (by suffix) rather than a library's weights name."""
    return weights is not None and weights.lower().endswith(WEIGHT_FILE_SUFFIXES)


def batchnorm_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The BatchNorm layers of ``module`` by name (any ``_BatchNorm``: 1d/2d/3d, SyncBatchNorm, timm's)."""
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


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
    """The tower's own projection (moved out of it), else a new Linear; ``nn.Identity`` if not ``project``.

    Moved so that freezing the tower (LiT) leaves it trainable and checkpoints hold it once.
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
