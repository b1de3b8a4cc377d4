"""Where records come from: a JSONL file + image files (``jsonl``), WebDataset shards (``shards``)."""

from mm_lightning.lazy import lazy_exports

_EXPORTS = {
    "JsonlIndex": "mm_lightning.data.sources.jsonl",
    "RecordParser": "mm_lightning.data.sources.jsonl",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
