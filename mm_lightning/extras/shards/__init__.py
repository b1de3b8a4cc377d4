"""WebDataset shards: the data module and weighted mixes of sources (:mod:`.datamodule`, :mod:`.mixing`), the
shard listing and reading (:mod:`.files`, :mod:`.dataset`), and the writer behind ``python -m mm_lightning shard``
(:mod:`.writer`)."""
