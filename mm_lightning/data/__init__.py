"""Data: records from a source (JSONL + image files) -> decoded, transformed images + batched tokenization."""

from __future__ import annotations

from typing import Any

from mm_lightning.data.collate import MultimodalCollate
from mm_lightning.data.datamodule import EmptySplitError, MultimodalDataModule, NoTrainingBatch
from mm_lightning.data.demo import DemoDataModule
from mm_lightning.data.records import Record, RecordError
from mm_lightning.data.samplers import LengthGroupedSampler
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder, TooManyBadRecords
from mm_lightning.data.skips import SkipLog
from mm_lightning.data.sources.jsonl import JsonlIndex

__all__ = [
    "BadRecordLogger",
    "BadRecordPolicy",
    "DemoDataModule",
    "EmptySplitError",
    "JsonlIndex",
    "LengthGroupedSampler",
    "MultimodalCollate",
    "MultimodalDataModule",
    "NoTrainingBatch",
    "Record",
    "RecordError",
    "SampleBuilder",
    "SkipLog",
    "TooManyBadRecords",
]


def __getattr__(name: str) -> Any:
    # BadRecordLogger is a callback (mm_lightning.callbacks.bad_records); the callbacks package imports data
    # modules, so this older import path is resolved on first use instead of at import time (no cycle).
    if name == "BadRecordLogger":
        from mm_lightning.callbacks.bad_records import BadRecordLogger

        return BadRecordLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
