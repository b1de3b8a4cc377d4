"""Image-text pair losses and loss weighting.

A loss is chosen by ``class_path`` (``model.loss``): :class:`ContrastiveLoss` (CLIP's, the default),
:class:`SigLipLoss`, or your own class under the contract of :mod:`mm_lightning.models.losses.base`.
"""

from mm_lightning.models.losses.base import (
    LossContractError,
    PairLogits,
    PairLoss,
    ScaledPairLoss,
    check_loss,
    loss_terms,
)
from mm_lightning.models.losses.clip import ContrastiveLoss
from mm_lightning.models.losses.hard_negatives import sample_hard_negatives
from mm_lightning.models.losses.siglip import SigLipLoss
from mm_lightning.models.losses.weighting import DynamicWeightAveraging, complexity_weights, weighted_sum

__all__ = [
    "ContrastiveLoss",
    "DynamicWeightAveraging",
    "LossContractError",
    "PairLogits",
    "PairLoss",
    "ScaledPairLoss",
    "SigLipLoss",
    "check_loss",
    "complexity_weights",
    "loss_terms",
    "sample_hard_negatives",
    "weighted_sum",
]
