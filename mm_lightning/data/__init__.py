"""Data: ``MultimodalDataModule`` (JSONL + image files), ``ShardDataModule`` (WebDataset shards, weighted mixes)."""

from mm_lightning import lazy_exports

_EXPORTS = {
    "BadRecordPolicy": "mm_lightning.data.samples",
    "DemoDataModule": "mm_lightning.data.demo",
    "DemoShardDataModule": "mm_lightning.data.shard_datamodule",
    "EmptySplitError": "mm_lightning.data.dataset",
    "JsonlIndex": "mm_lightning.data.jsonl",
    "LengthGroupedSampler": "mm_lightning.data.samplers",
    "MultimodalCollate": "mm_lightning.data.collate",
    "MultimodalDataModule": "mm_lightning.data.datamodule",
    "NoTrainingBatch": "mm_lightning.data.dataset",
    "Record": "mm_lightning.data.records",
    "RecordError": "mm_lightning.data.records",
    "SampleBuilder": "mm_lightning.data.samples",
    "ShardDataModule": "mm_lightning.data.shard_datamodule",
    "SkipLog": "mm_lightning.data.records",
    "Source": "mm_lightning.data.shard_datamodule",
    "TooManyBadRecords": "mm_lightning.data.samples",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
