"""Skip accounting under ``on_bad_record="skip"``: the one place that counts skipped records.

A record is counted once where it is found bad: lines dropped while indexing by the index's log, bad images
by the sample that replaced them (``sample["skipped"]``, a list of :class:`RecordError`). DataLoader workers
are separate processes, so those errors travel inside the batch (``batch["skipped"]``) to the main process,
where :class:`~mm_lightning.callbacks.bad_records.BadRecordLogger` adds them to a :class:`SkipLog`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from mm_lightning.data.records import ERROR_KINDS, RecordError

SKIPPED_KEY = "skipped"  # sample/batch field: list of RecordError for the bad records a sample stands in for
# sample field True / batch field (B,) bool: the row is a copy of another valid record standing in for a bad one
# (map-style sources); evaluation leaves such rows out of every metric
STAND_IN_KEY = "stand_in"
SPLITS = ("train", "val", "test", "predict")


@dataclass
class SkipLog:
    """Counts skipped records by split and kind, and keeps the first reasons (never silent, never unbounded).

    Args:
        keep: how many reasons to keep.
    """

    keep: int = 20
    counts: Counter = field(default_factory=Counter)  # (split, kind) -> count
    first: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def by_kind(self) -> dict[str, int]:
        out: Counter = Counter()
        for (_, kind), n in self.counts.items():
            out[kind] += n
        return {k: out[k] for k in ERROR_KINDS if out[k]}

    def by_split(self) -> dict[str, int]:
        out: Counter = Counter()
        for (split, _), n in self.counts.items():
            out[split] += n
        return {s: out[s] for s in SPLITS if out[s]}

    def add(self, err: RecordError, split: str = "train") -> None:
        self.counts[(split, err.kind)] += 1
        self._keep(str(err))

    def update(self, other: SkipLog, split: str | None = None) -> None:
        """Add ``other``'s counts (relabelled to ``split`` if given) and its first reasons."""
        for (own_split, kind), n in other.counts.items():
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
        table = [[self.counts[(s, k)] for k in ERROR_KINDS] for s in SPLITS]
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
