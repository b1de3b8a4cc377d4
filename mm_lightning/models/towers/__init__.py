"""Image and text towers, one class per family (each calls its library), named by ``class_path`` + ``init_args``.
Every tower returns an :class:`EncoderOutput` and carries ``pooled_dim``, ``token_dim`` and its ``data_config``;
your own ``nn.Module`` serves as a tower under :mod:`mm_lightning.models.towers.contract`."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "CLIPImageTower": "mm_lightning.models.towers.clip",
    "CLIPTextTower": "mm_lightning.models.towers.clip",
    "EncoderOutput": "mm_lightning.models.towers.contract",
    "HFTextTower": "mm_lightning.models.towers.hf_text",
    "HFVisionTower": "mm_lightning.models.towers.hf_vision",
    "OpenCLIPImageTower": "mm_lightning.models.towers.open_clip",
    "OpenCLIPTextTower": "mm_lightning.models.towers.open_clip",
    "SmallResNet": "mm_lightning.models.towers.torchvision",
    "TimmTower": "mm_lightning.models.towers.timm",
    "TorchvisionTower": "mm_lightning.models.towers.torchvision",
    "Tower": "mm_lightning.models.towers.contract",
    "TowerContractError": "mm_lightning.models.towers.contract",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
