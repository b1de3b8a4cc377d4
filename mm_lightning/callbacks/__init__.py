"""Every callback of the project: exact resume, preemption saves, bad-record counts, NaN guard, monitors, FLOP counter, prediction writer, EMA."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "BadRecordLogger": "mm_lightning.callbacks.bad_records",
    "EMA": "mm_lightning.callbacks.ema",
    "EmbeddingWriter": "mm_lightning.callbacks.prediction",
    "ExactResume": "mm_lightning.callbacks.exact_resume",
    "FlopCounter": "mm_lightning.callbacks.flops",
    "GradNormMonitor": "mm_lightning.callbacks.monitors",
    "LockedImageFeatures": "mm_lightning.callbacks.feature_cache",
    "ModelSummary": "mm_lightning.callbacks.run_report",
    "NaNGuard": "mm_lightning.callbacks.nan_guard",
    "NonFiniteTrainingError": "mm_lightning.callbacks.nan_guard",
    "PeakMemoryMonitor": "mm_lightning.callbacks.monitors",
    "PreemptionCheckpoint": "mm_lightning.callbacks.preemption",
    "ProgressLines": "mm_lightning.callbacks.run_report",
    "RetrievalGridLogger": "mm_lightning.callbacks.monitors",
    "RunSummary": "mm_lightning.callbacks.run_report",
    "StepTimeMonitor": "mm_lightning.callbacks.monitors",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
