"""Data: ``MultimodalDataModule`` (JSONL + image files) and the generated demo."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "BadRecordPolicy": "mm_lightning.data.samples",
    "DemoDataModule": "mm_lightning.data.demo",
    "EmptySplitError": "mm_lightning.data.records",
    "JsonlIndex": "mm_lightning.data.jsonl",
    "MultimodalCollate": "mm_lightning.data.collate",
    "MultimodalDataModule": "mm_lightning.data.datamodule",
    "NoTrainingBatch": "mm_lightning.data.records",
    "Record": "mm_lightning.data.records",
    "RecordError": "mm_lightning.data.records",
    "SampleBuilder": "mm_lightning.data.samples",
    "SkipLog": "mm_lightning.data.records",
    "TooManyBadRecords": "mm_lightning.data.samples",
    "TrainOrder": "mm_lightning.data.order",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
