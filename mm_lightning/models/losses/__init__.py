"""Image-text losses (one module each, registered by name) and loss weighting.

``clip`` (:class:`ContrastiveLoss`) is built in; other losses register with ``@register_loss`` in their own
module here and are chosen with ``loss.name``.
"""

from mm_lightning.models.losses.base import (
    LOSSES,
    PairLogits,
    PairLoss,
    ScaledPairLoss,
    build_loss,
    register_loss,
)
from mm_lightning.models.losses.clip import ContrastiveLoss
from mm_lightning.models.losses.hard_negatives import sample_hard_negatives
from mm_lightning.models.losses.weighting import DynamicWeightAveraging, complexity_weights

__all__ = [
    "LOSSES",
    "ContrastiveLoss",
    "DynamicWeightAveraging",
    "PairLogits",
    "PairLoss",
    "ScaledPairLoss",
    "build_loss",
    "complexity_weights",
    "register_loss",
    "sample_hard_negatives",
]
