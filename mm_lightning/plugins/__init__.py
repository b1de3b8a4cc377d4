"""Trainer plugins: :class:`AtomicCheckpointIO` (atomic saves, checked loads)."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "AtomicCheckpointIO": "mm_lightning.plugins.io",
    "CheckpointFileError": "mm_lightning.plugins.io",
    "check_checkpoint_file": "mm_lightning.plugins.io",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
