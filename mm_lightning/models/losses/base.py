"""What every image-text pair loss provides, and the registry that turns ``loss.name`` into a loss.

A pair loss is called as ``loss(image_emb, text_emb, image_ids, sample_weights) -> scalar`` and exposes
``logits(...)`` -> :class:`PairLogits`, which the ITM head mines hard negatives from. New losses register
with ``@register_loss("name")`` in their own module under ``mm_lightning.models.losses``; that module is
imported on first use of its name.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor, nn


class PairLogits(NamedTuple):
    """Scores of the local rows against the candidate columns.

    Attributes:
        i2t: (B, N) local images vs. candidate captions.
        t2i: (B, N) local captions vs. candidate images.
        targets: (B,) column of each row's own pair.
        candidate_ids: (N,) image id of each candidate column (None when the loss got no ids).
        global_candidates: True when the columns are the batch gathered over all ranks (N = world x B);
            consumers that need per-column data (token sequences) must gather it the same way.
    """

    i2t: Tensor
    t2i: Tensor
    targets: Tensor
    candidate_ids: Tensor | None
    global_candidates: bool


class PairLoss(nn.Module):
    """Base of the image-text losses: ``forward`` = ``loss_from_logits(logits(...))``."""

    def logits(self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None) -> PairLogits:
        """Scores of local rows vs. (local or global) candidates.

        Args:
            image_emb: (B, D) local image embeddings (need not be normalized).
            text_emb: (B, D) local text embeddings, row i paired with image row i.
            image_ids: (B,) image ids; pairs sharing an id are not negatives of each other.
        """
        raise NotImplementedError

    def loss_from_logits(self, logits: PairLogits, sample_weights: Tensor | None = None) -> Tensor:
        """The loss of the local rows from their logits.

        Args:
            logits: what :meth:`logits` returned.
            sample_weights: (B,) optional per-pair weights.
        """
        raise NotImplementedError

    def loss_and_logits(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> tuple[Tensor, PairLogits]:
        """The loss of the local rows and the logits for hard-negative mining, sharing work where possible.

        Losses whose global form never builds the global logits (SigLIP) override it.

        Args:
            image_emb: (B, D) local image embeddings (need not be normalized).
            text_emb: (B, D) local text embeddings, row i paired with image row i.
            image_ids: (B,) image ids; pairs sharing an id are not negatives of each other.
            sample_weights: (B,) optional per-pair weights.
        """
        logits = self.logits(image_emb, text_emb, image_ids)
        return self.loss_from_logits(logits, sample_weights), logits

    @property
    def temperature(self) -> Tensor:
        """The current temperature (logged as ``train/temperature``)."""
        raise NotImplementedError

    def forward(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> Tensor:
        """Loss of the local rows.

        Args:
            image_emb: (B, D) local image embeddings (need not be normalized).
            text_emb: (B, D) local text embeddings, row i paired with image row i.
            image_ids: (B,) image ids; pairs sharing an id are not negatives of each other.
            sample_weights: (B,) optional per-pair weights (weighted mean over the local rows).
        """
        return self.loss_from_logits(self.logits(image_emb, text_emb, image_ids), sample_weights)


class ScaledPairLoss(PairLoss):
    """A pair loss whose logits are cosine similarities times a learnable scale ``exp(t') = 1 / temperature``.

    Args:
        temperature_init: initial temperature (logit scale = 1 / temperature).
        learnable_temperature: train the temperature.
        max_logit_scale: upper clamp of the logit scale (CLIP uses 100).
        global_negatives: when distributed, score the local rows against the other ranks' rows too.
    """

    def __init__(
        self,
        temperature_init: float,
        learnable_temperature: bool,
        max_logit_scale: float,
        global_negatives: bool,
    ) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(
            torch.tensor(math.log(1.0 / temperature_init)), requires_grad=learnable_temperature
        )
        self.max_log_scale = math.log(max_logit_scale)
        self.global_negatives = global_negatives

    @property
    def temperature(self) -> Tensor:
        """Current temperature (1 / clamped logit scale)."""
        return 1.0 / self.scale()

    def scale(self) -> Tensor:
        """Clamped logit scale ``exp(t')``."""
        return self.logit_scale.clamp(max=self.max_log_scale).exp()


LossClass = TypeVar("LossClass", bound=type[PairLoss])
LOSSES: dict[str, type[PairLoss]] = {}


def register_loss(name: str) -> Callable[[LossClass], LossClass]:
    """Class decorator: makes ``loss.name: <name>`` build this loss.

    Args:
        name: the loss's name in configs.
    """

    def decorate(cls: LossClass) -> LossClass:
        if name in LOSSES and LOSSES[name] is not cls:
            raise ValueError(f"loss {name!r} is already registered by {LOSSES[name]}")
        LOSSES[name] = cls
        return cls

    return decorate


def build_loss(name: str, **kwargs: Any) -> PairLoss:
    """Builds the registered loss ``name`` with its constructor arguments.

    Args:
        name: ``"clip"``, or another registered loss (``mm_lightning.models.losses.<name>`` is imported first).
        kwargs: the loss's constructor arguments.
    """
    if name not in LOSSES:
        module = f"mm_lightning.models.losses.{name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered losses: {', '.join(sorted(LOSSES))}")
    return LOSSES[name](**kwargs)
