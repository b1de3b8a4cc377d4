"""JSONL index: one object per line, kept as byte offsets and numpy arrays, never as a list of dicts.

Python objects in a list are touched (ref-counted) on every access, so forked DataLoader workers copy the
pages holding them and their RSS grows over an epoch; a handful of numpy arrays are single objects whose
data pages are only read. Lines are re-read from the file by offset when a sample is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field

import numpy as np


class RecordError(ValueError):
    """A bad record. The message names the JSONL file, the line number, the image path (if known) and why."""

    def __init__(self, file: str, line: int, reason: str, image: str | None = None) -> None:
        self.file, self.line, self.reason, self.image = file, line, reason, image
        where = f"{file}:{line}" + (f" (image {image!r})" if image is not None else "")
        super().__init__(f"{where}: {reason}")


@dataclass
class SkipLog:
    """Counts skipped records and keeps the first reasons (never silent, never unbounded)."""

    count: int = 0
    first: list[str] = field(default_factory=list)
    keep: int = 20

    def add(self, err: RecordError) -> None:
        self.count += 1
        if len(self.first) < self.keep:
            self.first.append(str(err))


@dataclass(frozen=True)
class Record:
    """One parsed line: resolved image path and its captions."""

    image: str
    captions: list[str]


class RecordParser:
    """Parses and validates one JSONL line into a :class:`Record`.

    Args:
        file: the JSONL file (for messages).
        image_key: key of the image path.
        text_key: key of the caption (a string or a list of strings).
        image_root: folder relative image paths are resolved against.
        confine_to_root: reject image paths (absolute, ``..`` or symlinks) that leave ``image_root``.
    """

    def __init__(
        self, file: str, image_key: str, text_key: str, image_root: str, confine_to_root: bool
    ) -> None:
        self.file, self.image_key, self.text_key = file, image_key, text_key
        self.image_root = os.path.abspath(image_root)
        self.confine_to_root = confine_to_root

    def parse(self, raw: bytes, line: int) -> Record:
        """Parse one raw line (1-based ``line`` for messages).

        Raises:
            RecordError: malformed JSON, missing key, bad caption or a path escaping the root.
        """
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RecordError(self.file, line, f"malformed JSON ({err})") from err
        if not isinstance(obj, dict):
            raise RecordError(self.file, line, f"expected a JSON object, got {type(obj).__name__}")
        for key in (self.image_key, self.text_key):
            if key not in obj:
                raise RecordError(self.file, line, f"missing key {key!r} (keys: {sorted(obj)})")
        image = obj[self.image_key]
        if not isinstance(image, str) or not image:
            raise RecordError(
                self.file, line, f"{self.image_key!r} must be a non-empty string path, got {image!r}"
            )
        return Record(self.resolve(image, line), self._captions(obj[self.text_key], line, image))

    def resolve(self, image: str, line: int) -> str:
        path = os.path.normpath(os.path.join(self.image_root, image))
        if self.confine_to_root and os.path.commonpath([path, self.image_root]) != self.image_root:
            raise RecordError(self.file, line, f"image path escapes image_root {self.image_root!r}", image)
        return path

    def check_confined(self, path: str, line: int) -> None:
        """At load time: also catch symlinks that leave the root (normpath alone cannot see them)."""
        if self.confine_to_root:
            real, root = os.path.realpath(path), os.path.realpath(self.image_root)
            if os.path.commonpath([real, root]) != root:
                raise RecordError(
                    self.file, line, f"image path escapes image_root {root!r} (via a link)", path
                )

    def _captions(self, value: object, line: int, image: str) -> list[str]:
        captions = value if isinstance(value, list) else [value]
        if not captions:
            raise RecordError(self.file, line, f"{self.text_key!r} is an empty list", image)
        for cap in captions:
            if not isinstance(cap, str):
                raise RecordError(
                    self.file, line, f"caption must be a string, got {type(cap).__name__}", image
                )
            if not cap.strip():
                raise RecordError(self.file, line, "caption is empty", image)
        return captions


def _path_hash(path: str) -> int:
    return int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little", signed=True)


def _first_appearance_ids(keys: np.ndarray) -> np.ndarray:
    """Dense ids numbered in order of first appearance in the file (so ids follow the file order)."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]


class JsonlIndex:
    """Byte offsets of the valid lines of a JSONL file plus per-caption arrays.

    Attributes:
        offsets: int64 byte offset of each valid line.
        line_numbers: int32 1-based line number of each valid line (for messages).
        cap_line: int32 valid-line index of each caption ("pair" = one caption of one line).
        cap_pos: int16 position of that caption inside its line's caption list.
        cap_words: int16 whitespace word count of each caption (a cheap length proxy for batching).
        image_ids: int64 dense image id of each caption; the same resolved path gives the same id, also
            across lines.
        skips: invalid lines dropped under ``on_bad_record="skip"``.

    Args:
        parser: validates each line.
        on_bad_record: ``"raise"`` raises :class:`RecordError` on the first bad line; ``"skip"`` drops and
            counts it.
    """

    def __init__(self, parser: RecordParser, on_bad_record: str = "raise") -> None:
        self.parser, self.file = parser, parser.file
        self.skips = SkipLog()
        offsets, lines, cap_line, cap_pos = array("q"), array("i"), array("i"), array("h")
        hashes, words = array("q"), array("h")
        with open(self.file, "rb") as f:
            offset, line_no = 0, 0
            for raw in f:
                line_no += 1
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                try:
                    rec = parser.parse(raw, line_no)
                except RecordError as err:
                    if on_bad_record == "raise":
                        raise
                    self.skips.add(err)
                    continue
                h = _path_hash(rec.image)
                for pos, caption in enumerate(rec.captions):
                    cap_line.append(len(offsets))
                    cap_pos.append(pos)
                    hashes.append(h)
                    words.append(min(len(caption.split()), 32767))
                offsets.append(start)
                lines.append(line_no)
        self.offsets = np.frombuffer(offsets, dtype=np.int64).copy()
        self.line_numbers = np.frombuffer(lines, dtype=np.int32).copy()
        self.cap_line = np.frombuffer(cap_line, dtype=np.int32).copy()
        self.cap_pos = np.frombuffer(cap_pos, dtype=np.int16).copy()
        self.cap_words = np.frombuffer(words, dtype=np.int16).copy()
        self.image_ids = _first_appearance_ids(np.frombuffer(hashes, dtype=np.int64))
        # Captions grouped by image: image i owns by_image[starts[i]:starts[i + 1]].
        self.by_image = np.argsort(self.image_ids, kind="stable").astype(np.int32)
        self.starts = np.searchsorted(self.image_ids[self.by_image], np.arange(self.num_images + 1)).astype(
            np.int64
        )
        self._fh: object = None
        self._pid = -1

    @property
    def num_images(self) -> int:
        return int(self.image_ids.max()) + 1 if len(self.image_ids) else 0

    @property
    def num_captions(self) -> int:
        return len(self.cap_line)

    def read(self, valid_line: int) -> Record:
        """Re-read and parse one valid line (file handle opened lazily once per process)."""
        if self._pid != os.getpid():  # forked/spawned workers must not share a file position
            self._fh, self._pid = open(self.file, "rb"), os.getpid()
        self._fh.seek(int(self.offsets[valid_line]))
        return self.parser.parse(self._fh.readline(), int(self.line_numbers[valid_line]))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fh"], state["_pid"] = None, -1
        return state
