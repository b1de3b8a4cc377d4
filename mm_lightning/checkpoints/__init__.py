"""Checkpoints: atomic saves and checked loads (:mod:`.io`), file checks and the run's ``last``/``best``
(:mod:`.files`), what a checkpoint may rebuild (:mod:`.loading`), the run folder (:mod:`.run_folder`)."""

from mm_lightning.checkpoints.files import CheckpointFileError, check_checkpoint_file
from mm_lightning.checkpoints.io import AtomicCheckpointIO

__all__ = ["AtomicCheckpointIO", "CheckpointFileError", "check_checkpoint_file"]
