"""ShardDataset: map-style image-caption dataset over WebDataset shards (see ``shards.py`` for the listing,
fetching and random access), built from the JSONL path's pieces: shard members become a
:class:`~mm_lightning.data.records.Record` (image bytes + validated captions), which the shared
:class:`~mm_lightning.data.samples.SampleBuilder` decodes and transforms, under the shared
:class:`~mm_lightning.data.samples.BadRecordPolicy`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from mm_lightning.data.order import draw_seeds
from mm_lightning.data.records import Record, RecordError, record_errors, validate_captions
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder, TooManyBadRecords
from mm_lightning.data.seeding import global_seed
from mm_lightning.extras.shards.files import ShardCache, ShardError, ShardInfo

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


class ShardDataset(Dataset):
    """One item per sample (``caption_sampling="random"``) or per (sample, caption) pair (``"all"``, evaluation);
    yields the same dicts as the JSONL dataset (``image_id`` = the sample's position in the shard list).

    Args:
        shards: the shards, in order.
        builder: record -> sample (decode with ``decode_bytes``, checks, transform).
        text_key: ``.json`` entry holding the caption(s); without it, ``.txt`` is the caption.
        caption_sampling: ``"random"`` or ``"all"`` (reads every sample's captions once, at construction).
        policy: ``raise``, or ``skip``: a bad sample is replaced by another of the same shard when it has a valid
            one (no extra shard to fetch), else of any shard; a missing shard always raises.
        storage_options: fsspec options for remote shards.
        cache_dir: local folder remote shards are fetched to.
        open_shards: shards kept open per process.
        seed: base seed of the per-visit augmentation seeding (default: the run's seed).
    """

    def __init__(
        self,
        shards: list[ShardInfo],
        builder: SampleBuilder,
        text_key: str = "text",
        caption_sampling: Literal["random", "all"] = "random",
        policy: BadRecordPolicy | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | None = None,
        open_shards: int = 8,
        seed: int | None = None,
    ) -> None:
        self.shards, self.builder, self.text_key = shards, builder, text_key
        self.seed = global_seed() if seed is None else seed
        self.policy = policy if policy is not None else BadRecordPolicy(seed=self.seed)
        self.cache = ShardCache(storage_options, cache_dir, open_shards)
        self.sample_starts = np.concatenate([[0], np.cumsum([s.nsamples for s in shards])]).astype(np.int64)
        self.pair_sample = self.pair_pos = None
        if caption_sampling == "all":
            self.pair_sample, self.pair_pos = self._index_captions()
        self.item_starts = np.concatenate([[0], np.cumsum(self.item_counts())]).astype(np.int64)

    @property
    def num_samples(self) -> int:
        return int(self.sample_starts[-1])

    def __len__(self) -> int:
        return self.num_samples if self.pair_sample is None else len(self.pair_sample)

    def item_counts(self) -> list[int]:
        """Items per shard, in shard order (what a shard-aware sampler needs)."""
        if self.pair_sample is None:
            return [s.nsamples for s in self.shards]
        shard_of_pair = np.searchsorted(self.sample_starts, self.pair_sample, side="right") - 1
        return np.bincount(shard_of_pair, minlength=len(self.shards)).tolist()

    def _index_captions(self) -> tuple[np.ndarray, np.ndarray]:
        samples: list[int] = []
        positions: list[int] = []
        for sample in range(self.num_samples):
            try:
                count = len(self.record(sample).captions)
            except RecordError:
                if self.policy.on_bad_record == "raise":
                    raise
                count = 1  # its one pair is replaced (and counted) when loaded
            samples.extend([sample] * count)
            positions.extend(range(count))
        return np.asarray(samples, dtype=np.int64), np.asarray(positions, dtype=np.int32)

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard number, position in the shard) of a sample."""
        shard = int(np.searchsorted(self.sample_starts, sample, side="right")) - 1
        return shard, sample - int(self.sample_starts[shard])

    def record(self, sample: int) -> Record:
        """Sample ``sample`` as a record (image bytes + validated captions), or a ``RecordError`` naming the
        shard, the sample key (or its number when unreadable) and why."""
        shard_no, pos = self.locate(sample)
        info = self.shards[shard_no]
        where = f"#{pos + 1}"
        try:
            tar = self.cache.get(info.url)
        except ShardError as err:
            if err.missing:
                raise  # a missing shard is never a skip
            raise RecordError(info.url, None, str(err), sample=where) from err
        if pos >= len(tar):
            raise RecordError(
                info.url, None, f"shard is truncated: it holds {len(tar)} samples, its listing says {info.nsamples}",
                sample=where,
            )  # fmt: skip
        with record_errors(info.url, None, "undecodable_image", sample=where, what="unreadable tar member"):
            members = tar[pos]
        key = str(members.get("__key__", where))
        stub = Record(b"", [], info.url, None, key)
        ext = next((e for e in IMAGE_EXTENSIONS if e in members), None)
        if ext is None:
            names = sorted(k for k in members if k.startswith("."))
            raise stub.error(f"no image member (members: {names})", "missing_image")
        captions = self._captions(members, stub)
        return Record(members[ext].getvalue(), captions, info.url, None, key, image_name=key + ext)

    def _captions(self, members: dict[str, Any], stub: Record) -> list[str]:
        if ".json" in members:
            with record_errors(
                stub.file, None, "malformed_json", sample=stub.sample, what="malformed .json member"
            ):
                meta = json.loads(members[".json"].getvalue())
            if isinstance(meta, dict) and self.text_key in meta:
                return validate_captions(meta[self.text_key], stub, self.text_key)
        if ".txt" not in members:
            raise stub.error(f"no caption: neither .json[{self.text_key!r}] nor a .txt member", "missing_key")
        with record_errors(stub.file, None, "bad_caption", sample=stub.sample, key=".txt"):
            text = members[".txt"].getvalue().decode("utf-8")
        return validate_captions(text, stub, ".txt")

    def load(self, item: int) -> dict[str, Any]:
        """Load one item or raise a ``RecordError``."""
        if self.pair_sample is None:
            sample, pos = item, None
        else:
            sample, pos = int(self.pair_sample[item]), int(self.pair_pos[item])
        record = self.record(sample)
        if pos is None:
            # torch's RNG, seeded per visit by __getitems__ (draws differ across epochs).
            pos = int(torch.randint(len(record.captions), ()).item()) if len(record.captions) > 1 else 0
        elif pos >= len(record.captions):
            raise record.error("captions changed since the dataset was indexed", "bad_caption")
        return self.builder(record, record.captions[pos], sample, item)

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        """A batch, each sample's draws seeded by its visit (the same on any rank, after a resume)."""
        seeds = draw_seeds(self.seed, items)
        with torch.random.fork_rng(devices=[]):
            out: list[dict[str, Any]] = [{} for _ in items]
            by_shard: dict[int, list[int]] = {}
            for n, item in enumerate(items):
                by_shard.setdefault(
                    int(np.searchsorted(self.item_starts, item, side="right")) - 1, []
                ).append(n)
            for shard, positions in by_shard.items():
                shard_items = [int(items[n]) for n in positions]
                loaded = self._load_in_shard(shard, shard_items, [seeds[n] for n in positions])
                for n, sample in zip(positions, loaded, strict=True):
                    out[n] = sample
            return out

    def _load_in_shard(self, shard: int, items: list[int], seeds: list[int]) -> list[dict[str, Any]]:
        # Replacements come from the same shard (already open or fetched), unless it has no valid sample.
        base = int(self.item_starts[shard])
        size = int(self.item_starts[shard + 1]) - base

        def load_local(local: int) -> dict[str, Any]:
            sample = self.load(base + local)
            sample["index"] = local
            return sample

        try:
            samples = self.policy.load_batch([i - base for i in items], load_local, size, seeds)
        except TooManyBadRecords:
            return self.policy.load_batch(items, self.load, len(self), seeds)
        for sample in samples:
            sample["index"] += base
        return samples

    def __getitem__(self, item: int) -> dict[str, Any]:
        return self.__getitems__([item])[0]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Workers open their own shards (file descriptors and mmaps are per process).
        state["cache"] = self.cache.fresh()
        return state
