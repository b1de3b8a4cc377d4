"""Model parts: towers, fusion, losses, the ``DualEncoder`` network and the ``MultimodalModule`` that trains it."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "ContrastiveLoss": "mm_lightning.models.losses",
    "CrossAttentionFusion": "mm_lightning.models.itm",
    "DualEncoder": "mm_lightning.models.dual_encoder",
    "ParamGroupRule": "mm_lightning.models.rules",
    "SampleWeighting": "mm_lightning.models.rules",
    "TermWeighting": "mm_lightning.models.rules",
    "TowerAdapters": "mm_lightning.models.rules",
    "WholeBatch": "mm_lightning.models.rules",
    "EncoderOutput": "mm_lightning.models.towers",
    "FusionConfig": "mm_lightning.models.config",
    "HFTextTower": "mm_lightning.models.towers",
    "ImageTextMatching": "mm_lightning.models.itm",
    "MultimodalModule": "mm_lightning.models.module",
    "ObjectiveConfig": "mm_lightning.models.config",
    "OptimConfig": "mm_lightning.models.config",
    "SigLipLoss": "mm_lightning.models.losses",
    "TorchvisionTower": "mm_lightning.models.towers",
    "TowerTraining": "mm_lightning.models.config",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
