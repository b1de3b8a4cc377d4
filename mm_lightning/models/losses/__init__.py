"""Image-text losses (one module each, registered by name) and loss weighting.

``clip`` (:class:`ContrastiveLoss`) is built in; other losses register with ``@register_loss`` in their own
module here and are chosen with ``loss.name``; a user's own loss is chosen with ``loss.itc`` (class_path +
init_args; the contract: :mod:`mm_lightning.models.losses.base`).
"""

from mm_lightning.models.losses.base import (
    LOSSES,
    LossContractError,
    PairLogits,
    PairLoss,
    ScaledPairLoss,
    build_loss,
    check_loss,
    loss_terms,
    register_loss,
)
from mm_lightning.models.losses.clip import ContrastiveLoss
from mm_lightning.models.losses.hard_negatives import sample_hard_negatives
from mm_lightning.models.losses.weighting import DynamicWeightAveraging, complexity_weights, weighted_sum

__all__ = [
    "LOSSES",
    "ContrastiveLoss",
    "DynamicWeightAveraging",
    "LossContractError",
    "PairLogits",
    "PairLoss",
    "ScaledPairLoss",
    "build_loss",
    "check_loss",
    "complexity_weights",
    "loss_terms",
    "register_loss",
    "sample_hard_negatives",
    "weighted_sum",
]
