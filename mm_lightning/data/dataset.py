"""Map-style image-caption dataset over a :class:`~mm_lightning.data.jsonl.JsonlIndex`."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from mm_lightning.data.jsonl import JsonlIndex
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder
from mm_lightning.seeding import derive_seed, global_seed

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
