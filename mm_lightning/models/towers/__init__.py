"""Image and text towers: one class per family, each calling its library; a tower, built in or your own, is
chosen by ``class_path`` + ``init_args`` (``model.image_tower``, ``model.text_tower``).

Every tower returns an :class:`EncoderOutput` (a pooled vector for the contrastive loss, tokens for the fusion)
and carries ``pooled_dim``, ``token_dim`` and the ``data_config`` its weights expect. A user's own ``nn.Module``
serves as a tower under the contract of :mod:`mm_lightning.models.towers.contract`.
"""

from mm_lightning import lazy_exports

_EXPORTS = {
    "CLIPImageTower": "mm_lightning.models.towers.clip",
    "CLIPTextTower": "mm_lightning.models.towers.clip",
    "EncoderOutput": "mm_lightning.models.towers.base",
    "HFTextTower": "mm_lightning.models.towers.hf_text",
    "HFVisionTower": "mm_lightning.models.towers.hf_vision",
    "OpenCLIPImageTower": "mm_lightning.models.towers.open_clip",
    "OpenCLIPTextTower": "mm_lightning.models.towers.open_clip",
    "SmallResNet": "mm_lightning.models.towers.torchvision",
    "TimmTower": "mm_lightning.models.towers.timm",
    "TorchvisionTower": "mm_lightning.models.towers.torchvision",
    "Tower": "mm_lightning.models.towers.base",
    "TowerContractError": "mm_lightning.models.towers.contract",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
