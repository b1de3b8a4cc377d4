"""Record -> sample, and the bad-record policy; shared by every source (JSONL index, shards) and the audit.

:class:`SampleBuilder` turns a :class:`~mm_lightning.data.records.Record` into the sample the collate expects
(``image`` uint8 (3, H, W) after the transform, ``caption``, ``image_id``, ``index``); any failure on the way
(a link leaving the root, a missing file, an HTML page saved as ``.jpg``, a transform error) is a
:class:`~mm_lightning.data.records.RecordError`. :class:`BadRecordPolicy` decides what a bad record costs:
``raise`` stops, ``skip`` puts a valid sample in its place and records the error in ``sample["skipped"]``:

- map-style sources (:meth:`BadRecordPolicy.load_batch`): the replacement is drawn pseudo-randomly from the
  whole dataset, seeded by the bad item, avoiding items already in the batch, so a run of bad records does not
  turn into copies of its valid neighbour, and every rank and resume draws the same one;
- streams (:meth:`BadRecordPolicy.iter_valid`): the next valid record carries the errors of the bad ones
  before it.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch

from mm_lightning.data.images import DEFAULT_MAX_PIXELS, ImageDecodeError, decode_image_file
from mm_lightning.data.records import SKIPPED_KEY, STAND_IN_KEY, Record, RecordError, record_errors
from mm_lightning.data.transforms import DecodeResizedCrop
from mm_lightning.errors import ExplainedError
from mm_lightning.seeding import derived_rng

ORIGIN_KEY = (
    "origin"  # sample field: where the record came from (file, line), for errors found in the collate
)

OnBadRecord = Literal["raise", "skip"]
# A 1 x 10,000,000 strip passes a pixel-count guard, but resizing its short side to 224 px for evaluation
# would need ~20 GB; no caption-worthy photo is this elongated.
MAX_ASPECT_RATIO = 100.0


class SampleBuilder:
    """Checks, decodes and transforms the image of a record; every failure is a ``RecordError``.

    Args:
        transform: uint8 (3, H, W) -> uint8 (3, S, S) image transform.
        max_pixels: decompression-bomb guard (see :func:`~mm_lightning.data.images.decode_image_file`).
        min_side: allow reduced-size JPEG decoding down to this shorter side (``None``: full size).
        confine_root: reject files whose real path (links resolved) leaves this folder; ``None``: no check.
        decode_bytes: decoder for records whose image is encoded bytes (sources without files).

    ``features``, when set (by :class:`~mm_lightning.callbacks.LockedImageFeatures`), serves a record's cached
    image features (a :class:`~mm_lightning.data.features.CachedFeatures`) in place of its decoded image.
    """

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
        self.features: Callable[[Record], torch.Tensor] | None = None

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
            if not stat.S_ISREG(mode):
                # A directory, FIFO or device: a FIFO would block the reader forever.
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
        if self.features is not None:
            if isinstance(record.image, str):
                self.check_file(record)
            image = self.features(record)
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
    """What a bad record costs: ``raise``, or ``skip`` (a valid sample stands in; the error is recorded).

    Args:
        on_bad_record: ``"raise"`` or ``"skip"``.
        max_replacements: under ``"skip"``, give up after this many bad candidates for one replacement.
        seed: seed of the replacement draws (the same on every rank, every run with this seed).
    """

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

    def load_batch(self, items: list[int], load: Callable[[int], dict[str, Any]], size: int) -> list[dict]:
        """Load ``items`` of a map-style dataset of ``size`` items; bad ones raise or are replaced.

        A bad item is counted once, in the sample that replaces it. Its replacement is drawn from a generator
        seeded by ``(seed, item)``, skipping items already in this batch while others are left, and carries
        its own ``index`` (evaluation drops rows whose index it has already seen).
        """
        taken = set(items)
        out = []
        for item in items:
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
            "may be unreadable: check it with `python -m mm_lightning audit`, or raise --data.max_replacements."
        ) from err

    def iter_valid(
        self, records: Iterable[Any], build: Callable[[Any], dict[str, Any]]
    ) -> Iterator[dict[str, Any]]:
        """For streams: yield ``build(r)`` for each record; bad ones raise or ride along with the next sample."""
        pending: list[RecordError] = []
        for record in records:
            try:
                sample = build(record)
            except RecordError as err:
                if self.on_bad_record == "raise":
                    raise
                pending.append(err)
                if len(pending) > self.max_replacements:
                    raise TooManyBadRecords(
                        f"{len(pending)} bad records in a row; first: {pending[0]}; last: {err}"
                    ) from err
                continue
            sample[SKIPPED_KEY] = [*sample.get(SKIPPED_KEY, ()), *pending]
            pending = []
            yield sample
        if pending:
            warnings.warn(
                f"{len(pending)} bad records at the end of the stream had no valid sample to carry them and are "
                f"not in data/skipped; first: {pending[0]}",
                stacklevel=2,
            )
