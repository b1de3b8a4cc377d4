"""Callbacks: monitors, prediction writer, NaN guard."""

from mm_lightning.callbacks.monitors import (  # noqa: E402,F401
    GradNormMonitor,
    PeakMemoryMonitor,
    RetrievalGridLogger,
    StepTimeMonitor,
)
from mm_lightning.callbacks.nan_guard import NaNGuard, NonFiniteTrainingError  # noqa: E402,F401
from mm_lightning.callbacks.prediction import EmbeddingWriter  # noqa: E402,F401
