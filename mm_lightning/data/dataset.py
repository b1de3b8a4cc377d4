"""The map-style image-caption dataset over a :class:`~mm_lightning.data.jsonl.JsonlIndex`, the splits and their
errors, and the length-grouped training sampler."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from mm_lightning.data.jsonl import JsonlIndex
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder
from mm_lightning.errors import ExplainedError
from mm_lightning.seeding import derive_seed, derived_rng, global_seed

CaptionSampling = Literal["random", "all"]


class ImageTextDataset(Dataset):
    """Yields ``{"image": uint8 (3,H,W), "caption", "image_id", "index", "skipped"}``.

    Args:
        index: the split's JSONL index.
        builder: record -> sample (decode, checks, transform).
        caption_sampling: ``"random"``: one item per image, one of its captions drawn per visit (training);
            ``"all"``: one item per (image, caption) pair (evaluation, COCO protocol).
        policy: what a bad record costs (``raise`` or a counted replacement).
        seed: base seed of the per-batch augmentation seeding (``None``: the one ``seed_everything`` set).
    """

    def __init__(
        self,
        index: JsonlIndex,
        builder: SampleBuilder,
        caption_sampling: CaptionSampling = "all",
        policy: BadRecordPolicy | None = None,
        seed: int | None = None,
    ) -> None:
        self.index, self.builder, self.caption_sampling = index, builder, caption_sampling
        self.seed = global_seed() if seed is None else seed
        self.policy = policy if policy is not None else BadRecordPolicy(seed=self.seed)

    def __len__(self) -> int:
        return self.index.num_images if self.caption_sampling == "random" else self.index.num_captions

    def caption_of(self, item: int) -> int:
        """Pair row that ``item`` reads on this visit."""
        if self.caption_sampling == "all":
            return item
        rows = self.index.pairs_of_image(item)
        # torch's RNG, seeded per batch by __getitems__ (draws differ across batches and epochs).
        return int(rows[int(torch.randint(len(rows), ()).item())]) if len(rows) > 1 else int(rows[0])

    def lengths(self) -> np.ndarray:
        """Per-item caption length proxy (words) for length-aware batching."""
        if self.caption_sampling == "all":
            return self.index.cap_words
        return self.index.cap_words[self.index.first_pair_of_images()]

    def image_records(self) -> list[Any]:
        """One record per distinct image (its first pair), in index order."""
        return [self.index.pair(int(row)).record for row in self.index.first_pair_of_images()]

    def serve_features(self, features: Any) -> None:
        """Serve cached image features (:class:`~mm_lightning.data.features.CachedFeatures`) in place of the
        decoded images."""
        self.builder.features = features

    def load(self, item: int) -> dict[str, Any]:
        """Load one item or raise :class:`~mm_lightning.data.records.RecordError` (file, line, image, reason)."""
        pair = self.index.pair(self.caption_of(item))
        return self.builder(pair.record, pair.caption, pair.image_id, item)

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        """Load a whole batch with its random draws (caption choice, crops) seeded by the batch's own indices.

        The DataLoader calls this once per batch, in the main process or in whichever worker gets the batch. A
        seed derived from the (shuffled) index list makes the augmentation a pure function of the batch, so it
        is the same in any worker layout and after a mid-epoch resume -- which worker RNGs seeded at iterator
        creation cannot give (their stream position is not in a checkpoint).
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, items))
            return self.policy.load_batch(list(items), self.load, len(self))

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.policy.load(item, self.load, len(self))


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


class LengthGroupedSampler(DistributedSampler):
    """Shuffle, sort by length inside windows of ``window_batches`` global batches, deal batches to ranks.

    A ``DistributedSampler`` subclass so Lightning keeps it (and calls ``set_epoch``) instead of injecting its
    own. Each rank's stream is a whole number of ``batch_size`` chunks, so the DataLoader's batching lands
    exactly on the length groups. The order depends only on ``(seed, epoch)``: all ranks agree, and a
    stateful loader can resume mid-epoch by replaying it.

    Args:
        lengths: one length per dataset item.
        batch_size: per-device batch size (the group size).
        num_replicas: world size.
        rank: this process's global rank.
        seed: shuffle seed (same on all ranks).
        window_batches: global batches per sorting window; larger saves more padding, randomizes less.
        drop_last: drop the tail that does not fill a batch on every rank (else wrap around to fill it).
    """

    def __init__(
        self,
        lengths: Sized,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        window_batches: int = 32,
        drop_last: bool = True,
    ) -> None:
        super().__init__(
            lengths, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
        )
        self.lengths = np.asarray(lengths)
        self.batch_size, self.window_batches = batch_size, window_batches
        per_step = batch_size * num_replicas
        steps = len(self.lengths) // per_step if drop_last else -(-len(self.lengths) // per_step)
        self.num_samples = steps * batch_size
        self.total_size = steps * per_step

    def batches(self) -> np.ndarray:
        """(steps, num_replicas, batch_size) item indices for the current epoch, identical on every rank."""
        rng = derived_rng(self.seed, self.epoch)
        order = rng.permutation(len(self.lengths))
        if self.total_size > len(order):  # wrap around so every rank gets full batches
            order = np.concatenate([order, order[: self.total_size - len(order)]])
        window = self.batch_size * self.num_replicas * self.window_batches
        chunks = []
        for start in range(0, len(order), window):
            part = order[start : start + window]
            chunks.append(part[np.argsort(self.lengths[part], kind="stable")])
        grouped = np.concatenate(chunks)[: self.total_size].reshape(-1, self.batch_size)
        # Shuffle whole batches so long and short ones alternate over the epoch; rank r takes every
        # num_replicas-th batch.
        grouped = grouped[rng.permutation(len(grouped))]
        return grouped.reshape(-1, self.num_replicas, self.batch_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.batches()[:, self.rank].reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_samples
