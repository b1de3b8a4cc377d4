"""Bad-record accounting: the records each split skipped under ``on_bad_record: skip``, counted once per record
(:class:`SkippedRecords`, the data module's report at a stage's end) or once per pass (:class:`SkipLog`, what
``data/skipped`` logs and the audit reports)."""

from __future__ import annotations

import itertools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from mm_lightning.data.records import ERROR_KINDS, SKIPPED_KEY, RecordError

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
