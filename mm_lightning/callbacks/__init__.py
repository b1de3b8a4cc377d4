"""The callbacks of the training core: exact resume, preemption saves, bad-record counts, NaN guard, the run report,
the prediction writer (the monitors, FLOP counter and EMA are extras: :mod:`mm_lightning.extras`)."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "BadRecordLogger": "mm_lightning.callbacks.bad_records",
    "EmbeddingWriter": "mm_lightning.callbacks.prediction",
    "ExactResume": "mm_lightning.callbacks.exact_resume",
    "ModelSummary": "mm_lightning.callbacks.run_report",
    "NaNGuard": "mm_lightning.callbacks.nan_guard",
    "NonFiniteTrainingError": "mm_lightning.callbacks.nan_guard",
    "PreemptionCheckpoint": "mm_lightning.callbacks.preemption",
    "ProgressLines": "mm_lightning.callbacks.run_report",
    "RunSummary": "mm_lightning.callbacks.run_report",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
