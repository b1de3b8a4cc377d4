"""Map-style image-caption dataset over a JSONL index, with the split helpers and their errors."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from mm_lightning import ExplainedError
from mm_lightning.data.jsonl import JsonlIndex
from mm_lightning.data.loader import derive_seed, global_seed
from mm_lightning.data.records import IMAGE_KINDS, RecordError
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder

CaptionSampling = Literal["random", "all"]


class ImageTextDataset(Dataset):
    """Yields ``{"image": uint8 (3,H,W), "caption", "image_id", "index", "skipped"}``.
    ``caption_sampling="random"``: one item per image, caption drawn per visit; ``"all"``: one per pair."""

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
        try:
            return self.builder(pair.record, pair.caption, pair.image_id, item)
        except RecordError as err:
            if err.kind in IMAGE_KINDS:  # bad for every record that names the image
                rows = self.index.pairs_of_image(pair.image_id)
                err.lines = tuple(
                    sorted({int(n) for n in self.index.line_numbers[self.index.cap_line[rows]]})
                )
            raise

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        """Load a batch; draws (caption, crops) seeded by its indices: same in any worker layout or resume."""
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
