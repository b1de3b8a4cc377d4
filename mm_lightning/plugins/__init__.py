"""Trainer plugins: :class:`AtomicCheckpointIO` (atomic saves, checked loads)."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "AtomicCheckpointIO": "mm_lightning.plugins.io",
    "CheckpointFileError": "mm_lightning.plugins.checkpoint_file",
    "check_checkpoint_file": "mm_lightning.plugins.checkpoint_file",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
