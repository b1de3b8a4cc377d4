"""Model parts: towers, fusion, losses, the ``DualEncoder`` network and the ``MultimodalModule`` that trains it."""

from mm_lightning.models.config import (
    FusionConfig,
    GradCacheConfig,
    ObjectiveConfig,
    OptimConfig,
    TowerTraining,
)
from mm_lightning.models.dual_encoder import DualEncoder
from mm_lightning.models.fusion import CrossAttentionFusion
from mm_lightning.models.itm import ImageTextMatching
from mm_lightning.models.losses import ContrastiveLoss, DynamicWeightAveraging, SigLipLoss
from mm_lightning.models.module import MultimodalModule
from mm_lightning.models.towers import EncoderOutput, HFTextTower, TorchvisionTower

__all__ = [
    "ContrastiveLoss",
    "CrossAttentionFusion",
    "DualEncoder",
    "DynamicWeightAveraging",
    "EncoderOutput",
    "FusionConfig",
    "GradCacheConfig",
    "HFTextTower",
    "ImageTextMatching",
    "MultimodalModule",
    "ObjectiveConfig",
    "OptimConfig",
    "SigLipLoss",
    "TorchvisionTower",
    "TowerTraining",
]
