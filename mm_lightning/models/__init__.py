"""Model parts: towers, fusion, losses, the ``DualEncoder`` network and the ``MultimodalModule`` that trains it."""

from mm_lightning.models.config import FusionConfig, ObjectiveConfig, OptimConfig, TowerTraining
from mm_lightning.models.dual_encoder import DualEncoder
from mm_lightning.models.itm import CrossAttentionFusion, ImageTextMatching
from mm_lightning.models.losses import ContrastiveLoss, SigLipLoss
from mm_lightning.models.losses.objective import SampleWeighting, TermWeighting
from mm_lightning.models.module import MultimodalModule
from mm_lightning.models.rules import ParamGroupRule, TowerAdapters, WholeBatch
from mm_lightning.models.towers import EncoderOutput, HFTextTower, TorchvisionTower

__all__ = [
    "ContrastiveLoss",
    "CrossAttentionFusion",
    "DualEncoder",
    "EncoderOutput",
    "FusionConfig",
    "HFTextTower",
    "ImageTextMatching",
    "MultimodalModule",
    "ObjectiveConfig",
    "OptimConfig",
    "ParamGroupRule",
    "SampleWeighting",
    "SigLipLoss",
    "TermWeighting",
    "TorchvisionTower",
    "TowerAdapters",
    "TowerTraining",
    "WholeBatch",
]
