"""Record -> sample, the bad-record policy (shared by every source: JSONL index, shards, and the audit), and the
map-style dataset of one JSONL file, :class:`ImageTextDataset` (index -> sample)."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from mm_lightning import ExplainedError
from mm_lightning.data.config import CaptionSampling
from mm_lightning.data.images import DEFAULT_MAX_PIXELS, ImageDecodeError, decode_image_file
from mm_lightning.data.jsonl import JsonlIndex
from mm_lightning.data.order import draw_seeds
from mm_lightning.data.records import (
    IMAGE_KINDS,
    SKIPPED_KEY,
    STAND_IN_KEY,
    Record,
    RecordError,
    record_errors,
)
from mm_lightning.data.seeding import derived_rng, global_seed
from mm_lightning.data.transforms import DecodeResizedCrop

ORIGIN_KEY = "origin"  # sample field: where the record came from, for errors found in the collate

OnBadRecord = Literal["raise", "skip"]
# A 1 x 10,000,000 strip passes the pixel guard but would need ~20 GB to resize; no photo is this elongated.
MAX_ASPECT_RATIO = 100.0


class SampleBuilder:
    """Checks, decodes, transforms a record's image or raises ``RecordError``; ``features`` may replace it."""

    def __init__(
        self,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        min_side: int | None = None,
        confine_root: str | None = None,
        decode_bytes: Callable[[bytes], torch.Tensor] | None = None,
    ) -> None:
        self.transform, self.max_pixels, self.min_side = transform, max_pixels, min_side
        self.confine_root = os.path.realpath(confine_root) if confine_root is not None else None
        self.decode_bytes = decode_bytes
        # a record's image given by a callable instead of decoded: precomputed (D,) image-tower features
        self.image_source: Callable[[Record], torch.Tensor] | None = None

    def check_file(self, record: Record) -> None:
        """The image path names a regular file inside the root (links resolved)."""
        path = str(record.image)
        with record_errors(record.file, record.line, "bad_path", image=path, sample=record.sample):
            if self.confine_root is not None:
                real = os.path.realpath(path)
                if os.path.commonpath([real, self.confine_root]) != self.confine_root:
                    raise record.error(f"image path escapes image_root {self.confine_root!r} (via a link)",
                                       "path_escapes_root")  # fmt: skip
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError as err:
                raise record.error(f"image file not found ({err.strerror})", "missing_image") from err
            if not stat.S_ISREG(mode):  # a FIFO would block the reader forever
                raise record.error("image path is not a regular file", "bad_path")

    def decode(self, record: Record, min_side: int | None = None) -> torch.Tensor:
        """The record's image as RGB uint8 (3, H, W), or a ``RecordError``."""
        if isinstance(record.image, str):
            self.check_file(record)
        with record_errors(record.file, record.line, "undecodable_image", image=record.image_label,
                           sample=record.sample):  # fmt: skip
            if isinstance(record.image, str):
                try:
                    image = decode_image_file(record.image, max_pixels=self.max_pixels, min_side=min_side)
                except ImageDecodeError as err:  # already a sentence for users
                    raise record.error(str(err), "undecodable_image") from err
            elif self.decode_bytes is not None:
                image = self.decode_bytes(record.image)
            else:
                raise TypeError("this source gives image bytes but no bytes decoder was configured")
        height, width = image.shape[-2:]
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise record.error(
                f"image is {width}x{height}: aspect ratio above {MAX_ASPECT_RATIO:g}", "undecodable_image"
            )
        return image

    def __call__(self, record: Record, caption: str, image_id: int, index: int) -> dict[str, Any]:
        """The sample of one (image, caption) pair of ``record``."""
        if self.image_source is not None:
            if isinstance(record.image, str):
                self.check_file(record)
            image = self.image_source(record)
        elif isinstance(self.transform, DecodeResizedCrop):
            image = self.decode_cropped(record)
        else:
            image = self.apply_transform(record, self.decode(record, self.min_side))
        sample = {"image": image, "caption": caption, "image_id": image_id, "index": index, SKIPPED_KEY: []}
        sample[ORIGIN_KEY] = (record.file, record.line, record.sample, record.image_label)
        return sample

    def decode_cropped(self, record: Record) -> torch.Tensor:
        """Crop drawn from the header, then a DCT-scaled decode of what the crop needs (path or bytes)."""
        if isinstance(record.image, str):
            self.check_file(record)
        with record_errors(record.file, record.line, "undecodable_image", image=record.image_label,
                           sample=record.sample):  # fmt: skip
            try:
                return self.transform(record.image, max_aspect_ratio=MAX_ASPECT_RATIO)
            except ImageDecodeError as err:  # already a sentence for users
                raise record.error(str(err), "undecodable_image") from err

    def apply_transform(self, record: Record, image: torch.Tensor) -> torch.Tensor:
        """The transformed image, or a ``RecordError`` if the transform fails on it."""
        if self.transform is None:
            return image
        with record_errors(record.file, record.line, "undecodable_image", image=record.image_label,
                           sample=record.sample, what="image transform failed"):  # fmt: skip
            return self.transform(image)


class TooManyBadRecords(ExplainedError, RuntimeError):
    """``skip`` found no valid record to stand in for a bad one within ``max_replacements`` tries."""


class BadRecordPolicy:
    """Bad record: ``raise``, or ``skip`` (a valid sample drawn by ``seed``, same on all ranks, stands in)."""

    def __init__(
        self, on_bad_record: OnBadRecord = "raise", max_replacements: int = 64, seed: int = 0
    ) -> None:
        if on_bad_record not in ("raise", "skip"):
            raise ValueError(f"on_bad_record must be 'raise' or 'skip', got {on_bad_record!r}")
        if max_replacements < 0:
            raise ValueError(f"max_replacements must be >= 0, got {max_replacements}")
        self.on_bad_record, self.max_replacements, self.seed = on_bad_record, max_replacements, seed

    def load(self, item: int, load: Callable[[int], dict[str, Any]], size: int) -> dict[str, Any]:
        """One item, or a replacement for it (see :meth:`load_batch`)."""
        return self.load_batch([item], load, size)[0]

    def load_batch(
        self,
        items: list[int],
        load: Callable[[int], dict[str, Any]],
        size: int,
        draw_seeds: list[int] | None = None,
    ) -> list[dict]:
        """Load ``items`` of a map-style dataset of ``size``; bad ones raise or are replaced by a draw seeded
        by ``(seed, item)`` that avoids this batch's items and keeps its own ``index``. ``draw_seeds``: torch's
        generator is seeded with the item's before it loads (its replacement's draws follow on)."""
        taken = set(items)
        out = []
        for n, item in enumerate(items):
            if draw_seeds is not None:
                # the CPU generator alone: torch.manual_seed also queues CUDA's lazy seeding, a stack trace a call
                torch.default_generator.manual_seed(draw_seeds[n])
            try:
                out.append(load(item))
            except RecordError as err:
                if self.on_bad_record == "raise":
                    raise
                sample = self._replace(item, err, load, size, taken)
                taken.add(sample["index"])
                out.append(sample)
        return out

    def _replace(
        self, item: int, err: RecordError, load: Callable[[int], dict[str, Any]], size: int, taken: set[int]
    ) -> dict[str, Any]:
        rng = derived_rng(self.seed, item)
        tried: list[RecordError] = []
        draws = 0
        # Items already in the batch are avoided while the dataset has others (bounded extra draws).
        while (
            len(tried) < self.max_replacements
            and size > 1
            and draws < 4 * (self.max_replacements + len(taken))
        ):
            draws += 1
            candidate = int(rng.integers(size))
            if candidate == item or (candidate in taken and len(taken) < size):
                continue
            try:
                sample = load(candidate)
            except RecordError as bad:
                tried.append(bad)
                continue
            sample[SKIPPED_KEY] = [err]
            sample[STAND_IN_KEY] = True
            return sample
        last = f"; last candidate: {tried[-1]}" if tried else ""
        raise TooManyBadRecords(
            f"{err}\nNo valid record found to replace it ({len(tried)} bad candidates{last}). Most of the data "
            "may be unreadable: check it with `python -m mm_lightning audit`, or raise --data.loader.max_replacements."
        ) from err


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
        # torch's RNG, seeded per visit by __getitems__ (draws differ across epochs).
        return int(rows[int(torch.randint(len(rows), ()).item())]) if len(rows) > 1 else int(rows[0])

    def image_records(self) -> list[Any]:
        """One record per distinct image (its first pair), in index order."""
        return [self.index.pair(int(row)).record for row in self.index.first_pair_of_images()]

    def replace_images(self, source: Any) -> None:
        """Give each record's image by ``source(record)`` instead of decoding it: the image tower's precomputed
        (D,) pooled features, which the network takes in place of pixels (files are still checked)."""
        self.builder.image_source = source

    def load(self, item: int) -> dict[str, Any]:
        """Load one item or raise :class:`~mm_lightning.data.records.RecordError`."""
        pair = self.index.pair(self.caption_of(item))
        try:
            return self.builder(pair.record, pair.caption, pair.image_id, item)
        except RecordError as err:
            if err.kind in IMAGE_KINDS:  # bad for every record that names the image
                lines = self.index.line_numbers[self.index.cap_line[self.index.pairs_of_image(pair.image_id)]]
                err.lines = tuple(sorted({int(n) for n in lines}))
            raise

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        """Load a batch; each sample's draws (caption, crop, flip) seeded by its visit (:class:`Visit`), so a
        sample is the same whichever rank or worker reads it, and after a resume."""
        with torch.random.fork_rng(devices=[]):
            seeds = draw_seeds(self.seed, items)
            return self.policy.load_batch([int(i) for i in items], self.load, len(self), seeds)

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.__getitems__([item])[0]
