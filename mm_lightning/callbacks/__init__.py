"""Every callback of the project: checkpointing and resume, bad-record counts, NaN guard, monitors, FLOP counter, prediction writer."""

from mm_lightning.callbacks.bad_records import BadRecordLogger
from mm_lightning.callbacks.checkpoint import ExactResume, PreemptionCheckpoint
from mm_lightning.callbacks.feature_cache import LockedImageFeatures
from mm_lightning.callbacks.flops import FlopCounter
from mm_lightning.callbacks.monitors import (
    GradNormMonitor,
    PeakMemoryMonitor,
    RetrievalGridLogger,
    StepTimeMonitor,
)
from mm_lightning.callbacks.nan_guard import NaNGuard, NonFiniteTrainingError
from mm_lightning.callbacks.prediction import EmbeddingWriter
from mm_lightning.callbacks.run_report import ProgressLines, RunSummary
from mm_lightning.callbacks.summary import ModelSummary

__all__ = [
    "BadRecordLogger",
    "EmbeddingWriter",
    "ExactResume",
    "FlopCounter",
    "GradNormMonitor",
    "LockedImageFeatures",
    "ModelSummary",
    "NaNGuard",
    "NonFiniteTrainingError",
    "PeakMemoryMonitor",
    "PreemptionCheckpoint",
    "ProgressLines",
    "RetrievalGridLogger",
    "RunSummary",
    "StepTimeMonitor",
]
