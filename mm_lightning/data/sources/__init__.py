"""Where records come from: a JSONL file + image files (``jsonl``), WebDataset shards (``shards``)."""

from mm_lightning.data.sources.jsonl import JsonlIndex, RecordParser

__all__ = ["JsonlIndex", "RecordParser"]
