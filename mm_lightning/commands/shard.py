"""``python -m mm_lightning shard --config <run config> --out shards``: convert the config's JSONL splits (records and
their images) into WebDataset shards under ``<out>/<split>/`` (img2dataset's layout), ready for ``ShardDataModule``."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Write the shards of a run's config (``--config``, ``--data.*``, and ``ShardOptions``: ``--out`` ...)."""
    from mm_lightning.cli import STANDALONE_COMMANDS
    from mm_lightning.config_parser import read_data_config
    from mm_lightning.extras.shards.writer import ShardOptions, shard_datamodule

    datamodule, given = read_data_config(
        argv, "shard", ShardOptions, description=STANDALONE_COMMANDS["shard"]
    )
    shard_datamodule(datamodule, ShardOptions(**given))
    return 0
