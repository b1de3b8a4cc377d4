"""Batch collation: stack images, tokenize all captions at once, pad to the batch's longest caption."""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

import torch

from mm_lightning.assets import load_pretrained, resolve_pretrained
from mm_lightning.data.records import FATAL, SKIPPED_KEY, STAND_IN_KEY, RecordError, describe
from mm_lightning.data.samples import ORIGIN_KEY

if TYPE_CHECKING:
    from mm_lightning.data.batch_slots import BatchSlots


def load_tokenizer(name_or_path: str) -> Any:
    """``AutoTokenizer`` for a hub name, a local folder or a built-in asset name."""
    # A fast tokenizer's thread pool used before a fork deadlocks the children; small batches gain nothing.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    what = f"tokenizer {name_or_path!r} (it follows the text tower)"
    return load_pretrained(AutoTokenizer.from_pretrained, resolve_pretrained(name_or_path), what)


def in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


def batch_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty batch tensor; in a DataLoader worker, in shared memory (as ``default_collate`` does)."""
    out = torch.empty(shape, dtype=dtype)
    return out.share_memory_() if in_worker() else out


class ByValue:
    """A small tensor sent inside the pickle: for a few KB, cheaper than torch's shared-memory segment."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[bytes, torch.dtype, tuple[int, ...]]]:
        tensor = self.tensor.contiguous()
        return _from_bytes, (tensor.numpy().tobytes(), tensor.dtype, tuple(tensor.shape))


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:  # torch.frombuffer refuses empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)  # a writable copy


class MultimodalCollate:
    """Picklable collate (fork and spawn workers); the tokenizer loads lazily and is not pickled.
    ``normalize``: applied to the stacked uint8 images in the worker (``None``: left uint8 for the device).
    Batches also carry ``skipped`` (RecordErrors their rows stand in for) and ``stand_in`` ((B,) bool)."""

    def __init__(
        self,
        tokenizer: str,
        max_length: int = 64,
        pad_to_multiple_of: int | None = None,
        normalize: torch.nn.Module | None = None,
    ) -> None:
        self.tokenizer_name, self.max_length = tokenizer, max_length
        self.pad_to_multiple_of, self.normalize = pad_to_multiple_of, normalize
        self.queue, self.slots = False, None  # see for_queue
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

    def for_queue(self, slots: BatchSlots | None = None) -> MultimodalCollate:
        """A copy for DataLoader queues: small tensors cross by value, images in ``slots`` when given."""
        other = copy.copy(self)
        other.queue, other.slots = True, slots
        return other

    def _tokenize(self, captions: list[str]) -> Any:
        limits = {"max_length": self.max_length, "pad_to_multiple_of": self.pad_to_multiple_of}
        return self.tokenizer(captions, padding="longest", truncation=True, return_tensors="pt", **limits)

    def _tokenizer_error(self, samples: list[dict[str, Any]], err: Exception) -> Exception:
        """Name the record whose caption the tokenizer rejects (captions are validated first: rare)."""
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
        # normalized pixels are float32; precomputed image features (B, D) keep their dtype
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
        small = {name: value.to(dtypes[name]) for name, value in values.items()}
        if reserved:  # complete: the slot is handed over, and crosses the queue as its number
            images = self.slots.hand_over(reserved[0], len(samples))
        batch = {"image": images} | (
            {k: ByValue(v) for k, v in small.items()} if self.queue and in_worker() else small
        )
        batch[SKIPPED_KEY] = [err for s in samples for err in s.get(SKIPPED_KEY, ())]
        return batch
