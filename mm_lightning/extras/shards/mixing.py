"""Epoch streams over shards and weighted source mixtures, read by any number of ranks.

An epoch's stream is planned from ``(seed, epoch)`` alone, identically on every rank and for any world size:

1. Each source contributes ``round(weight * size)`` items (``weight`` 2 = every item twice, 0.5 = half of it,
   a different half each epoch). With ``epoch_samples`` set, the weights are shares of that fixed total.
2. A source's items form a stream of whole shards in a shuffled shard order (repeated with a new order for
   weights above 1), whose items are shuffled ``shuffle_shards`` consecutive shards at a time (locality: a few
   shards open at once).
3. The sources' streams are interleaved at random with exact per-source counts.

Ranks read the stream by position (:class:`~mm_lightning.data.order.GlobalOrderSampler`): each global batch comes
from the same few shards, of which every rank reads its share. A checkpoint's position is a sample count, so a
resume on another number of ranks reads the rest of the epoch, each sample once. Memory is O(shards +
``shuffle_shards`` shards' items): the stream is made and read block by block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from mm_lightning.data.order import GlobalOrderSampler, Visit
from mm_lightning.data.seeding import derived_rng

MIX_BLOCK = 4096  # interleaving decisions drawn per block (vectorized, O(block) memory)
# Distinct random streams per purpose: numpy seeds from (seed, epoch, purpose, ...), all non-negative.
SHARD_ORDER, WINDOW, INTERLEAVE = 0, 1, 2


@dataclass(frozen=True)
class SourcePlan:
    """What the sampler needs of one source.

    Args:
        shard_sizes: items per shard, in storage order (a JSONL source is one "shard").
        weight: upsampling factor per epoch (or share, with ``epoch_samples``).
        offset: index of the source's first item in the mixed dataset.
        locality: shuffle within groups of shards (shards); ``False``: one full permutation (random access).
    """

    shard_sizes: tuple[int, ...]
    weight: float = 1.0
    offset: int = 0
    locality: bool = True

    @property
    def size(self) -> int:
        return int(sum(self.shard_sizes))


def epoch_counts(plans: Sequence[SourcePlan], epoch_samples: int | None) -> list[int]:
    """Items each source contributes to one epoch (all ranks together)."""
    if epoch_samples is None:
        return [round(p.weight * p.size) for p in plans]
    mass = np.array([p.weight * p.size for p in plans], dtype=np.float64)
    if mass.sum() <= 0:
        raise ValueError("source weights must not all be zero")
    raw = epoch_samples * mass / mass.sum()
    counts = np.floor(raw).astype(np.int64)
    counts[np.argsort(counts - raw)[: epoch_samples - int(counts.sum())]] += 1  # largest remainders
    return counts.tolist()


class ShardOrderSampler(GlobalOrderSampler):
    """Shard-aware, deterministic epoch stream over one or several sources, read by position by each rank.

    Args:
        plans: the sources (see :class:`SourcePlan`).
        num_replicas: world size.
        rank: this process's global rank.
        seed: shuffle seed (same on every rank).
        shuffle: shuffle shards and items (``False``: storage order).
        shuffle_shards: shards whose items are shuffled together.
        epoch_samples: fixed items per epoch (all ranks), drawn by weight share with resampling; ``None``:
            one weighted pass.
        batch_size: items per rank per step.
    """

    def __init__(
        self,
        plans: Sequence[SourcePlan],
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_shards: int = 4,
        epoch_samples: int | None = None,
        batch_size: int = 1,
    ) -> None:
        total = sum(p.size for p in plans)
        super().__init__(total, batch_size, num_replicas=num_replicas, rank=rank, seed=seed, shuffle=shuffle)
        self.plans, self.shuffle_shards = list(plans), max(1, shuffle_shards)
        self.counts = epoch_counts(self.plans, epoch_samples)
        for plan, count in zip(self.plans, self.counts, strict=True):
            if count and not plan.size:
                raise ValueError("a source with weight > 0 has no items")

    def stream_length(self) -> int:
        return int(sum(self.counts))

    def _rng(self, *keys: int) -> np.random.Generator:
        return derived_rng(self.seed, self.epoch, *keys)

    def _segments(self, s: int) -> Iterator[tuple[int, int, int]]:
        """(shard, start, stop) pieces of source ``s``'s epoch stream, up to its count."""
        sizes = np.asarray(self.plans[s].shard_sizes, dtype=np.int64)
        position, repeat, end = 0, 0, self.counts[s]
        while position < end:
            order = (
                self._rng(SHARD_ORDER, s, repeat).permutation(len(sizes))
                if self.shuffle
                else np.arange(len(sizes))
            )
            for shard in order:
                stop = min(end - position, int(sizes[shard]))
                if stop > 0:
                    yield int(shard), 0, stop
                position += int(sizes[shard])
                if position >= end:
                    return
            repeat += 1

    def _source_stream(self, s: int) -> Iterator[np.ndarray]:
        """Source ``s``'s items (dataset indices), in shuffled windows."""
        plan = self.plans[s]
        if not self.counts[s]:
            return
        starts = np.concatenate([[0], np.cumsum(plan.shard_sizes)]).astype(np.int64) + plan.offset
        window: list[np.ndarray] = []
        window_shards = self.shuffle_shards if plan.locality else None
        number = 0
        for shard, start, stop in self._segments(s):
            window.append(np.arange(starts[shard] + start, starts[shard] + stop, dtype=np.int64))
            if window_shards is not None and len(window) >= window_shards:
                yield self._shuffled(window, s, number)
                window, number = [], number + 1
        if window:
            yield self._shuffled(window, s, number)

    def _shuffled(self, window: list[np.ndarray], s: int, number: int) -> np.ndarray:
        items = np.concatenate(window)
        return self._rng(WINDOW, s, number).permutation(items) if self.shuffle else items

    def epoch_order(self) -> np.ndarray:
        blocks = list(self.epoch_blocks())
        return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)

    def epoch_blocks(self) -> Iterator[np.ndarray]:
        streams = [_Chunked(self._source_stream(s)) for s in range(len(self.plans))]
        remaining = np.array(self.counts, dtype=np.int64)
        rng = self._rng(INTERLEAVE)
        while remaining.sum() > 0:
            take = min(MIX_BLOCK, int(remaining.sum()))
            if len(streams) == 1:
                per_source = np.array([take])
                labels = np.zeros(take, dtype=np.int64)
            else:
                # Exact counts per block (multivariate hypergeometric), then a random order within the block.
                per_source = rng.multivariate_hypergeometric(remaining, take)
                labels = np.repeat(np.arange(len(streams)), per_source)
                if self.shuffle:
                    rng.shuffle(labels)
            out = np.empty(take, dtype=np.int64)
            for s, count in enumerate(per_source):
                if count:
                    out[labels == s] = streams[s].take(int(count))
            remaining -= per_source
            yield out


class _Chunked:
    """Takes exact counts from an iterator of index arrays."""

    def __init__(self, chunks: Iterator[np.ndarray]) -> None:
        self.chunks, self.buffer = chunks, np.zeros(0, dtype=np.int64)

    def take(self, n: int) -> np.ndarray:
        parts, have = [self.buffer], len(self.buffer)
        while have < n:
            chunk = next(self.chunks)
            parts.append(chunk)
            have += len(chunk)
        joined = np.concatenate(parts)
        self.buffer = joined[n:]
        return joined[:n]


class MixedDataset(Dataset):
    """Several datasets as one index space (source ``s`` owns ``[offsets[s], offsets[s + 1])``).

    A batch is split by source and each part loaded by its source's ``__getitems__`` (its own per-visit seeding
    and bad-record policy); ``index`` is shifted into the mixed space and image ids are made unique across
    sources.

    Args:
        datasets: map-style datasets yielding the project's sample dicts.
        names: a name per source (for messages).
    """

    def __init__(self, datasets: Sequence[Dataset], names: Sequence[str] | None = None) -> None:
        self.datasets = list(datasets)
        self.names = list(names) if names is not None else [str(i) for i in range(len(self.datasets))]
        sizes = [len(d) for d in self.datasets]  # type: ignore[arg-type]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        # Image ids of source s are shifted past every id of the sources before it.
        self.id_offsets = np.concatenate([[0], np.cumsum([_id_span(d) for d in self.datasets])]).astype(
            np.int64
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, index: int) -> int:
        return int(np.searchsorted(self.offsets, index, side="right")) - 1

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{} for _ in indices]
        by_source: dict[int, list[int]] = {}
        for n, index in enumerate(indices):
            by_source.setdefault(self.source_of(index), []).append(n)
        for s, positions in by_source.items():
            base, dataset = int(self.offsets[s]), self.datasets[s]
            local = [_moved(indices[n], indices[n] - base) for n in positions]
            samples = (
                dataset.__getitems__(local)
                if hasattr(dataset, "__getitems__")
                else [dataset[i] for i in local]
            )
            for n, sample in zip(positions, samples, strict=True):
                sample["index"] = int(sample["index"]) + base  # a replacement keeps its own index
                sample["image_id"] = int(sample["image_id"]) + int(self.id_offsets[s])
                out[n] = sample
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])[0]


def _moved(item: int, index: int) -> int:
    """``index`` as the same visit as ``item`` (a source's own index of a mixture's item)."""
    return item.moved(index) if isinstance(item, Visit) else index


def _id_span(dataset: Dataset) -> int:
    """Number of distinct image ids a source uses (its ids are 0..span-1)."""
    if hasattr(dataset, "num_samples"):  # shards: one id per sample
        return int(dataset.num_samples)
    index = getattr(dataset, "index", None)
    if index is not None:
        return int(index.num_images)
    return len(dataset)  # type: ignore[arg-type]
