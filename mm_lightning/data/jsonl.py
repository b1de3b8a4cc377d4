"""JSONL source: one ``{"image": <path>, "text": <caption or list>}`` object per line, images as files.
Lines are re-read by byte offsets held in numpy (Python objects' refcounts make forked workers copy pages)."""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass

import numpy as np

from mm_lightning.data.records import (
    Record,
    RecordError,
    record_errors,
    validate_captions,
)
from mm_lightning.data.skips import SkipLog, SkippedRecords


class RecordParser:
    """Parses and validates one JSONL line into a :class:`~mm_lightning.data.records.Record`."""

    def __init__(
        self, file: str, image_key: str, text_key: str, image_root: str, confine_to_root: bool
    ) -> None:
        self.file, self.image_key, self.text_key = file, image_key, text_key
        self.image_root = os.path.abspath(image_root)
        self.confine_to_root = confine_to_root

    @property
    def confine_root(self) -> str | None:
        """The folder every image must stay inside (links resolved at load time), or ``None``."""
        return self.image_root if self.confine_to_root else None

    def parse(self, raw: bytes, line: int) -> Record:
        """Parse one raw line (1-based ``line`` for messages); raises :class:`RecordError` if bad."""
        text = raw.rstrip(b"\r\n")  # the decoder would place an error after the newline on "line 2"
        try:
            with record_errors(self.file, line, "malformed_json", what="malformed JSON"):
                obj = json.loads(text)
        except RecordError as err:
            decode = err.__cause__
            if not isinstance(decode, json.JSONDecodeError):
                raise
            where = "at the end of the line" if decode.pos >= len(decode.doc) else f"at column {decode.colno}"
            raise RecordError(
                # "Unterminated string starting at" + "at column 7": say "at" once
                self.file,
                line,
                f"malformed JSON: {decode.msg.removesuffix(' at')} {where}",
                kind="malformed_json",
            ) from decode
        stub = Record("", [], self.file, line)
        if not isinstance(obj, dict):
            raise stub.error(
                f"malformed JSON: expected an object, got {type(obj).__name__}", "malformed_json"
            )
        for key in (self.image_key, self.text_key):
            if key not in obj:
                keys = sorted(str(k)[:40] for k in obj)[:20]
                raise stub.error(f"missing key {key!r} (keys: {keys})", "missing_key")
        image = obj[self.image_key]
        if not isinstance(image, str) or not image:
            raise stub.error(
                f"must be a non-empty string path, got {_preview(image)}", "bad_field", self.image_key
            )
        path = self.resolve(image, line)
        record = Record(path, [], self.file, line)
        return Record(path, validate_captions(obj[self.text_key], record, self.text_key), self.file, line)

    def resolve(self, image: str, line: int) -> str:
        """``image`` joined onto ``image_root`` and normalized; checks what needs no disk access."""
        with record_errors(self.file, line, "bad_path", image=image, key=self.image_key):
            if "\0" in image:
                raise ValueError("embedded null byte")
            os.fsencode(image)  # lone surrogates: no file system can name them
        path = os.path.normpath(os.path.join(self.image_root, image))
        if self.confine_to_root and os.path.commonpath([path, self.image_root]) != self.image_root:
            raise RecordError(
                self.file,
                line,
                f"image path escapes image_root {self.image_root!r}",
                image,
                kind="path_escapes_root",
                key=self.image_key,
            )
        return path


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _path_hash(path: str) -> int:
    return int.from_bytes(hashlib.blake2b(os.fsencode(path), digest_size=8).digest(), "little", signed=True)


def _first_appearance_ids(keys: np.ndarray) -> np.ndarray:
    """Dense ids numbered in order of first appearance in the file (so ids follow the file order)."""
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]


@dataclass(frozen=True)
class Pair:
    """One (image, caption) pair read back from the file; one ``image_id`` per resolved image path."""

    record: Record
    caption: str
    image_id: int


_WIDE_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def check_utf8(file: str, head: bytes) -> None:
    """Refuses a UTF-16/32 file whatever ``on_bad_record``: split on byte 0x0A, every line would be bad."""
    for bom, name in _WIDE_BOMS:
        if head.startswith(bom):
            raise RecordError(
                file,
                None,
                f"the file is {name} (it starts with a {name} byte-order mark); JSONL must be UTF-8: re-encode it,"
                f" e.g. iconv -f {name} -t UTF-8 {os.path.basename(file)} > utf8.jsonl",
                kind="malformed_json",
            )


class JsonlIndex:
    """Byte offsets of a JSONL file's valid lines, and per pair (caption) ``cap_line`` (valid-line index),
    ``cap_pos`` (place in its list), ``cap_words``, ``image_ids``. ``on_bad_record="skip"`` logs bad lines in
    ``skips``; ``"raise"`` raises on the first."""

    def __init__(self, parser: RecordParser, on_bad_record: str = "raise") -> None:
        self.parser, self.file = parser, parser.file
        self.skips = SkipLog()
        self.skipped = SkippedRecords()  # the same records with every reason, for the stage's report
        self.lines = 0
        offsets, lines, cap_line, cap_pos = array("q"), array("i"), array("i"), array("i")
        hashes, words = array("q"), array("h")
        if not os.path.isfile(self.file):
            raise FileNotFoundError(
                f"{self.file}: no such JSONL file (from the data section: train_file / val_file / test_file); point "
                "it at your records (docs/data.md), or try the recipe on the demo with --config configs/demo_data.yaml"
            )
        with open(self.file, "rb") as f:
            check_utf8(self.file, f.read(4))
            f.seek(0)
            offset, line_no = 0, 0
            for raw in f:
                line_no += 1
                start, offset = offset, offset + len(raw)
                if not raw.strip():
                    continue
                self.lines += 1
                try:
                    rec = parser.parse(raw, line_no)
                except RecordError as err:
                    if on_bad_record == "raise":
                        raise
                    self.skips.add(err, "index")
                    self.skipped.add(err, "index")
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
        self.cap_pos = np.frombuffer(cap_pos, dtype=np.int32).copy()
        self.cap_words = np.frombuffer(words, dtype=np.int16).copy()
        self.image_ids = _first_appearance_ids(np.frombuffer(hashes, dtype=np.int64))
        # Pairs grouped by image: image i owns by_image[starts[i]:starts[i + 1]].
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

    def pairs_of_image(self, image: int) -> np.ndarray:
        """Pair rows holding ``image``'s captions."""
        return self.by_image[self.starts[image] : self.starts[image + 1]]

    def first_pair_of_images(self) -> np.ndarray:
        """One pair row per image (its first caption), in image-id order."""
        return self.by_image[self.starts[:-1]]

    def read(self, valid_line: int) -> Record:
        """Re-read and parse one valid line (file handle opened lazily once per process)."""
        if self._pid != os.getpid():  # forked/spawned workers must not share a file position
            self._fh, self._pid = open(self.file, "rb"), os.getpid()
        self._fh.seek(int(self.offsets[valid_line]))
        return self.parser.parse(self._fh.readline(), int(self.line_numbers[valid_line]))

    def pair(self, row: int) -> Pair:
        """Read pair ``row`` back: its record, caption and image id."""
        record = self.read(int(self.cap_line[row]))
        return Pair(record, record.captions[int(self.cap_pos[row])], int(self.image_ids[row]))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_fh"], state["_pid"] = None, -1
        return state
