"""The callbacks of the training core: bad-record counts, throughput, the run report and the prediction writer."""

from mm_lightning.callbacks.bad_records import BadRecordLogger
from mm_lightning.callbacks.prediction import EmbeddingWriter
from mm_lightning.callbacks.run_report import ModelSummary, ProgressLines, RunSummary
from mm_lightning.callbacks.throughput import ThroughputMonitor

__all__ = [
    "BadRecordLogger",
    "EmbeddingWriter",
    "ModelSummary",
    "ProgressLines",
    "RunSummary",
    "ThroughputMonitor",
]
