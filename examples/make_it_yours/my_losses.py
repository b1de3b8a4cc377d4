"""A user's own loss (see docs/make_it_yours.md), chosen in YAML by ``class_path`` in ``model.loss``.

The pair-loss contract (mm_lightning/models/losses/base.py): called with the (B, D) image and text embeddings of
the local rows, their image ids and optional per-pair weights; returns a scalar (the ``itc`` term) or a dict of
named terms, combined by name with ``model.objective.itc_weight`` and ``model.objective.term_weights``.
Subclassing ``PairLoss`` (``logits`` + ``loss_from_logits``) also feeds the matching head (ITM) its hard negatives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mm_lightning.models.losses import PairLogits, PairLoss


class HardestNegativeHinge(PairLoss):
    """VSE++'s loss (Faghri et al., 2018): a hinge on each pair's hardest negative caption and image, on cosine
    similarities of the local batch; plus a ``spread`` term, the mean squared similarity of the negatives.

    Args:
        margin: the hinge's margin.
    """

    def __init__(self, margin: float = 0.2) -> None:
        super().__init__()
        self.margin = margin

    def logits(self, image_emb: Tensor, text_emb: Tensor, image_ids: Tensor | None = None) -> PairLogits:
        similarity = F.normalize(image_emb.float(), dim=-1) @ F.normalize(text_emb.float(), dim=-1).T
        targets = torch.arange(similarity.shape[0], device=similarity.device)
        if image_ids is not None:  # other captions of the same image are not negatives
            same = image_ids[:, None] == image_ids[None, :]
            same[targets, targets] = False
            similarity = similarity.masked_fill(same, float("-inf"))
        return PairLogits(similarity, similarity.T, targets, image_ids, global_candidates=False)

    def loss_from_logits(self, logits: PairLogits, sample_weights: Tensor | None = None) -> dict[str, Tensor]:
        similarity, targets = logits.i2t, logits.targets
        positive = similarity[targets, targets]
        negatives = similarity.masked_fill(
            torch.eye(len(targets), dtype=torch.bool, device=similarity.device), float("-inf")
        )
        hardest_caption = negatives.max(dim=1).values  # per image
        hardest_image = negatives.max(dim=0).values  # per caption
        per_pair = (self.margin + hardest_caption - positive).clamp(min=0) + (
            self.margin + hardest_image - positive
        ).clamp(min=0)
        if sample_weights is not None:
            w = sample_weights.float()
            hinge = (per_pair * w).sum() / w.sum()
        else:
            hinge = per_pair.mean()
        finite = negatives[torch.isfinite(negatives)]
        spread = (finite**2).mean() if finite.numel() else similarity.new_zeros(())
        return {"itc": hinge, "spread": spread}
