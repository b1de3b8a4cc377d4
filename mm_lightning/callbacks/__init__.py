"""The callbacks of the training core: bad-record counts, throughput, the run summary, progress lines and the
prediction writer."""

from mm_lightning.callbacks.bad_records import BadRecordLogger
from mm_lightning.callbacks.prediction import EmbeddingWriter
from mm_lightning.callbacks.progress_lines import ProgressLines
from mm_lightning.callbacks.run_summary import RunSummary
from mm_lightning.callbacks.throughput import ThroughputLogger

__all__ = [
    "BadRecordLogger",
    "EmbeddingWriter",
    "ProgressLines",
    "RunSummary",
    "ThroughputLogger",
]
