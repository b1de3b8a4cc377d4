"""Reusable shared-memory slots for the image batches a DataLoader's workers hand to the main process.

Without them, every batch a worker returns gets a fresh shared-memory segment: created, page-faulted in by the
worker, its file descriptor passed to the main process over a socket, mapped and page-faulted again there, and
unmapped at the end: a measurable share of the loader's work on real photos (``benchmarks/loader_breakdown.py``,
figures in docs/benchmarks.md). With slots, each worker stacks its images into one of a few
segments mapped once by every process, and the batch carries only the slot's number across the queue.

Safety rests on reference counting, not on timing: in the main process the batch's image tensor is a view of
its slot whose memory is owned by a lease; the slot is handed back to its worker only when the last tensor or
view of that memory is freed (the lease's finalizer). A worker never waits for a slot: when all of its slots
are still held (a user keeping batches in a list, say), it falls back to a fresh segment, as torch does.
Only loaders with persistent workers use slots: then one set of workers serves the loader, and the batches a
restarted epoch discards are still unpickled in the main process, which hands their slots back. Only workers
started by the process that made the slots fill them: a copy of the loader iterated in another process (a
pickled loader in a spawned rank, say) falls back, so two sets of workers never write the same slots.

torch's DataLoader has no such reuse (each batch's storage is shared anew; ``pin_memory`` only covers the
host-to-device copy), hence this module.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
import weakref
from typing import Any

import numpy as np
import torch

FREE, HELD = 0, 1

# Slots created in this process, by token; a lease looks its slots up here when a batch is unpickled.
_OWNED: weakref.WeakValueDictionary[str, BatchSlots] = weakref.WeakValueDictionary()


class BatchSlots:
    """``per_worker`` reusable image-batch buffers for each of ``workers`` DataLoader workers.

    Create it in the process that iterates the loader, before the workers start, and give it to the collate.

    Args:
        workers: the loader's ``num_workers``.
        per_worker: slots per worker; batches the worker prepares ahead (``prefetch_factor``) plus the ones
            the training loop holds (the current batch and the one fetched ahead) need one each.
        shape: one batch's image tensor, e.g. ``(32, 3, 224, 224)``; shorter batches use the first rows.
        dtype: the images' dtype (uint8, or float32 when the workers normalize).
    """

    def __init__(
        self, workers: int, per_worker: int, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8
    ) -> None:
        if workers < 1 or per_worker < 1:
            raise ValueError(f"workers and per_worker must be >= 1, got {workers} and {per_worker}")
        self.workers, self.per_worker, self.shape, self.dtype = workers, per_worker, tuple(shape), dtype
        # torch reserves the whole segment at once (workers x per_worker x one batch of shared memory), so a
        # /dev/shm too small for it fails here, not with a SIGBUS in a worker later.
        self.pixels = torch.empty((workers * per_worker, *self.shape), dtype=dtype).share_memory_()
        self.flags = torch.zeros(workers * per_worker, dtype=torch.uint8).share_memory_()
        self.token, self.owner = uuid.uuid4().hex, os.getpid()
        self._views()
        _OWNED[self.token] = self

    def _views(self) -> None:
        self._pixels_np, self._flags_np = self.pixels.numpy(), self.flags.numpy()
        self._next = 0

    def __getstate__(self) -> dict[str, Any]:
        """For spawn/forkserver workers: the segments travel by descriptor, the numpy views are rebuilt."""
        state = self.__dict__.copy()
        del state["_pixels_np"], state["_flags_np"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()

    def reserve(self, rows: int, shape: torch.Size, dtype: torch.dtype) -> tuple[int, torch.Tensor] | None:
        """In a worker: a free slot of its own and the (rows, *shape) tensor of it to fill, or ``None``.

        ``None`` (fall back to a fresh segment) also outside a worker, in a worker of another process than the
        one that made the slots, for images of another shape or dtype, or a batch longer than a slot.
        """
        info, parent = torch.utils.data.get_worker_info(), multiprocessing.parent_process()
        if info is None or info.id >= self.workers or parent is None or parent.pid != self.owner:
            return None
        if rows > self.shape[0] or tuple(shape) != self.shape[1:] or dtype != self.dtype:
            return None
        first = info.id * self.per_worker
        for step in range(self.per_worker):
            slot = first + (self._next + step) % self.per_worker
            if self._flags_np[slot] == FREE:  # only the main process frees, only this worker takes
                self._next = (slot - first + 1) % self.per_worker
                return slot, self.pixels[slot, :rows]
        return None

    def hand_over(self, slot: int, rows: int) -> SlotImages:
        """In a worker, once the batch is complete: mark ``slot`` held and return what crosses the queue."""
        self._flags_np[slot] = HELD
        return SlotImages(self.token, slot, rows)

    def lease(self, slot: int, rows: int) -> torch.Tensor:
        """In the owning process: the images of ``slot`` as a tensor; the slot is freed with its last view."""
        return torch.from_numpy(np.asarray(_Lease(self, slot, rows)))

    def free_slots(self) -> int:
        return int((self._flags_np == FREE).sum())

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory lies in one of these slots."""
        start = self.pixels.data_ptr()
        return start <= tensor.data_ptr() < start + self.pixels.nbytes


class _Lease:
    """Owns a slot's memory for as long as any tensor over it lives (numpy keeps it as the array's base)."""

    def __init__(self, slots: BatchSlots, slot: int, rows: int) -> None:
        self.slots, self.slot = slots, slot
        self._view = slots._pixels_np[slot, :rows]
        self.__array_interface__ = self._view.__array_interface__

    def __del__(self) -> None:
        try:
            self.slots._flags_np[self.slot] = FREE
        except Exception:  # interpreter shutdown: the segment is going away anyway
            pass


class SlotImages:
    """A worker's image batch sitting in a slot; unpickled in the main process as a tensor over that slot."""

    def __init__(self, token: str, slot: int, rows: int) -> None:
        self.token, self.slot, self.rows = token, slot, rows

    def __reduce__(self) -> tuple[Any, tuple[str, int, int]]:
        return _lease, (self.token, self.slot, self.rows)


def _lease(token: str, slot: int, rows: int) -> torch.Tensor:
    slots = _OWNED.get(token)
    if slots is None:
        raise RuntimeError(
            "a batch from a DataLoader worker refers to shared batch slots this process does not own (the loader "
            "was deleted, or the batch was pickled again in another process)"
        )
    return slots.lease(slot, rows)


def slots_for(hparams: Any, side: int, normalized: bool) -> BatchSlots | None:
    """Slots for a loader of ``batch_size`` x 3 x ``side`` x ``side`` images (float32 when ``normalized`` in the
    workers, else uint8) with these ``num_workers``, ``persistent_workers`` and ``prefetch_factor``; ``None``
    without workers or with workers that do not persist.
    """
    if hparams.num_workers < 1 or not hparams.persistent_workers:
        return None
    per_worker = (hparams.prefetch_factor or 2) + 2
    dtype = torch.float32 if normalized else torch.uint8
    return BatchSlots(hparams.num_workers, per_worker, (hparams.batch_size, 3, side, side), dtype)
