"""Every callback of the project: checkpointing and resume, NaN guard, monitors, prediction writer."""

from mm_lightning.callbacks.checkpoint import ExactResume, PreemptionCheckpoint, ResilientCheckpoint
from mm_lightning.callbacks.monitors import (
    GradNormMonitor,
    PeakMemoryMonitor,
    RetrievalGridLogger,
    StepTimeMonitor,
)
from mm_lightning.callbacks.nan_guard import NaNGuard, NonFiniteTrainingError
from mm_lightning.callbacks.prediction import EmbeddingWriter

__all__ = [
    "EmbeddingWriter",
    "ExactResume",
    "GradNormMonitor",
    "NaNGuard",
    "NonFiniteTrainingError",
    "PeakMemoryMonitor",
    "PreemptionCheckpoint",
    "ResilientCheckpoint",
    "RetrievalGridLogger",
    "StepTimeMonitor",
]
