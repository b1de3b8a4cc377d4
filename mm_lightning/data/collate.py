"""Batch collation: stack images, tokenize all captions at once, pad to the batch's longest caption."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from mm_lightning.assets import resolve_pretrained
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


def batch_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty batch tensor; in a DataLoader worker, in shared memory (as torch's ``default_collate`` does).

    A worker's batch crosses to the main process in shared memory: filling a segment directly saves copying
    the finished batch into one (most of the handover's cost is the new segment's page faults either way).
    """
    out = torch.empty(shape, dtype=dtype)
    return out.share_memory_() if torch.utils.data.get_worker_info() is not None else out


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
        if self.normalize is not None:
            first = images[0]
            out = batch_buffer(
                (len(images), *first.shape), torch.float32 if first.dim() == 3 else first.dtype
            )
            images = self.normalize(torch.stack(images), out=out)
        else:
            images = torch.stack(images, out=batch_buffer((len(images), *images[0].shape), images[0].dtype))
        try:
            tokens = self._tokenize([s["caption"] for s in samples])
        except FATAL:
            raise
        except Exception as err:
            raise self._tokenizer_error(samples, err) from err
        batch = {
            "image": images,
            "input_ids": tokens["input_ids"].long(),
            "attention_mask": tokens["attention_mask"].long(),
            "image_id": torch.tensor([s["image_id"] for s in samples], dtype=torch.long),
            "index": torch.tensor([s["index"] for s in samples], dtype=torch.long),
            SKIPPED_KEY: [err for s in samples for err in s.get(SKIPPED_KEY, ())],
            STAND_IN_KEY: torch.tensor([bool(s.get(STAND_IN_KEY, False)) for s in samples]),
        }
        if "token_type_ids" in tokens:
            batch["token_type_ids"] = tokens["token_type_ids"].long()
        return batch
