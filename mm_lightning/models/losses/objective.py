"""The training objective: a batch's loss from its embeddings, its terms weighted by name and its pairs by
``model.sample_weighting``. The weights beyond ``model.objective``'s fixed ones are rules a config names by
``class_path`` (``model.term_weighting``, ``model.sample_weighting``): the base classes here are the defaults."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import Tensor, nn

from mm_lightning.models.config import ObjectiveConfig
from mm_lightning.models.losses.base import weighted_sum
from mm_lightning.recorded import Recorded


class TermWeighting(Recorded, nn.Module):
    """The loss terms' weights at each training step (``model.term_weighting``): this one keeps the fixed weights
    of ``model.objective``. A subclass may adapt them and keep its state in buffers (saved with the model)."""

    def forward(self, terms: dict[str, Tensor], fixed: dict[str, Any]) -> dict[str, Any]:
        """This step's weight of each term, from its loss terms and the fixed weights."""
        return fixed


class SampleWeighting(Recorded):
    """Per-pair loss weights of a batch (``model.sample_weighting``): this one gives none (equal weights)."""

    reads_pixels = False  # whether the weights read the images' pixels (which cached features replace)

    def __call__(self, batch: dict[str, Tensor]) -> Tensor | None:
        """(B,) weights of the batch's pairs, or None: equal weights."""
        return None


class BatchLoss(NamedTuple):
    """A training batch's loss: ``total`` (what backward takes), its ``terms`` by name, the ``weights`` they were
    summed with, and the other ``metrics`` (``itm_accuracy``)."""

    total: Tensor
    terms: dict[str, Tensor]
    weights: dict[str, Any]
    metrics: dict[str, Tensor]


class Objective(nn.Module):
    """A batch's weighted loss: the network's terms (the pair loss's, ITM's), each times its weight.

    Args:
        config: the fixed weights (``model.objective``).
        term_weighting: each step's weights of the terms (none: the fixed ones).
        sample_weighting: per-pair weights (none: equal)."""

    def __init__(
        self,
        config: ObjectiveConfig,
        term_weighting: TermWeighting | None = None,
        sample_weighting: SampleWeighting | None = None,
    ) -> None:
        super().__init__()
        self.fixed_weights = {**config.term_weights, "itc": config.itc_weight, "itm": config.itm_weight}
        self.term_weighting = term_weighting or TermWeighting()
        self.sample_weighting = sample_weighting or SampleWeighting()

    def forward(self, network: Any, batch: dict[str, Tensor], embedded: tuple[Any, ...]) -> BatchLoss:
        """The loss of ``batch`` from ``embedded`` = (image_out, image_emb, text_out, text_emb)."""
        terms, metrics = network.losses(batch["image_id"], self.sample_weighting(batch), *embedded)
        weights = self.term_weighting(terms, self.fixed_weights)
        return BatchLoss(weighted_sum(terms, weights), terms, weights, metrics)
