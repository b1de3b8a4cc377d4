"""Image and text towers, one class per family (each calls its library), named by ``class_path`` + ``init_args``.
Every tower returns an :class:`EncoderOutput` and carries ``pooled_dim``, ``token_dim`` and its ``data_config``;
your own ``nn.Module`` serves as a tower under :mod:`mm_lightning.models.towers.contract`."""

from mm_lightning.models.towers.clip import CLIPImageTower, CLIPTextTower
from mm_lightning.models.towers.contract import EncoderOutput, Tower, TowerContractError
from mm_lightning.models.towers.hf_text import HFTextTower
from mm_lightning.models.towers.hf_vision import HFVisionTower
from mm_lightning.models.towers.open_clip import OpenCLIPImageTower, OpenCLIPTextTower
from mm_lightning.models.towers.small_resnet import SmallResNet
from mm_lightning.models.towers.timm import TimmTower
from mm_lightning.models.towers.torchvision import TorchvisionTower

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
