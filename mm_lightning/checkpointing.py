"""Deprecated location, kept for one release: import from :mod:`mm_lightning.callbacks` (checkpoint callbacks)
and :mod:`mm_lightning.plugins` (``AtomicCheckpointIO``)."""

import warnings

from mm_lightning.callbacks.checkpoint import ExactResume, PreemptionCheckpoint, ResilientCheckpoint
from mm_lightning.plugins.io import AtomicCheckpointIO

warnings.warn(
    "mm_lightning.checkpointing is deprecated: import ResilientCheckpoint, ExactResume and PreemptionCheckpoint"
    " from mm_lightning.callbacks and AtomicCheckpointIO from mm_lightning.plugins.",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["AtomicCheckpointIO", "ExactResume", "PreemptionCheckpoint", "ResilientCheckpoint"]
