"""Length-grouped training batches (``data.loader.length_grouping: true``): less padding, loaded only when asked for."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from mm_lightning.data.loader import derived_rng


def caption_lengths(dataset: Any) -> np.ndarray:
    """Per-item caption length proxy (words) of an :class:`~mm_lightning.data.datamodule.ImageTextDataset`."""
    index = dataset.index
    return (
        index.cap_words
        if dataset.caption_sampling == "all"
        else index.cap_words[index.first_pair_of_images()]
    )


class LengthGroupedSampler(DistributedSampler):
    """Shuffle, sort by length inside windows of ``window_batches`` global batches, deal batches to ranks.

    A ``DistributedSampler`` so Lightning keeps it; the order depends only on ``(seed, epoch)`` (resumable).

    Args:
        lengths: one length per dataset item.
        batch_size: per-device batch size (the group size).
        num_replicas: world size.
        rank: this process's global rank.
        seed: shuffle seed (the same on all ranks).
        window_batches: global batches per sorting window; larger saves more padding, randomizes less.
        drop_last: drop the tail that does not fill a batch on every rank (else wrap around to fill it).
    """

    def __init__(
        self,
        lengths: Sized,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        window_batches: int = 32,
        drop_last: bool = True,
    ) -> None:
        super().__init__(
            lengths, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
        )
        self.lengths = np.asarray(lengths)
        self.batch_size, self.window_batches = batch_size, window_batches
        per_step = batch_size * num_replicas
        steps = len(self.lengths) // per_step if drop_last else -(-len(self.lengths) // per_step)
        self.num_samples = steps * batch_size
        self.total_size = steps * per_step

    def batches(self) -> np.ndarray:
        """(steps, num_replicas, batch_size) item indices for the current epoch, identical on every rank."""
        rng = derived_rng(self.seed, self.epoch)
        order = rng.permutation(len(self.lengths))
        if self.total_size > len(order):  # wrap around so every rank gets full batches
            order = np.concatenate([order, order[: self.total_size - len(order)]])
        window = self.batch_size * self.num_replicas * self.window_batches
        chunks = []
        for start in range(0, len(order), window):
            part = order[start : start + window]
            chunks.append(part[np.argsort(self.lengths[part], kind="stable")])
        grouped = np.concatenate(chunks)[: self.total_size].reshape(-1, self.batch_size)
        # Shuffle whole batches so long and short ones alternate; rank r takes every num_replicas-th batch.
        grouped = grouped[rng.permutation(len(grouped))]
        return grouped.reshape(-1, self.num_replicas, self.batch_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.batches()[:, self.rank].reshape(-1).tolist())

    def __len__(self) -> int:
        return self.num_samples
