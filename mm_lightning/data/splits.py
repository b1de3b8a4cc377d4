"""The splits a data module serves, which Lightning stage reads which, and the errors of a split without data."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Literal

from mm_lightning.data.jsonl import JsonlIndex
from mm_lightning.errors import ExplainedError

Split = Literal["train", "val", "test", "predict"]

# The splits each Lightning stage reads.
STAGE_SPLITS: dict[str, tuple[str, ...]] = {
    "fit": ("train", "val"),
    "validate": ("val",),
    "test": ("test",),
    "predict": ("predict",),
}


class MissingTrainingFile(ExplainedError, FileNotFoundError):
    """The training JSONL named in the config does not exist."""

    def __init__(self, command: str, path: str) -> None:
        super().__init__(
            f"{command}: train: {path} does not exist. Set --data.init_args.train_file to your JSONL."
        )


def splits_with_files(files: Mapping[str, str | None], splits: Iterable[str], command: str) -> list[str]:
    """The splits among ``splits`` whose JSONL file exists, for commands that read whole splits (audit, shard).

    A recipe names val and test files a user's data may not have: such a split is left out with a line saying so.
    A missing training file is an error.

    Args:
        files: split -> JSONL path (``None``: no file).
        splits: the splits asked for.
        command: the command's name, for the messages.
    """
    chosen = []
    for split in splits:
        path = files.get(split)
        if path is None:
            continue
        if not os.path.exists(path):
            if split == "train":
                raise MissingTrainingFile(command, path)
            print(
                f"{command}: {split}: {path} does not exist: left out (--data.init_args.{split}_file sets it)"
            )
            continue
        chosen.append(split)
    return chosen


class NoTrainingBatch(ExplainedError, ValueError):
    """The training split holds fewer samples than one batch per device: no training step would run.

    Refused at the start: the run would otherwise end "successfully" without a step (``drop_last``), and records
    never loaded would never be checked.

    Args:
        where: the split's source and what was found there.
        per_rank: training samples each rank's loader draws per epoch.
        batch_size: the batch size per device.
        world: the number of devices.
    """

    def __init__(self, where: str, per_rank: int, batch_size: int, world: int) -> None:
        devices = f" x {world} devices" if world > 1 else ""
        super().__init__(
            f"train: {where}: fewer than one batch per device ({per_rank} per device; batch_size {batch_size}"
            f"{devices}), so not one training step would run (the last incomplete batch is dropped). Their images"
            " were never loaded, so bad ones among them are not counted either. Lower --data.init_args.batch_size"
            " or add training records."
        )


class EmptySplitError(ExplainedError, ValueError):
    """A split's file holds no valid record (empty, or every line bad)."""

    def __init__(self, label: str, index: JsonlIndex) -> None:
        split = label.split(" ")[0].removesuffix("_file")
        file, skips = index.file, index.skips
        detail = f"{index.lines} non-blank lines, {skips.count} bad"
        detail += f"; first: {skips.first[0]}" if skips.first else ""
        hint = {
            "val": " Without validation data no metric is computed and no best checkpoint can be kept: fix the "
            "file, or train without validation (--data.val_file null).",
            "train": " There is nothing to train on.",
        }.get(split, "")
        super().__init__(f"{label} {file}: 0 valid records found ({detail}).{hint}")
