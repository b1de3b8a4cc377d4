"""Checkpoints: atomic saves and checked loads (:mod:`.io`), file checks and the run's ``last``/``best``
(:mod:`.files`), what a checkpoint may rebuild (:mod:`.loading`), the run folder (:mod:`.run_folder`)."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "AtomicCheckpointIO": "mm_lightning.checkpoints.io",
    "CheckpointFileError": "mm_lightning.checkpoints.files",
    "check_checkpoint_file": "mm_lightning.checkpoints.files",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
