"""Trainer plugins: :class:`AtomicCheckpointIO` (atomic saves, checked loads)."""

from mm_lightning.plugins.io import AtomicCheckpointIO, CheckpointFileError, check_checkpoint_file

__all__ = ["AtomicCheckpointIO", "CheckpointFileError", "check_checkpoint_file"]
