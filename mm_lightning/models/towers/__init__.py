"""Image and text towers: one module per family, and the registry that turns a name into a tower.

Every tower returns an :class:`EncoderOutput` (a pooled vector for the contrastive loss, tokens for the fusion)
and carries ``pooled_dim``, ``token_dim`` and the ``data_config`` its weights expect. A user's own ``nn.Module``
serves as a tower under the contract of :mod:`mm_lightning.models.towers.contract`.
"""

from mm_lightning.models.towers.base import EncoderOutput, Tower
from mm_lightning.models.towers.contract import TowerContractError
from mm_lightning.models.towers.hf_text import HFTextTower
from mm_lightning.models.towers.registry import (
    build_image_tower,
    build_text_tower,
    register_image_tower,
    register_text_tower,
)
from mm_lightning.models.towers.torchvision import SmallResNet, TorchvisionTower

__all__ = [
    "EncoderOutput",
    "HFTextTower",
    "SmallResNet",
    "TorchvisionTower",
    "Tower",
    "TowerContractError",
    "build_image_tower",
    "build_text_tower",
    "register_image_tower",
    "register_text_tower",
]
