"""Data: records from a source (JSONL + image files, or WebDataset shards) -> decoded, transformed images + batched
tokenization. ``MultimodalDataModule`` reads JSONL files, ``ShardDataModule`` shards (and weighted mixes).
"""

from __future__ import annotations

from mm_lightning.data.collate import MultimodalCollate
from mm_lightning.data.datamodule import MultimodalDataModule
from mm_lightning.data.demo import DemoDataModule
from mm_lightning.data.records import Record, RecordError
from mm_lightning.data.samplers import LengthGroupedSampler
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder, TooManyBadRecords
from mm_lightning.data.shard_datamodule import DemoShardDataModule, ShardDataModule, Source
from mm_lightning.data.skips import SkipLog
from mm_lightning.data.sources.jsonl import JsonlIndex
from mm_lightning.data.splits import EmptySplitError, NoTrainingBatch

__all__ = [
    "BadRecordPolicy",
    "DemoDataModule",
    "DemoShardDataModule",
    "EmptySplitError",
    "JsonlIndex",
    "LengthGroupedSampler",
    "MultimodalCollate",
    "MultimodalDataModule",
    "NoTrainingBatch",
    "Record",
    "RecordError",
    "SampleBuilder",
    "ShardDataModule",
    "SkipLog",
    "Source",
    "TooManyBadRecords",
]
