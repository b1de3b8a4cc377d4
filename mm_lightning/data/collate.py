"""Batch collation: stack images, tokenize all captions at once, pad to the batch's longest caption."""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import torch

from mm_lightning.assets import resolve_pretrained
from mm_lightning.data.batch_slots import BatchSlots
from mm_lightning.data.records import FATAL, RecordError, describe
from mm_lightning.data.samples import ORIGIN_KEY
from mm_lightning.data.skips import SKIPPED_KEY, STAND_IN_KEY


def load_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer`` for a hub name, a local folder or a built-in asset name."""
    # A fast tokenizer's Rust thread pool used before a fork deadlocks/warns in the children; batches of a
    # few dozen captions gain nothing from it, so keep it off unless the user asked for it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_pretrained(name_or_path))


def in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def batch_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty batch tensor; in a DataLoader worker, in shared memory (as torch's ``default_collate`` does).

    A worker's batch crosses to the main process in shared memory: filling a segment directly saves copying
    the finished batch into one (most of the handover's cost is the new segment's page faults either way).
    """
    out = torch.empty(shape, dtype=dtype)
    return out.share_memory_() if in_worker() else out


def shared_tensors(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Empty tensors of the given shapes and dtypes; in a worker, all in one shared-memory segment.

    Why: each tensor a worker returns otherwise gets its own segment, and each segment's file descriptor is
    handed to the main process through multiprocessing's resource sharer (a connection per descriptor): six
    small tensors per batch cost ~2 ms of wall time per batch with 2 workers (measured), one segment none
    beyond the first. The images keep a segment of their own, so holding on to a batch's ids does not keep
    its pixels alive.
    """
    if not in_worker():
        return {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in specs.items()}
    offsets, total = {}, 0
    for name, (shape, dtype) in specs.items():
        offsets[name] = total
        nbytes = math.prod(shape) * dtype.itemsize
        total += -(-nbytes // 8) * 8  # 8-byte aligned, so every dtype's view starts on its own boundary
    storage = torch.empty(max(total, 8), dtype=torch.uint8).share_memory_().untyped_storage()
    return {
        name: torch.empty(0, dtype=dtype).set_(storage, offsets[name] // dtype.itemsize, shape)
        for name, (shape, dtype) in specs.items()
    }


class MultimodalCollate:
    """Picklable collate callable (works with fork and spawn workers).

    The tokenizer is loaded lazily in each process and dropped when pickled, so only its name travels.

    Args:
        tokenizer: HF tokenizer name or local path.
        max_length: truncate captions to this many tokens.
        pad_to_multiple_of: pad the batch length up to a multiple of this (8 suits tensor cores).
        normalize: optional callable applied to the stacked uint8 images in the worker (worker-side
            normalization); ``None`` leaves them uint8 for the device.

    The batch also carries ``skipped``: the :class:`~mm_lightning.data.records.RecordError` of every bad
    record a sample of this batch stands in for (counted by the bad-record logger), and ``stand_in``: (B,) bool,
    True for rows that are copies of another record standing in for a bad one (left out of evaluation).
    """

    def __init__(
        self,
        tokenizer: str,
        max_length: int = 64,
        pad_to_multiple_of: int | None = None,
        normalize: torch.nn.Module | None = None,
    ) -> None:
        self.tokenizer_name, self.max_length = tokenizer, max_length
        self.pad_to_multiple_of, self.normalize = pad_to_multiple_of, normalize
        self.slots: BatchSlots | None = None
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def with_normalize(self, normalize: torch.nn.Module | None) -> MultimodalCollate:
        """A copy that normalizes with ``normalize`` (shares the loaded tokenizer; this one is unchanged)."""
        other = copy.copy(self)
        other.normalize = normalize
        return other

    def with_slots(self, slots: BatchSlots | None) -> MultimodalCollate:
        """A copy whose workers stack uint8 images into ``slots`` (one loader's; see ``batch_slots``)."""
        other = copy.copy(self)
        other.slots = slots
        return other

    def _tokenize(self, captions: list[str]) -> Any:
        return self.tokenizer(
            captions,
            padding="longest",
            truncation=True,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )

    def _tokenizer_error(self, samples: list[dict[str, Any]], err: Exception) -> Exception:
        """Name the record whose caption the tokenizer rejects (captions are validated first, so this is rare)."""
        for sample in samples:
            try:
                self._tokenize([sample["caption"]])
            except Exception as own:
                file, line, key, image = sample.get(ORIGIN_KEY, ("<unknown>", None, None, None))
                reason = f"the tokenizer rejects caption {sample['caption'][:80]!r} ({describe(own)})"
                return RecordError(file, line, reason, image, kind="bad_caption", sample=key)
        return err

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokenizer"] = None
        return state

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        images = [s["image"] for s in samples]
        first = images[0]
        # normalized pixels are float32; cached features (B, D) keep their dtype
        dtype = torch.float32 if self.normalize is not None and first.dim() == 3 else first.dtype
        reserved = self.slots.reserve(len(images), first.shape, dtype) if self.slots is not None else None
        out = reserved[1] if reserved else batch_buffer((len(images), *first.shape), dtype)
        if self.normalize is not None:
            images = self.normalize(torch.stack(images), out=out)
        else:
            images = torch.stack(images, out=out)
        try:
            tokens = self._tokenize([s["caption"] for s in samples])
        except FATAL:
            raise
        except Exception as err:
            raise self._tokenizer_error(samples, err) from err
        values = {
            "input_ids": tokens["input_ids"],
            "attention_mask": tokens["attention_mask"],
            "image_id": torch.tensor([s["image_id"] for s in samples], dtype=torch.long),
            "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
            STAND_IN_KEY: torch.tensor([bool(s.get(STAND_IN_KEY, False)) for s in samples]),
        }
        if "token_type_ids" in tokens:
            values["token_type_ids"] = tokens["token_type_ids"]
        dtypes = {name: torch.bool if name == STAND_IN_KEY else torch.long for name in values}
        small = shared_tensors({name: (tuple(v.shape), dtypes[name]) for name, v in values.items()})
        if reserved:  # complete: the slot is handed over, and crosses the queue as its number
            images = self.slots.hand_over(reserved[0], len(samples))
        batch = {"image": images} | {name: small[name].copy_(value) for name, value in values.items()}
        batch[SKIPPED_KEY] = [err for s in samples for err in s.get(SKIPPED_KEY, ())]
        return batch
