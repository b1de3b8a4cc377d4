"""Image-text pair losses (``model.loss`` by ``class_path``): :class:`ContrastiveLoss` (CLIP's, the default),
:class:`SigLipLoss`, or your own under the contract of :mod:`mm_lightning.models.losses.base`."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "ContrastiveLoss": "mm_lightning.models.losses.clip",
    "LossContractError": "mm_lightning.models.losses.base",
    "PairLogits": "mm_lightning.models.losses.base",
    "PairLoss": "mm_lightning.models.losses.base",
    "ScaledPairLoss": "mm_lightning.models.losses.base",
    "SigLipLoss": "mm_lightning.models.losses.siglip",
    "check_loss": "mm_lightning.models.losses.checks",
    "loss_terms": "mm_lightning.models.losses.base",
    "weighted_sum": "mm_lightning.models.losses.base",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
