"""Data: JSONL image-caption records -> decoded, transformed images + batched tokenization."""

from mm_lightning.data.collate import MultimodalCollate
from mm_lightning.data.datamodule import MultimodalDataModule
from mm_lightning.data.demo import DemoDataModule
from mm_lightning.data.records import JsonlIndex, RecordError
from mm_lightning.data.samplers import LengthGroupedSampler
from mm_lightning.data.skips import BadRecordLogger

__all__ = [
    "BadRecordLogger",
    "DemoDataModule",
    "JsonlIndex",
    "LengthGroupedSampler",
    "MultimodalCollate",
    "MultimodalDataModule",
    "RecordError",
]
