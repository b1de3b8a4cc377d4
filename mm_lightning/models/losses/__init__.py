"""Image-text pair losses (``model.loss`` by ``class_path``): :class:`ContrastiveLoss` (CLIP's, the default),
:class:`SigLipLoss`, or your own under the contract of :mod:`mm_lightning.models.losses.base`."""

from mm_lightning.models.losses.base import (
    LossContractError,
    PairLogits,
    PairLoss,
    ScaledPairLoss,
    loss_terms,
    weighted_sum,
)
from mm_lightning.models.losses.checks import check_loss
from mm_lightning.models.losses.clip import ContrastiveLoss
from mm_lightning.models.losses.siglip import SigLipLoss

__all__ = [
    "ContrastiveLoss",
    "LossContractError",
    "PairLogits",
    "PairLoss",
    "ScaledPairLoss",
    "SigLipLoss",
    "check_loss",
    "loss_terms",
    "weighted_sum",
]
