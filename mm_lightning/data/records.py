"""Records of every source (JSONL, shards); any failure becomes a :class:`RecordError`, raised or counted
(:mod:`~mm_lightning.data.skips`); the errors of a split without a valid record or without one training batch."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from mm_lightning import ExplainedError

ErrorKind = Literal[
    "malformed_json",  # not JSON, not an object, nested too deep, a number too long, undecodable bytes
    "missing_key",  # the image or text key is absent
    "bad_field",  # the image field is not a non-empty string
    "empty_caption",  # an empty list, or a caption without a visible character
    "bad_caption",  # a caption that is not a string or not encodable text
    "path_escapes_root",  # under confine_to_root: absolute, ``..`` or a link leaving image_root
    "bad_path",  # a path no file system accepts (NUL byte, lone surrogate) or not a regular file
    "missing_image",  # no file at the path
    "undecodable_image",  # empty, truncated, not an image, too many pixels, extreme shape
]
ERROR_KINDS: tuple[str, ...] = ErrorKind.__args__  # type: ignore[attr-defined]
# the kinds that are about the image, not the record: every record naming that image is bad
IMAGE_KINDS = ("path_escapes_root", "bad_path", "missing_image", "undecodable_image")


class RecordError(ExplainedError, ValueError):
    """A bad record; the message names the file, the line (or shard sample), the field, the image and why.
    ``kind`` is one of :data:`ERROR_KINDS` (reports group by it)."""

    def __init__(
        self,
        file: str,
        line: int | None,
        reason: str,
        image: str | None = None,
        *,
        kind: ErrorKind = "undecodable_image",
        key: str | None = None,
        sample: str | None = None,
        lines: tuple[int, ...] | None = None,
    ) -> None:
        self.file, self.line, self.reason, self.image = file, line, reason, image
        self.kind, self.key, self.sample = kind, key, sample
        # the lines of every record it makes bad: a bad image is bad for each record that names it
        self.lines = lines if lines is not None else (() if line is None else (line,))
        where = file + (f":{line}" if line is not None else "") + (f" [sample {sample}]" if sample else "")
        where += f" (key {key!r})" if key is not None else ""
        where += f" (image {image!r})" if image is not None else ""
        super().__init__(f"{where}: {reason}")

    def __reduce__(self) -> tuple:
        # Errors travel from DataLoader workers inside batches; keep every field through pickling.
        kwargs = {"kind": self.kind, "key": self.key, "sample": self.sample, "lines": self.lines}
        return _rebuild_error, (self.file, self.line, self.reason, self.image, kwargs)


def _rebuild_error(file: str, line: int | None, reason: str, image: str | None, kwargs: dict) -> RecordError:
    return RecordError(file, line, reason, image, **kwargs)


@dataclass(frozen=True)
class Record:
    """One image (a resolved path, or encoded bytes from shards) with its captions and where it came from."""

    image: str | bytes
    captions: list[str]
    file: str = "<memory>"
    line: int | None = None
    sample: str | None = None
    image_name: str | None = None

    @property
    def image_label(self) -> str | None:
        if isinstance(self.image, str):
            return self.image or None  # not known yet (a record rejected before its image field is read)
        return self.image_name

    def error(self, reason: str, kind: ErrorKind, key: str | None = None) -> RecordError:
        """A :class:`RecordError` about this record."""
        return RecordError(
            self.file, self.line, reason, self.image_label, kind=kind, key=key, sample=self.sample
        )


FATAL = (MemoryError,)  # never one record's fault: stop the run rather than skip a record


def describe(err: BaseException) -> str:
    """``"ValueError: embedded null byte"``: the type says more than the message alone (RecursionError...)."""
    text = str(err).splitlines()[0][:300] if str(err) else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


@contextmanager
def record_errors(
    file: str,
    line: int | None,
    kind: ErrorKind,
    *,
    image: str | None = None,
    key: str | None = None,
    sample: str | None = None,
    what: str = "",
) -> Iterator[None]:
    """Turn an ``Exception`` in the block into a :class:`RecordError` of ``kind`` (not ``MemoryError``)."""
    try:
        yield
    except (RecordError, *FATAL):
        raise
    except Exception as err:
        reason = f"{what} ({describe(err)})" if what else describe(err)
        raise RecordError(file, line, reason, image, kind=kind, key=key, sample=sample) from err


def _has_visible_character(text: str) -> bool:
    # Control, format (zero-width space, BOM, bidi marks) and separator characters alone tokenize to nothing.
    return any(not (ch.isspace() or unicodedata.category(ch)[0] in "CZ") for ch in text)


def validate_captions(value: object, record: Record, key: str) -> list[str]:
    """The caption list of ``value`` (a string or a list of strings); raises :class:`RecordError` if bad."""
    captions = value if isinstance(value, list) else [value]
    if not captions:
        raise record.error("the caption list is empty", "empty_caption", key)
    for pos, cap in enumerate(captions):
        at = f"caption {pos}" if len(captions) > 1 else "caption"
        if not isinstance(cap, str):
            raise record.error(f"{at} must be a string, got {type(cap).__name__}", "bad_caption", key)
        try:
            cap.encode("utf-8")
        except UnicodeEncodeError as err:  # lone surrogates ("\ud800" in JSON) break every tokenizer
            raise record.error(f"{at} is not valid text ({describe(err)})", "bad_caption", key) from err
        if not _has_visible_character(cap):
            raise record.error(f"{at} is empty (no visible character)", "empty_caption", key)
    return captions


SKIPPED_KEY = "skipped"  # sample/batch field: list of RecordError for the bad records a sample stands in for
# sample field True / batch (B,) bool: a valid record's copy standing in for a bad one; metrics leave it out
STAND_IN_KEY = "stand_in"


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

    def __init__(self, label: str, index: Any) -> None:  # a JsonlIndex
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
