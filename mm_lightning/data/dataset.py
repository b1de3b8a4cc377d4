"""Map-style image-caption dataset over a :class:`~mm_lightning.data.records.JsonlIndex`."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from mm_lightning.data.images import DEFAULT_MAX_PIXELS, ImageDecodeError
from mm_lightning.data.records import JsonlIndex, RecordError
from mm_lightning.data.transforms import decode_and_transform

CaptionSampling = Literal["random", "all"]


class ImageTextDataset(Dataset):
    """Yields ``{"image": uint8 (3,H,W), "caption", "image_id", "index", "num_skipped", "skip_reasons"}``.

    Args:
        index: the split's JSONL index.
        transform: uint8 image transform.
        caption_sampling: ``"random"``: one item per image, one of its captions drawn per visit (training);
            ``"all"``: one item per (image, caption) pair (evaluation, COCO protocol).
        on_bad_record: ``"raise"`` or ``"skip"`` (replace by the next valid item, count the skip).
        max_pixels: decompression-bomb guard, see :func:`decode_image_file`.
        min_side: allow reduced-size JPEG decoding down to this shorter side (``None``: full size).
        max_replacements: give up (raise) after this many consecutive bad items under ``"skip"``.
        seed: base seed of the per-batch augmentation seeding (``None``: the one ``seed_everything`` set).
    """

    def __init__(
        self,
        index: JsonlIndex,
        transform: Callable[[torch.Tensor], torch.Tensor],
        caption_sampling: CaptionSampling = "all",
        on_bad_record: Literal["raise", "skip"] = "raise",
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        min_side: int | None = None,
        max_replacements: int = 64,
        seed: int | None = None,
    ) -> None:
        self.index, self.transform, self.caption_sampling = index, transform, caption_sampling
        self.on_bad_record, self.max_pixels, self.min_side = on_bad_record, max_pixels, min_side
        self.max_replacements = max_replacements
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed

    def __len__(self) -> int:
        return self.index.num_images if self.caption_sampling == "random" else self.index.num_captions

    def caption_of(self, item: int) -> int:
        """Caption (pair) row that ``item`` reads on this visit."""
        if self.caption_sampling == "all":
            return item
        start, stop = self.index.starts[item], self.index.starts[item + 1]
        # torch's RNG, seeded per batch by __getitems__ (draws differ across batches and epochs).
        pick = start + int(torch.randint(int(stop - start), ()).item()) if stop - start > 1 else start
        return int(self.index.by_image[pick])

    def lengths(self) -> np.ndarray:
        """Per-item caption length proxy (words) for length-aware batching."""
        if self.caption_sampling == "all":
            return self.index.cap_words
        return self.index.cap_words[self.index.by_image[self.index.starts[:-1]]]

    def load(self, item: int) -> dict[str, Any]:
        """Load one item or raise :class:`RecordError` naming file, line, image and reason."""
        row = self.caption_of(item)
        line = int(self.index.cap_line[row])
        record = self.index.read(line)
        line_no = int(self.index.line_numbers[line])
        self.index.parser.check_confined(record.image, line_no)
        try:
            image = decode_and_transform(record.image, self.transform, self.max_pixels, self.min_side)
        except ImageDecodeError as err:
            raise RecordError(self.index.file, line_no, str(err), record.image) from err
        return {
            "image": image,
            "caption": record.captions[int(self.index.cap_pos[row])],
            "image_id": int(self.index.image_ids[row]),
            "index": item,
        }

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        """Load a whole batch with its random draws (caption choice, crops) seeded by the batch's own indices.

        The DataLoader calls this once per batch, in the main process or in whichever worker gets the batch. A
        seed derived from the (shuffled) index list makes the augmentation a pure function of the batch, so it
        is the same in any worker layout and after a mid-epoch resume -- which worker RNGs seeded at iterator
        creation cannot give (their stream position is not in a checkpoint).
        """
        seed = zlib.crc32(np.asarray(items, dtype=np.int64).tobytes(), self.seed & 0xFFFFFFFF)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [self[item] for item in items]

    def __getitem__(self, item: int) -> dict[str, Any]:
        reasons: list[str] = []
        for attempt in range(self.max_replacements + 1):
            # Replacement walks forward deterministically, so every rank keeps its batch shape.
            candidate = (item + attempt) % len(self)
            try:
                sample = self.load(candidate)
            except RecordError as err:
                if self.on_bad_record == "raise":
                    raise
                reasons.append(str(err))
                continue
            sample["num_skipped"], sample["skip_reasons"] = len(reasons), reasons
            return sample
        raise RuntimeError(
            f"{self.max_replacements + 1} consecutive bad records from item {item} of {self.index.file}; "
            f"first: {reasons[0]}"
        )
