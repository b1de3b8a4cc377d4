"""Data: ``MultimodalDataModule`` (JSONL + image files) and the generated demo."""

from mm_lightning.data.collate import MultimodalCollate
from mm_lightning.data.config import ImageOptions, LoaderOptions
from mm_lightning.data.datamodule import MultimodalDataModule
from mm_lightning.data.demo import DemoDataModule
from mm_lightning.data.jsonl import JsonlIndex
from mm_lightning.data.order import TrainOrder
from mm_lightning.data.records import EmptySplitError, NoTrainingBatch, Record, RecordError
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder, TooManyBadRecords
from mm_lightning.data.skips import SkipLog

__all__ = [
    "BadRecordPolicy",
    "DemoDataModule",
    "EmptySplitError",
    "ImageOptions",
    "JsonlIndex",
    "LoaderOptions",
    "MultimodalCollate",
    "MultimodalDataModule",
    "NoTrainingBatch",
    "Record",
    "RecordError",
    "SampleBuilder",
    "SkipLog",
    "TooManyBadRecords",
    "TrainOrder",
]
