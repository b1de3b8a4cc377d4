"""The callbacks of the training core: bad-record counts, throughput, the run report and the prediction writer."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "BadRecordLogger": "mm_lightning.callbacks.bad_records",
    "EmbeddingWriter": "mm_lightning.callbacks.prediction",
    "ModelSummary": "mm_lightning.callbacks.run_report",
    "ProgressLines": "mm_lightning.callbacks.run_report",
    "RunSummary": "mm_lightning.callbacks.run_report",
    "ThroughputMonitor": "mm_lightning.callbacks.throughput",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
