"""Records of every source (JSONL, shards); any failure becomes a :class:`RecordError`, raised or counted; the
errors of a split without a valid record or without one training batch."""

from __future__ import annotations

import itertools
import os
import unicodedata
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

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
SPLITS = ("train", "val", "test", "predict")
_UNNAMED = itertools.count()  # keys of errors that name no line or sample


@dataclass
class SkipLog:
    """Counts skipped records by split and kind, and keeps the first ``keep`` reasons (bounded).

    ``pending`` holds the records met in the current pass of each split (an epoch, a validation, test or
    predict run), so a record met again in that pass (another caption of a bad image) is counted once;
    :meth:`end_pass` folds them into ``counts``."""

    keep: int = 20
    counts: Counter = field(default_factory=Counter)  # (split, kind) -> count, of passes ended
    pending: dict = field(default_factory=dict)  # split -> {(file, line or sample): kind}
    first: list[str] = field(default_factory=list)

    def totals(self) -> Counter:
        out = Counter(self.counts)
        for split, found in self.pending.items():
            out.update((split, kind) for kind in found.values())
        return out

    @property
    def count(self) -> int:
        return sum(self.totals().values())

    def _by(self, part: int, order: tuple[str, ...]) -> dict[str, int]:
        out: Counter = Counter()
        for key, n in self.totals().items():
            out[key[part]] += n
        return {k: out[k] for k in order if out[k]}

    def by_kind(self) -> dict[str, int]:
        return self._by(1, ERROR_KINDS)

    def by_split(self) -> dict[str, int]:
        return self._by(0, SPLITS)

    def add(self, err: RecordError, split: str = "train") -> None:
        found = self.pending.setdefault(split, {})
        # an error naming no line or sample is its own record
        unnamed = ("unnamed", os.getpid(), next(_UNNAMED))
        for where in err.lines or (err.sample if err.sample is not None else unnamed,):
            found.setdefault((err.file, where), err.kind)
        self._keep(str(err))

    def end_pass(self, split: str, every_rank: list[dict] | None = None) -> None:
        """Count the pass's records once, joined with the other ranks' ``pending[split]`` if given."""
        joined: dict = {}
        for found in every_rank if every_rank is not None else [self.pending.get(split, {})]:
            joined.update(found)
        self.counts.update((split, kind) for kind in joined.values())
        self.pending.pop(split, None)

    def update(self, other: SkipLog, split: str | None = None) -> None:
        """Add ``other``'s counts (relabelled to ``split`` if given) and its first reasons."""
        for (own_split, kind), n in other.totals().items():
            self.counts[(split or own_split, kind)] += n
        for reason in other.first:
            self._keep(reason)

    def add_batch(self, batch: Any, split: str) -> None:
        """Count the records a batch's samples stand in for."""
        if isinstance(batch, dict):
            for err in batch.get(SKIPPED_KEY, ()):
                self.add(err, split)

    def _keep(self, reason: str) -> None:
        if len(self.first) < self.keep and reason not in self.first:
            self.first.append(reason)

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Counts as a (splits x kinds) tensor, for a cross-rank sum."""
        totals = self.totals()
        table = [[totals[(s, k)] for k in ERROR_KINDS] for s in SPLITS]
        return torch.tensor(table, dtype=torch.long, device=device)

    @classmethod
    def from_tensor(cls, table: torch.Tensor, first: list[str], keep: int = 20) -> SkipLog:
        log = cls(keep=keep, first=list(first))
        for i, split in enumerate(SPLITS):
            for j, kind in enumerate(ERROR_KINDS):
                if int(table[i, j]):
                    log.counts[(split, kind)] = int(table[i, j])
        return log

    def summary(self) -> str:
        """Multi-line text: total, per split, per kind, first reasons."""
        splits = ", ".join(f"{s} {n}" for s, n in self.by_split().items())
        kinds = ", ".join(f"{k} {n}" for k, n in self.by_kind().items())
        head = f"{self.count} bad records skipped ({splits}; by kind: {kinds})."
        return head + " First reasons:\n" + "\n".join(f"- {r}" for r in self.first)


@dataclass
class SkippedRecords:
    """The distinct records each split skipped, whichever pass met them: ``(file, line or sample) -> (kind,
    reason)``. A record met again (another caption of a bad image, another epoch) counts once; the reasons of
    the first ``keep_reasons`` records of a split are kept (the kinds of all)."""

    keep_reasons: int = 10_000
    found: dict = field(default_factory=dict)  # split -> {(file, line or sample): (kind, reason or None)}

    def add(self, err: RecordError, split: str) -> None:
        records = self.found.setdefault(split, {})
        for where in err.lines or (err.sample if err.sample is not None else f"#{id(err)}",):
            if (err.file, where) not in records:
                records[(err.file, where)] = (
                    err.kind,
                    str(err) if len(records) < self.keep_reasons else None,
                )

    def add_batch(self, batch: Any, split: str) -> None:
        """The records a batch's samples stand in for."""
        if isinstance(batch, dict):
            for err in batch.get(SKIPPED_KEY, ()):
                self.add(err, split)

    def join(self, split: str, found: list[dict]) -> None:
        """Add other processes' records of ``split`` (their ``found[split]``)."""
        records = self.found.setdefault(split, {})
        for other in found:
            for key, value in other.items():
                records.setdefault(key, value)

    def report(self, split: str) -> dict[str, Any]:
        """One split's skipped records: ``count``, ``by_kind``, ``records`` (``file:line`` or ``file:sample``) and
        ``reasons`` (as far as kept), in file order."""
        records = self.found.get(split, {})
        kinds = Counter(kind for kind, _ in records.values())
        ordered = sorted(records.items(), key=lambda item: (item[0][0], str(item[0][1]).zfill(12)))
        return {
            "count": len(records),
            "by_kind": {kind: kinds[kind] for kind in ERROR_KINDS if kinds[kind]},
            "records": [f"{file}:{where}" for (file, where), _ in ordered],
            "reasons": [reason for _, (_, reason) in ordered if reason is not None],
        }

    def summary(self, splits: tuple[str, ...], first: int = 5) -> str:
        """How many records ``splits`` skipped, by split and by kind, and each split's ``first`` reasons; ``""``
        if none."""
        reports = {split: self.report(split) for split in splits}
        reports = {split: report for split, report in reports.items() if report["count"]}
        if not reports:
            return ""
        kinds: Counter = Counter()
        for report in reports.values():
            kinds.update(report["by_kind"])
        counts = ", ".join(f"{split} {report['count']}" for split, report in reports.items())
        by_kind = ", ".join(f"{kind} {kinds[kind]}" for kind in ERROR_KINDS if kinds[kind])
        total = sum(report["count"] for report in reports.values())
        reasons = [f"- {reason}" for report in reports.values() for reason in report["reasons"][:first]]
        return f"{total} bad records skipped ({counts}; by kind: {by_kind}). First reasons:\n" + "\n".join(
            reasons
        )


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
