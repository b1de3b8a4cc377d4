"""The training order: one stream per epoch over the whole data set, cut into global batches, so that what a step
reads does not depend on how many processes read it.

The epoch's stream is a function of ``(seed, epoch)`` alone. Global step ``b`` reads stream positions
``[b * G, (b + 1) * G)`` with ``G = world_size * batch_size``, rank ``r`` the ``r``-th ``batch_size`` of them (the
order in which the contrastive loss gathers ranks, so 2 ranks x 4 samples is the batch 1 rank x 8 reads). A
checkpoint records how many samples of the epoch's stream were consumed; a resume on any number of processes
reads the rest of the stream from there, each sample once (:mod:`mm_lightning.data.resume`). Each item a sampler
yields is a :class:`Visit`: the dataset index, with the epoch and stream position that seed the visit's random
draws (crop, flip, caption), so a sample looks the same whichever rank or worker reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from mm_lightning.data.seeding import derive_seed, derived_rng


class Visit(int):
    """A dataset index that also says which visit it is: ``epoch`` and ``position`` in the epoch's stream.

    An ``int`` everywhere (a dataset that ignores the visit reads it as its index)."""

    epoch: int
    position: int

    def __new__(cls, index: int, epoch: int, position: int) -> Visit:
        visit = super().__new__(cls, index)
        visit.epoch, visit.position = epoch, position
        return visit

    def __reduce__(self) -> tuple[Any, ...]:  # to DataLoader workers
        return Visit, (int(self), self.epoch, self.position)

    def moved(self, index: int) -> Visit:
        """The same visit of another index (a source's own index inside a mixture)."""
        return Visit(index, self.epoch, self.position)


def draw_seeds(seed: int, items: Sequence[int]) -> list[int]:
    """The seed of each item's random draws: from its visit, or from the index alone for a plain index (an
    evaluation loader's, whose transforms draw nothing)."""
    return [
        derive_seed(seed, (item.epoch, item.position)) if isinstance(item, Visit) else derive_seed(seed, item)
        for item in items
    ]


class GlobalOrderSampler(DistributedSampler):
    """This rank's share of each global batch of the epoch's stream (see the module's docs).

    A ``DistributedSampler`` so Lightning keeps it and calls ``set_epoch``. Subclasses define the stream
    (:meth:`epoch_order`); this one is a permutation of the data set by ``(seed, epoch)``.

    Args:
        size: items in the data set.
        batch_size: items per rank per step.
        num_replicas: world size.
        rank: this process's global rank.
        seed: shuffle seed (the same on every rank).
        shuffle: ``False``: the data set's order.
    """

    order_follows_batch_size = False  # True where the stream is cut into groups of batch_size

    def __init__(
        self,
        size: int,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        # The base class only needs a sized "dataset" for its bookkeeping.
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        self.resume_epoch: int | None = None  # the epoch a loaded position belongs to
        self.resume_consumed = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def stream_length(self) -> int:
        """Items in one epoch's stream (all ranks together)."""
        return len(self.dataset)  # type: ignore[arg-type]

    def epoch_order(self) -> np.ndarray:
        """Data set indices of the current epoch's stream, in order."""
        size = self.stream_length()
        return derived_rng(self.seed, self.epoch).permutation(size) if self.shuffle else np.arange(size)

    def epoch_blocks(self) -> Iterator[np.ndarray]:
        """The epoch's stream in consecutive pieces (a stream too long to hold whole comes block by block)."""
        yield self.epoch_order()

    def steps(self, consumed: int = 0) -> int:
        """Global steps left in the epoch after ``consumed`` samples (the tail short of one step is dropped)."""
        return max(0, self.stream_length() - consumed) // self.global_batch

    def __len__(self) -> int:
        return self.steps() * self.batch_size  # a whole epoch: Lightning counts its batches once

    def resume_at(self, epoch: int, consumed: int) -> None:
        """The next iterator of ``epoch`` starts after its first ``consumed`` samples."""
        self.resume_epoch, self.resume_consumed = epoch, consumed

    def next_start(self) -> int:
        """Where the next iterator of the current epoch starts."""
        return self.resume_consumed if self.resume_epoch == self.epoch else 0

    def __iter__(self) -> Iterator[int]:
        start = self.next_start()
        self.resume_epoch, self.resume_consumed = None, 0  # a loaded position is used once
        end = start + self.steps(start) * self.global_batch
        epoch, batch, group, rank = self.epoch, self.batch_size, self.global_batch, self.rank
        offset = 0
        for block in self.epoch_blocks():
            first, offset = offset, offset + len(block)
            if offset <= start:
                continue
            if first >= end:
                return
            positions = np.arange(max(first, start), min(offset, end))
            for position in positions[(positions - start) % group // batch == rank].tolist():
                yield Visit(int(block[position - first]), epoch, position)


class TrainOrder:
    """How the training split's epoch stream is drawn (``data.init_args.train_order``): this one shuffles the
    data set by ``(seed, epoch)``. Another order is a subclass named by ``class_path`` whose :meth:`sampler`
    returns a :class:`GlobalOrderSampler` subclass, so that ranks, visits and exact resume work as here."""

    def sampler(
        self, dataset: Any, batch_size: int, num_replicas: int, rank: int, seed: int
    ) -> GlobalOrderSampler:
        """This rank's sampler over ``dataset`` (the training split's map-style dataset)."""
        return GlobalOrderSampler(len(dataset), batch_size, num_replicas, rank, seed)
