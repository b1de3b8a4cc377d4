"""Reusable shared-memory slots for the image batches a DataLoader's workers hand to the main process.

Instead of a fresh segment per batch, each worker stacks its images into one of a few segments mapped once,
and only the slot's number crosses the queue. A slot is handed back when the last tensor over it is freed;
a worker with none free falls back to a fresh segment. Only persistent workers use slots.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
import weakref
from typing import Any

import numpy as np
import torch

from mm_lightning.data.config import LoaderOptions

FREE, HELD = 0, 1

# Slots created in this process, by token; a lease looks its slots up here when a batch is unpickled.
_OWNED: weakref.WeakValueDictionary[str, BatchSlots] = weakref.WeakValueDictionary()


class BatchSlots:
    """``per_worker`` reusable image-batch buffers for each of ``workers`` DataLoader workers.

    Create it in the process that iterates the loader, before the workers start, and give it to the collate.
    ``shape`` is one full batch's image tensor; shorter batches use its first rows.
    """

    def __init__(
        self, workers: int, per_worker: int, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8
    ) -> None:
        if workers < 1 or per_worker < 1:
            raise ValueError(f"workers and per_worker must be >= 1, got {workers} and {per_worker}")
        self.workers, self.per_worker, self.shape, self.dtype = workers, per_worker, tuple(shape), dtype
        # torch reserves the whole segment now: a small /dev/shm fails here, not as a worker's SIGBUS later.
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
        """In a worker: a free slot of its own and its (rows, *shape) tensor to fill, or ``None``."""
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


def slots_for(
    workers: int, batch_size: int, side: int, loader: LoaderOptions, normalized: bool
) -> BatchSlots | None:
    """Slots for a loader's batches (float32 if ``normalized``), or ``None`` without persistent workers
    (``loader``: the ``data.loader`` options)."""
    if workers < 1 or not loader.persistent_workers:
        return None
    per_worker = (loader.prefetch_factor or 2) + 2
    dtype = torch.float32 if normalized else torch.uint8
    return BatchSlots(workers, per_worker, (batch_size, 3, side, side), dtype)
