"""Pair-loss contract: ``loss(image_emb, text_emb, image_ids=None, sample_weights=None)`` -> scalar (``itc``)
or dict of named scalars; owns temperature and data parallelism; ITM needs ``loss_and_logits`` (PairLoss).
A loss of your own is checked once when the model is built (:mod:`mm_lightning.models.losses.checks`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from mm_lightning import ExplainedError


class PairLogits(NamedTuple):
    """Scores of local rows vs. candidate columns: ``i2t`` (B, N) local images vs. candidate captions, ``t2i``
    (B, N) local captions vs. candidate images, ``targets`` (B,) column of each row's own pair, ``candidate_ids``
    (N,) image id per column (None without ids), ``global_candidates``: columns gathered over ranks (N = world x
    B), so per-column data (token sequences) must be gathered alike."""

    i2t: Tensor
    t2i: Tensor
    targets: Tensor
    candidate_ids: Tensor | None
    global_candidates: bool


class PairLoss(nn.Module):
    """Base of the image-text losses: ``forward`` = ``loss_from_logits(logits(...))``."""

    def logits(self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None) -> PairLogits:
        """Scores of local rows vs. (local or global) candidates (same-image rows are no negatives)."""
        raise NotImplementedError

    def loss_from_logits(self, logits: PairLogits, sample_weights: Tensor | None = None) -> Tensor:
        """The loss of the local rows from their logits, with optional (B,) ``sample_weights``."""
        raise NotImplementedError

    def loss_and_logits(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> tuple[Tensor, PairLogits]:
        """The loss of the local rows and the logits for hard-negative mining, sharing work where possible."""
        logits = self.logits(image_emb, text_emb, image_ids)
        return self.loss_from_logits(logits, sample_weights), logits

    @property
    def temperature(self) -> Tensor | None:
        """The current temperature (logged as ``train/temperature``), or None for a loss without one."""
        return None

    def forward(
        self,
        image_emb: Tensor,
        text_emb: Tensor,
        image_ids: Tensor | None = None,
        sample_weights: Tensor | None = None,
    ) -> Tensor:
        """Loss of the local rows: (B, D) unnormalized embeddings, row i of each is a pair."""
        return self.loss_from_logits(self.logits(image_emb, text_emb, image_ids), sample_weights)


class ScaledPairLoss(PairLoss):
    """A pair loss whose logits are cosine similarities times a learnable scale ``exp(t') = 1 / temperature``.

    Args:
        temperature_init: initial temperature (logit scale = 1 / temperature).
        learnable_temperature: train the temperature.
        max_logit_scale: upper clamp of the logit scale (CLIP uses 100).
        global_negatives: when distributed, score the local rows against the other ranks' rows too."""

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
        return 1.0 / self.scale()

    def scale(self) -> Tensor:
        return self.logit_scale.clamp(max=self.max_log_scale).exp()


class LossContractError(ExplainedError, ValueError):
    """A user's loss does not do what the pair-loss contract (:mod:`mm_lightning.models.losses.base`) asks."""


def loss_problem(loss: nn.Module, what: str) -> LossContractError:
    from mm_lightning.models.towers.contract import class_path_of

    return LossContractError(
        f"loss {class_path_of(loss)}: {what} (the pair-loss contract: mm_lightning/models/losses/base.py)"
    )


def loss_terms(loss: nn.Module, value: Any, reserved: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """A loss's result as named terms: a scalar is the ``itc`` term, a dict names its own."""
    terms = value if isinstance(value, dict) else {"itc": value}
    if not terms:
        raise loss_problem(
            loss, "it returned an empty dict; a loss returns a scalar or a dict of named scalars"
        )
    for name, term in terms.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise loss_problem(loss, f"term name {name!r} is not a plain name (it becomes train/loss_<name>)")
        if name in reserved:
            raise loss_problem(loss, f"term {name!r} is the matching head's; name it differently")
        if not isinstance(term, Tensor) or term.numel() != 1 or term.dim() > 1:
            shape = tuple(term.shape) if isinstance(term, Tensor) else type(term).__name__
            raise loss_problem(
                loss,
                f"term {name!r} is {shape}, not a scalar tensor; a loss returns a scalar or a dict of scalars",
            )
    return {name: term.reshape(()) for name, term in terms.items()}


def weighted_sum(terms: dict[str, Tensor], weights: Mapping[str, Any]) -> Tensor:
    """The loss terms' sum, each times the weight of its name (1 when it has none), in the terms' order."""
    items = iter(terms.items())
    name, term = next(items)
    total = weights.get(name, 1.0) * term
    for name, term in items:
        total = total + weights.get(name, 1.0) * term
    return total
