"""Length-grouped training batches, less padding: ``data.init_args.train_order: {class_path:
mm_lightning.extras.LengthGrouping}``."""

from __future__ import annotations

from collections.abc import Sized
from typing import Any

import numpy as np

from mm_lightning.data.order import GlobalOrderSampler, TrainOrder
from mm_lightning.data.seeding import derived_rng


def caption_lengths(dataset: Any) -> np.ndarray:
    """Per-item caption length proxy (words) of an :class:`~mm_lightning.data.samples.ImageTextDataset`."""
    index = dataset.index
    return (
        index.cap_words
        if dataset.caption_sampling == "all"
        else index.cap_words[index.first_pair_of_images()]
    )


class LengthGroupedSampler(GlobalOrderSampler):
    """The epoch's stream: shuffled, sorted by length inside windows of ``window_batches`` batches, cut into
    batches of ``batch_size`` that are shuffled again; ranks read it as :class:`GlobalOrderSampler` does.

    The stream depends on ``(seed, epoch, batch_size)``, not on the number of ranks.

    Args:
        lengths: one length per dataset item.
        batch_size: per-device batch size (the group size).
        num_replicas: world size.
        rank: this process's global rank.
        seed: shuffle seed (the same on all ranks).
        window_batches: batches per sorting window; larger saves more padding, randomizes less.
    """

    order_follows_batch_size = True

    def __init__(
        self,
        lengths: Sized,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        window_batches: int = 32,
    ) -> None:
        super().__init__(len(lengths), batch_size, num_replicas=num_replicas, rank=rank, seed=seed)
        self.lengths = np.asarray(lengths)
        self.window_batches = window_batches

    def stream_length(self) -> int:
        return len(self.lengths) // self.batch_size * self.batch_size  # whole groups

    def epoch_order(self) -> np.ndarray:
        rng = derived_rng(self.seed, self.epoch)
        order = rng.permutation(len(self.lengths))
        window = self.batch_size * self.window_batches
        chunks = []
        for start in range(0, len(order), window):
            part = order[start : start + window]
            chunks.append(part[np.argsort(self.lengths[part], kind="stable")])
        grouped = np.concatenate(chunks)[: self.stream_length()].reshape(-1, self.batch_size)
        # Shuffle whole batches so long and short ones alternate.
        return grouped[rng.permutation(len(grouped))].reshape(-1)

    def batches(self) -> np.ndarray:
        """(steps, num_replicas, batch_size) item indices of the current epoch, identical on every rank."""
        return self.epoch_order()[: self.steps() * self.global_batch].reshape(
            -1, self.num_replicas, self.batch_size
        )


class LengthGrouping(TrainOrder):
    """Training batches of captions of similar length (:class:`LengthGroupedSampler`), for the JSONL data modules.

    Args:
        window_batches: batches per length-sorting window; larger saves more padding, randomizes less.
    """

    def __init__(self, window_batches: int = 32) -> None:
        self.window_batches = window_batches

    def sampler(
        self, dataset: Any, batch_size: int, num_replicas: int, rank: int, seed: int
    ) -> LengthGroupedSampler:
        lengths = caption_lengths(dataset)
        return LengthGroupedSampler(lengths, batch_size, num_replicas, rank, seed, self.window_batches)
