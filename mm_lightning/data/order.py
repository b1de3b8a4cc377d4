"""The training order and the train loader that reads it: one stream per epoch over the whole data set, cut into
global batches, so that what a step reads does not depend on how many processes read it.

The epoch's stream is a function of ``(seed, epoch)`` alone. Global step ``b`` reads stream positions
``[b * G, (b + 1) * G)`` with ``G = world_size * batch_size``, rank ``r`` the ``r``-th ``batch_size`` of them (the
order in which the contrastive loss gathers ranks, so 2 ranks x 4 samples is the batch 1 rank x 8 reads). A
checkpoint records how many samples of the epoch's stream were consumed; a resume on any number of processes
reads the rest of the stream from there, each sample once. Each item a sampler yields is a :class:`Visit`: the
dataset index, with the epoch and stream position that seed the visit's random draws (crop, flip, caption), so a
sample looks the same whichever rank or worker reads it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from mm_lightning import ExplainedError
from mm_lightning.data.loader import StartsWorkersOutsideTheGroup
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


class LayoutChangeError(ExplainedError, ValueError):
    """A saved position that this run cannot continue exactly (named in the message)."""


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


class ResumableDataLoader(StartsWorkersOutsideTheGroup, DataLoader):
    """The train loader: this rank's share of a :class:`~mm_lightning.data.order.GlobalOrderSampler`'s stream.
    Its position is the epoch's samples consumed by all ranks together, which a run on any number of processes
    resumes from (torchdata's ``StatefulDataLoader`` saves each rank's own iterator, which only a run with the
    same ranks can resume)."""

    KEY = "global_position"
    position_loaded = False  # a resumed run checks that Lightning applied the saved position

    def __init__(self, dataset: Any, sampler: Any, **kwargs: Any) -> None:
        if not isinstance(sampler, GlobalOrderSampler):
            raise TypeError(f"ResumableDataLoader reads a GlobalOrderSampler, got {type(sampler).__name__}")
        if kwargs.get("batch_size", 1) != sampler.batch_size:
            raise ValueError(
                f"batch_size {kwargs.get('batch_size', 1)} differs from the sampler's {sampler.batch_size}"
            )
        super().__init__(dataset, sampler=sampler, **kwargs)
        self._reading: tuple[int, int] | None = None  # (epoch, start position) of the current iterator
        self._yielded = 0
        self.loaded: dict[str, Any] | None = None  # the position a checkpoint gave, as saved
        self.layout_changed = False  # the loaded position was saved by other processes or batch size
        self.global_batch_change: tuple[int, int] | None = None  # (saved, now) after such a resume
        self.planned_steps: float | None = None  # the run's optimizer steps, once the layout has changed
        self._loaded_state: dict[str, Any] | None = None
        self.layouts: list[dict[str, int]] = []  # (world size, batch size) changes met by resumes

    @override
    def __iter__(self) -> Iterator[Any]:
        self._reading, self._yielded = (self.sampler.epoch, self.sampler.next_start()), 0
        return self._counted(super().__iter__())

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            self._yielded += 1
            yield batch

    def position(self) -> tuple[int, int]:
        """(epoch, samples of its stream consumed by all ranks) of the batches yielded so far."""
        sampler = self.sampler
        if self._reading is not None:
            epoch, start = self._reading
            return epoch, start + self._yielded * sampler.global_batch
        if sampler.resume_epoch is not None:  # loaded, not read yet
            return sampler.resume_epoch, sampler.resume_consumed
        return sampler.epoch, 0

    def layout(self) -> dict[str, int]:
        return {"world_size": self.sampler.num_replicas, "batch_size": self.sampler.batch_size}

    def state_dict(self) -> dict[str, Any]:
        epoch, consumed = self.position()
        position = {"epoch": epoch, "consumed": consumed, "stream_length": self.sampler.stream_length()}
        return {self.KEY: {**position, **self.layout(), "layouts": list(self.layouts)}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue after a saved position (loading the same state twice changes nothing)."""
        # the same position again (the data module's, then Lightning's copy)
        if self.KEY in state_dict and state_dict == self._loaded_state:
            return
        self._loaded_state = state_dict
        sampler = self.sampler
        saved = state_dict.get(self.KEY)
        if saved is None:
            raise LayoutChangeError(
                f"The checkpoint's train-loader state holds no {self.KEY!r} (keys: {sorted(state_dict)[:6]}): it was"
                " not written by this loader, so where the epoch stopped is unknown; resume from a checkpoint this"
                " version wrote, or start the run again"
            )
        epoch, consumed = int(saved["epoch"]), int(saved["consumed"])
        if int(saved["stream_length"]) != sampler.stream_length():
            warnings.warn(
                f"The training data has {sampler.stream_length()} samples per epoch, the checkpoint's had"
                f" {saved['stream_length']}: the data changed, so epoch {epoch} continues after {consumed} samples"
                " of a new order (some may be seen twice or not at all)",
                stacklevel=2,
            )
        layout = self.layout()
        changed = [saved[k] for k in layout] != list(layout.values())
        mid_epoch = 0 < consumed and sampler.steps(consumed) > 0
        if mid_epoch and sampler.order_follows_batch_size and saved["batch_size"] != layout["batch_size"]:
            raise LayoutChangeError(
                f"The checkpoint stopped mid-epoch with data.batch_size {saved['batch_size']}; this run has"
                f" {layout['batch_size']}, and {type(sampler).__name__}'s order depends on it. Resume with"
                f" data.batch_size {saved['batch_size']} (any number of processes), or from an epoch-end checkpoint."
            )
        self.layouts = [*saved.get("layouts", [])]
        self.layout_changed = changed
        if changed:
            self.layouts.append({"epoch": epoch, "consumed": consumed, **layout})
        self.loaded = dict(saved)
        if sampler.steps(consumed) == 0:  # the epoch is over: the next starts at its beginning
            epoch, consumed = epoch + 1, 0
        sampler.set_epoch(epoch)
        sampler.resume_at(epoch, consumed)
        self._reading, self._yielded = None, 0
        self.position_loaded = True

    def continue_progress(self, trainer: Any) -> None:
        """Lightning's count of this epoch's batches in this run's layout: the steps the consumed samples make,
        so the epoch ends when its samples do (after a change of processes or batch size), and the length of a
        run whose layout changed, in the optimizer steps it really takes."""
        fit_loop = getattr(trainer, "fit_loop", None)
        if self.loaded is None or fit_loop is None:
            return
        sampler, saved = self.sampler, self.loaded
        epoch, consumed = int(saved["epoch"]), int(saved["consumed"])
        left = sampler.steps(consumed)  # this layout's batches left in the epoch
        old_batch = int(saved["world_size"]) * int(saved["batch_size"])
        if self.layout_changed:
            self.global_batch_change = (old_batch, sampler.global_batch)
        progress = fit_loop.epoch_loop.batch_progress
        if progress.total.ready == 0:  # the loops' state comes later (the loader was set up early)
            if self.layout_changed and consumed > 0 and left > 0:
                raise LayoutChangeError(
                    "The train loader was set up before the checkpoint's loop state was read (configure_optimizers"
                    " asked for trainer.estimated_stepping_batches), so its epoch cannot be counted in this run's"
                    " processes and batch size: resume with the checkpoint's"
                    f" {saved['world_size']} processes x data.batch_size {saved['batch_size']}, or ask for the"
                    " number of steps lazily (as mm_lightning.models.optim.warmup_cosine does)."
                )
            self.loaded = None
            return
        if fit_loop.restarting:  # mid-epoch for Lightning: its batch count and last-batch flag in this layout
            shift = sampler.steps() - left - progress.current.ready
            for counter in ("ready", "started", "processed", "completed"):
                setattr(progress.current, counter, getattr(progress.current, counter) + shift)
            progress.is_last_batch = left == 0
        elif left > 0:  # Lightning ended the epoch; its tail, short of a step in the old layout, waits
            epoch, consumed, left = epoch + 1, 0, sampler.steps()
            sampler.set_epoch(epoch)
            sampler.resume_at(epoch, 0)
        if self.layouts:
            self.planned_steps = self._planned_steps(trainer, epoch, left)
        if self.layout_changed:
            per_epoch = math.ceil(sampler.steps() / trainer.accumulate_grad_batches)
            before = math.ceil(sampler.stream_length() // old_batch / trainer.accumulate_grad_batches)
            rank_zero_info(
                f"Resuming epoch {epoch + 1} after {consumed} of its {sampler.stream_length()} samples, saved by"
                f" {saved['world_size']} process(es) x {saved['batch_size']}; now {sampler.num_replicas} x"
                f" {sampler.batch_size} = {sampler.global_batch} per step: {left} batches finish the epoch,"
                f" {per_epoch} optimizer steps per epoch instead of {before}; the learning-rate schedule ends at"
                f" step {self.planned_steps}."
            )
        self.loaded = None

    def _planned_steps(self, trainer: Any, epoch: int, left: int) -> float:
        """The run's optimizer steps: those done, then this layout's for the rest of ``epoch`` (``left`` batches)
        and for the epochs after it. A first window shorter than the accumulation steps once, as Lightning does
        after a resume that is not on its boundary."""
        accumulate, steps = trainer.accumulate_grad_batches, self.sampler.steps()
        per_epoch = math.ceil(steps / accumulate)
        rest = per_epoch - (steps - left) // accumulate if left else 0
        planned = math.inf
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            planned = trainer.global_step + rest + max(0, trainer.max_epochs - epoch - 1) * per_epoch
        if trainer.max_steps != -1:
            planned = min(planned, trainer.max_steps)
        return planned


class TrainPosition:
    """The train loader's position, saved with the data module and applied to the next train loader: unlike
    Lightning's, also at an epoch's end and for data set up early. Loading a state twice changes nothing."""

    KEY = "train_loader"

    def __init__(self) -> None:
        self.loader: ResumableDataLoader | None = None
        self.pending: dict[str, Any] | None = None

    def track(self, loader: ResumableDataLoader, trainer: Any = None) -> ResumableDataLoader:
        """Remember ``loader``, first giving it the pending position if ``trainer`` resumes a checkpoint."""
        if self.pending is not None and getattr(trainer, "ckpt_path", None) is not None:
            loader.load_state_dict(self.pending)
            loader.continue_progress(trainer)
        self.pending = None
        self.loader = loader
        return loader

    def state_dict(self) -> dict[str, Any]:
        return {} if self.loader is None else {self.KEY: self.loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = state_dict.get(self.KEY)


def planned_steps(trainer: Any) -> float:
    """The run's optimizer steps: Lightning's estimate, or, after a resume on another global batch, the steps
    done plus those the rest of the run takes in this one (Lightning's counts every epoch in the new layout)."""
    planned = getattr(trainer.train_dataloader, "planned_steps", None)
    return trainer.estimated_stepping_batches if planned is None else planned
