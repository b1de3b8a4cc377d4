"""Record sources beyond JSONL files (``mm_lightning.data.jsonl``): WebDataset shards (``shards``,
``shard_dataset``) and weighted mixes of sources (``mixing``), loaded by the shard data module."""
