"""Map-style image-caption dataset over a JSONL index, split helpers and errors, a length-grouped sampler."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler

from mm_lightning.data.jsonl import JsonlIndex
from mm_lightning.data.loader import derive_seed, derived_rng, global_seed
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder
from mm_lightning.errors import ExplainedError

CaptionSampling = Literal["random", "all"]


class ImageTextDataset(Dataset):
    """Yields ``{"image": uint8 (3,H,W), "caption", "image_id", "index", "skipped"}``.

    ``caption_sampling``: ``"random"``: one item per image, caption drawn per visit; ``"all"``: one per pair.
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
        """Serve cached image features in place of the decoded images."""
        self.builder.features = features

    def load(self, item: int) -> dict[str, Any]:
        """Load one item or raise :class:`~mm_lightning.data.records.RecordError`."""
        pair = self.index.pair(self.caption_of(item))
        return self.builder(pair.record, pair.caption, pair.image_id, item)

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        """Load a whole batch with its random draws (caption choice, crops) seeded by the batch's own indices.

        Augmentation is then the same in any worker layout and after a mid-epoch resume.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, items))
            return self.policy.load_batch(list(items), self.load, len(self))

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.policy.load(item, self.load, len(self))


Split = Literal["train", "val", "test", "predict"]

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
    """The splits whose JSONL file exists (a missing val/test is left out with a message, train raises)."""
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
    """The training split holds fewer samples than one batch per device: no training step would run."""

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

    A ``DistributedSampler`` so Lightning keeps it; the order depends only on ``(seed, epoch)`` (resumable).
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
        # Shuffle whole batches so long and short ones alternate; rank r takes every num_replicas-th batch.
        grouped = grouped[rng.permutation(len(grouped))]
        return grouped.reshape(-1, self.num_replicas, self.batch_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.batches()[:, self.rank].reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_samples
