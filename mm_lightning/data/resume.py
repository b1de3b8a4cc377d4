"""Resuming a run where it stopped, on any number of processes: the train loader's position, where a checkpoint
keeps it, and what a resume in another layout (processes x batch size) changes in Lightning's loop and in the
learning-rate schedule. Everything a resume changes outside the model and optimizer is here.

The position is the epoch's samples consumed by all ranks together (the order it counts in:
:mod:`mm_lightning.data.order`). Lightning keeps a state per train loader in its fit loop, saved per rank and
loaded only into a loader set up after the checkpoint is read: asking for ``trainer.estimated_stepping_batches`` in
``configure_optimizers`` sets the loader up earlier and the saved state is dropped
(https://github.com/Lightning-AI/pytorch-lightning/issues/20550). Its batch counters also count in the layout that
saved them, so after a change of layout its epoch would end early or late. Here:

- the data module keeps the position (:class:`TrainPosition`, restored before anything sets the loader up), and
  Lightning's copy stays empty, so a checkpoint holds the position once;
- :func:`continue_in_this_layout` is the one place that writes Lightning's loop state: this epoch's batch counters
  in this run's layout;
- after a change of layout, the schedule's length is the optimizer steps the run really takes
  (:func:`planned_steps`) and the learning rates follow ``model.optim.lr_scaling`` (:func:`rescale_for_global_batch`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from mm_lightning import ExplainedError
from mm_lightning.data.order import GlobalOrderSampler


class ResumeError(ExplainedError, ValueError):
    """A saved position that this run cannot continue exactly (named in the message)."""


class ResumableDataLoader(DataLoader):
    """The train loader: this rank's share of a :class:`~mm_lightning.data.order.GlobalOrderSampler`'s stream.
    Its position is the epoch's samples consumed by all ranks together, which a run on any number of processes
    resumes from (a loader that saves each rank's own iterator can only be resumed by the same ranks)."""

    KEY = "global_position"

    def __init__(self, dataset: Any, sampler: Any, processes: int | None = None, **kwargs: Any) -> None:
        """``processes``: the run's processes, whose layout (processes x their share of the global batch) the
        position records; by default the sampler's readers. A strategy that gives each group of processes the
        whole batch (one group per tower) reads it with fewer readers per group, yet every process records the
        run's layout, the same on all of them."""
        if not isinstance(sampler, GlobalOrderSampler):
            raise TypeError(f"ResumableDataLoader reads a GlobalOrderSampler, got {type(sampler).__name__}")
        if kwargs.get("batch_size", 1) != sampler.batch_size:
            raise ValueError(
                f"batch_size {kwargs.get('batch_size', 1)} differs from the sampler's {sampler.batch_size}"
            )
        self.processes = processes or sampler.num_replicas
        if sampler.global_batch % self.processes:
            raise ValueError(
                f"a global batch of {sampler.global_batch} does not split over the run's {self.processes} processes"
            )
        super().__init__(dataset, sampler=sampler, **kwargs)
        self._reading: tuple[int, int] | None = None  # (epoch, start position) of the current iterator
        self._yielded = 0
        self.kept_by_data_module = False  # a TrainPosition saves the position: Lightning's copy stays empty
        self.position_loaded = False  # a resumed run checks that the saved position was applied
        self.loaded: dict[str, Any] | None = None  # the position a checkpoint gave, as saved
        self.layouts: list[dict[str, int]] = []  # (world size, batch size) changes met by resumes
        self.global_batch_change: tuple[int, int] | None = None  # (saved, now) after such a resume
        self.planned_steps: float | None = None  # the run's optimizer steps, once the layout has changed

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
        return {"world_size": self.processes, "batch_size": self.sampler.global_batch // self.processes}

    def layout_differs(self, saved: dict[str, Any]) -> bool:
        """Whether a saved position was read by other processes or another batch size than this loader's."""
        return any(saved[key] != value for key, value in self.layout().items())

    def position_state(self) -> dict[str, Any]:
        """The position as a checkpoint records it."""
        epoch, consumed = self.position()
        position = {"epoch": epoch, "consumed": consumed, "stream_length": self.sampler.stream_length()}
        reader = {"reader_batch_size": self.sampler.batch_size}  # what an order cut into batches follows
        return {self.KEY: {**position, **self.layout(), **reader, "layouts": list(self.layouts)}}

    def load_position(self, state: dict[str, Any]) -> None:
        """Continue after a saved position."""
        sampler = self.sampler
        saved = state.get(self.KEY)
        if saved is None:
            raise ResumeError(
                f"The checkpoint's train-loader state holds no {self.KEY!r} (keys: {sorted(state)[:6]}): it was"
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
        changed = self.layout_differs(saved)
        mid_epoch = 0 < consumed and sampler.steps(consumed) > 0
        saved_reader = saved.get("reader_batch_size", saved["batch_size"])
        if mid_epoch and sampler.order_follows_batch_size and saved_reader != sampler.batch_size:
            raise ResumeError(
                f"The checkpoint stopped mid-epoch with data.batch_size {saved_reader}; this run has"
                f" {sampler.batch_size}, and {type(sampler).__name__}'s order depends on it. Resume with"
                f" data.batch_size {saved_reader} (any number of processes), or from an epoch-end checkpoint."
            )
        self.layouts = [*saved.get("layouts", [])]
        if changed:
            self.layouts.append({"epoch": epoch, "consumed": consumed, **layout})
        self.loaded = dict(saved)
        if sampler.steps(consumed) == 0:  # the epoch is over: the next starts at its beginning
            epoch, consumed = epoch + 1, 0
        sampler.set_epoch(epoch)
        sampler.resume_at(epoch, consumed)
        self._reading, self._yielded = None, 0
        self.position_loaded = True

    # Lightning's per-loader state: the position itself for a loader passed to fit directly; empty when a data
    # module keeps it, so that a checkpoint holds it once (and Lightning still knows the loader resumes).
    def state_dict(self) -> dict[str, Any]:
        return {} if self.kept_by_data_module else self.position_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict or self.position_loaded:  # none, or the data module's was applied
            return
        self.load_position(state_dict)
        saved, self.loaded = self.loaded, None
        old_batch = saved_global_batch(saved)
        mid_epoch = self.sampler.stream_length() - int(saved["consumed"]) >= old_batch  # in the saved layout
        if old_batch != self.sampler.global_batch and mid_epoch:
            raise ResumeError(
                f"The checkpoint stopped mid-epoch with {saved['world_size']} process(es) x data.batch_size"
                f" {saved['batch_size']}; this run has {self.sampler.num_replicas} x {self.sampler.batch_size}."
                " Lightning counts an epoch's batches in the layout that saved them, which is corrected only for a"
                " loader a data module keeps (mm_lightning.data.resume.TrainPosition): resume through such a data"
                " module, or with the checkpoint's processes and batch size."
            )


def saved_global_batch(saved: dict[str, Any]) -> int:
    """Samples per step of the layout that saved a position."""
    return int(saved["world_size"]) * int(saved["batch_size"])


def continue_in_this_layout(loader: ResumableDataLoader, trainer: Any) -> None:
    """After ``loader`` took a saved position: Lightning's count of this epoch's batches in this run's layout
    (the steps the consumed samples make), so the epoch ends when its samples do, and the run's length in the
    optimizer steps it really takes. The one writer of Lightning's loop state."""
    fit_loop = getattr(trainer, "fit_loop", None)
    saved, loader.loaded = loader.loaded, None
    if saved is None or fit_loop is None:
        return
    sampler = loader.sampler
    epoch, consumed = int(saved["epoch"]), int(saved["consumed"])
    old_batch = saved_global_batch(saved)
    changed = loader.layout_differs(saved)
    if changed:
        loader.global_batch_change = (old_batch, sampler.global_batch)
    left = sampler.steps(consumed)  # this layout's batches left in the epoch
    progress = fit_loop.epoch_loop.batch_progress
    if progress.total.ready == 0:  # the loops' state comes later (the loader was set up early)
        if changed and consumed > 0 and left > 0:
            raise ResumeError(
                "The train loader was set up before the checkpoint's loop state was read (configure_optimizers"
                " asked for trainer.estimated_stepping_batches), so its epoch cannot be counted in this run's"
                " processes and batch size: resume with the checkpoint's"
                f" {saved['world_size']} processes x data.batch_size {saved['batch_size']}, or ask for the"
                " number of steps lazily (as mm_lightning.models.optim.warmup_cosine does)."
            )
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
    if loader.layouts:
        loader.planned_steps = _planned_steps(sampler, trainer, epoch, left)
    if changed:
        per_epoch = math.ceil(sampler.steps() / trainer.accumulate_grad_batches)
        before = math.ceil(sampler.stream_length() // old_batch / trainer.accumulate_grad_batches)
        rank_zero_info(
            f"Resuming epoch {epoch + 1} after {consumed} of its {sampler.stream_length()} samples, saved by"
            f" {saved['world_size']} process(es) x {saved['batch_size']}; now {sampler.num_replicas} x"
            f" {sampler.batch_size} = {sampler.global_batch} per step: {left} batches finish the epoch,"
            f" {per_epoch} optimizer steps per epoch instead of {before}; the learning-rate schedule ends at"
            f" step {loader.planned_steps}."
        )


def _planned_steps(sampler: GlobalOrderSampler, trainer: Any, epoch: int, left: int) -> float:
    """The run's optimizer steps: those done, then this layout's for the rest of ``epoch`` (``left`` batches) and
    for the epochs after it. A first window shorter than the accumulation steps once, as Lightning does after a
    resume that is not on its boundary."""
    accumulate, steps = trainer.accumulate_grad_batches, sampler.steps()
    per_epoch = math.ceil(steps / accumulate)
    rest = per_epoch - (steps - left) // accumulate if left else 0
    planned = math.inf
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        planned = trainer.global_step + rest + max(0, trainer.max_epochs - epoch - 1) * per_epoch
    if trainer.max_steps != -1:
        planned = min(planned, trainer.max_steps)
    return planned


class TrainPosition:
    """Where a data module keeps its train loader's position: saved with the data module's state and applied to
    the next train loader it builds, also at an epoch's end and for a loader set up early."""

    KEY = "train_loader"

    def __init__(self) -> None:
        self.loader: ResumableDataLoader | None = None
        self.pending: dict[str, Any] | None = None

    def track(self, loader: ResumableDataLoader, trainer: Any = None) -> ResumableDataLoader:
        """Keep ``loader``'s position, first giving it the pending one if ``trainer`` resumes a checkpoint."""
        loader.kept_by_data_module = True
        if self.pending is not None and getattr(trainer, "ckpt_path", None) is not None:
            loader.load_position(self.pending)
            continue_in_this_layout(loader, trainer)
        self.pending = None
        self.loader = loader
        return loader

    def state_dict(self) -> dict[str, Any]:
        return {} if self.loader is None else {self.KEY: self.loader.position_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pending = state_dict.get(self.KEY)


def planned_steps(trainer: Any) -> float:
    """The run's optimizer steps: Lightning's estimate, or, after a resume on another global batch, the steps
    done plus those the rest of the run takes in this one (Lightning's counts every epoch in the new layout)."""
    planned = getattr(trainer.train_dataloader, "planned_steps", None)
    return trainer.estimated_stepping_batches if planned is None else planned


LR_SCALING = {"none": lambda ratio: 1.0, "linear": lambda ratio: ratio, "sqrt": math.sqrt}


def rescale_for_global_batch(trainer: Any, rule: str) -> None:
    """After a resume with another global batch than the checkpoint's, scales the learning rates (and the
    schedule's peak) by ``rule`` of new / old global batch, and says so."""
    change = getattr(trainer.train_dataloader, "global_batch_change", None)
    if change is None:
        return
    old, new = change
    factor = LR_SCALING[rule](new / old)
    if factor != 1.0:
        for config in trainer.lr_scheduler_configs:
            config.scheduler.base_lrs = [lr * factor for lr in config.scheduler.base_lrs]
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor
                if "initial_lr" in group:
                    group["initial_lr"] *= factor
    done = "kept" if factor == 1.0 else f"scaled by {factor:.4g}"
    rank_zero_info(
        f"Global batch {old} -> {new}: learning rates {done} (model.optim.lr_scaling: {rule}; linear and sqrt"
        " scale them by the ratio or its square root)"
    )
