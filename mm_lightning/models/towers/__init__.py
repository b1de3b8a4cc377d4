"""Image and text towers: one class per family, each calling its library; a tower, built in or your own, is
chosen by ``class_path`` + ``init_args`` (``model.image_tower``, ``model.text_tower``).

Every tower returns an :class:`EncoderOutput` (a pooled vector for the contrastive loss, tokens for the fusion)
and carries ``pooled_dim``, ``token_dim`` and the ``data_config`` its weights expect. A user's own ``nn.Module``
serves as a tower under the contract of :mod:`mm_lightning.models.towers.contract`.
"""

from mm_lightning.models.towers.base import EncoderOutput, Tower
from mm_lightning.models.towers.clip import CLIPImageTower, CLIPTextTower
from mm_lightning.models.towers.contract import TowerContractError
from mm_lightning.models.towers.hf_text import HFTextTower
from mm_lightning.models.towers.hf_vision import HFVisionTower
from mm_lightning.models.towers.open_clip import OpenCLIPImageTower, OpenCLIPTextTower
from mm_lightning.models.towers.timm import TimmTower
from mm_lightning.models.towers.torchvision import SmallResNet, TorchvisionTower

__all__ = [
    "CLIPImageTower",
    "CLIPTextTower",
    "EncoderOutput",
    "HFTextTower",
    "HFVisionTower",
    "OpenCLIPImageTower",
    "OpenCLIPTextTower",
    "SmallResNet",
    "TimmTower",
    "TorchvisionTower",
    "Tower",
    "TowerContractError",
]
