"""WebDataset shards in img2dataset's layout, read with random access through ``wids``.

A shard is a tar file (``00000.tar``) whose members are grouped into samples by key: ``{key}.jpg`` (or
``.png``/``.webp``), ``{key}.txt`` (the caption) and ``{key}.json`` (metadata; its ``text`` entry, when present,
holds one caption or a list of them). img2dataset writes ``00000_stats.json`` next to each shard; its
``successes`` field is the shard's sample count. Shards can be local paths, brace patterns
(``shards/{00000..00127}.tar``), ``http(s)://`` or ``s3://`` URLs (any fsspec protocol, ``storage_options``
passed through) or ``pipe:<command writing the tar to stdout>``; a ``.json`` file holding
``{"shardlist": [{"url": ..., "nsamples": ...}]}`` (wids' descriptor, written by ``python -m mm_lightning
shard``) lists shards with their sizes.

Why ``wids`` and not webdataset's streaming pipeline: wids indexes each tar (``IndexedTarSamples`` over an
mmap) so that sample ``i`` is a pure lookup. A map-style dataset lets the sampler (``sources/mixing.py``) decide
the order from ``(seed, epoch)`` alone: every rank gets the same number of batches whatever the shard sizes,
and a ``StatefulDataLoader`` resumes mid-epoch by skipping indices, not by re-reading a stream. Remote shards
are fetched whole (fsspec, so S3 endpoints and credentials come from ``storage_options``) into a local cache,
a bounded number at a time per process, and removed again when evicted.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import fsspec
import numpy as np
import torch
from braceexpand import braceexpand
from torch.utils.data import Dataset
from wids.wids import IndexedTarSamples
from wids.wids_lru import LRUCache

from mm_lightning.data.records import RecordError
from mm_lightning.data.sources.decode import ImageDecodeError, decode_image_bytes

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


class ShardError(RuntimeError):
    """A shard that cannot be listed, fetched or opened (missing, truncated, not a tar); names the shard.

    Args:
        message: what happened, naming the shard.
        missing: the shard does not exist (always an error, also under ``on_bad_record="skip"``).
    """

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class ShardInfo:
    """One shard: its URL (or local path) and how many samples it holds."""

    url: str
    nsamples: int


def is_local(url: str) -> bool:
    return not url.startswith("pipe:") and "://" not in url or url.startswith("file://")


def expand_urls(spec: str | list[str]) -> list[str]:
    """Brace-expand one pattern or a list of them (``a/{00000..00003}.tar`` -> 4 URLs)."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    return [url for item in specs for url in braceexpand(item)]


def options_for(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """fsspec options for ``url``: ``storage_options`` itself, or its entry for the URL's protocol when it is
    keyed by protocol (``{"s3": {"endpoint_url": ...}, "https": {...}}``); none for local paths."""
    if is_local(url) or not storage_options:
        return {}
    protocol = url.split("://", 1)[0]
    if all(isinstance(v, dict) for v in storage_options.values()):
        return dict(storage_options.get(protocol, {}))
    return dict(storage_options)


def _open(url: str, storage_options: dict[str, Any]) -> Any:
    return fsspec.open(url, "rb", **options_for(url, storage_options))


def _read_json(url: str, storage_options: dict[str, Any]) -> dict[str, Any] | None:
    """A small JSON file, or ``None`` if it does not exist."""
    try:
        with _open(url, storage_options) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def stats_url(shard_url: str) -> str:
    """img2dataset's per-shard statistics file: ``00000.tar`` -> ``00000_stats.json``."""
    stem = shard_url[: -len(".tar")] if shard_url.endswith(".tar") else shard_url
    return stem + "_stats.json"


def _exists(url: str, storage_options: dict[str, Any]) -> bool:
    if url.startswith("pipe:"):
        return True  # only running the command can tell
    fs, path = fsspec.core.url_to_fs(url, **options_for(url, storage_options))
    return fs.exists(path)


def list_shards(
    spec: str | list[str], storage_options: dict[str, Any] | None = None, cache_dir: str | None = None
) -> list[ShardInfo]:
    """Resolve a shard spec to shards with sample counts.

    Counts come from a wids descriptor (``.json``), else from each shard's ``_stats.json``, else from indexing
    the shard itself (remote shards are fetched for that).

    Raises:
        ShardError: a shard (or the descriptor) does not exist, or a count cannot be determined.
    """
    options = storage_options or {}
    if isinstance(spec, str) and spec.endswith(".json"):
        descriptor = _read_json(spec, options)
        if descriptor is None:
            raise ShardError(f"shard list {spec!r} not found")
        base = posixpath.dirname(spec)
        shards = [
            ShardInfo(_join(base, item["url"]), int(item["nsamples"])) for item in descriptor["shardlist"]
        ]
    else:
        urls = expand_urls(spec)
        if not urls:
            raise ShardError(f"no shards in {spec!r}")
        with ThreadPoolExecutor(16) as pool:
            shards = list(pool.map(lambda url: _info_from_stats(url, options, cache_dir), urls))
    with ThreadPoolExecutor(16) as pool:
        missing = [
            s.url
            for s, ok in zip(shards, pool.map(lambda s: _exists(s.url, options), shards), strict=True)
            if not ok
        ]
    if missing:
        raise ShardError(f"{len(missing)} shard(s) not found, first: {missing[0]!r}")
    return shards


def _join(base: str, url: str) -> str:
    if "://" in url or url.startswith(("pipe:", "/")) or not base:
        return url
    return f"{base}/{url}"


def _info_from_stats(url: str, options: dict[str, Any], cache_dir: str | None) -> ShardInfo:
    stats = None if url.startswith("pipe:") else _read_json(stats_url(url), options)
    if stats is not None and "successes" in stats:
        return ShardInfo(url, int(stats["successes"]))
    if not url.startswith("pipe:") and not _exists(url, options):
        raise ShardError(f"shard {url!r} not found")
    cache = ShardCache(options, cache_dir, capacity=1)
    return ShardInfo(url, len(cache.get(url)))


def _default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"mm_lightning_shards_{os.getuid()}")


class ShardCache:
    """Per-process LRU of opened (indexed) shards; remote ones are fetched into ``cache_dir`` first.

    wids' own ``LRUShards`` fetches through curl / the aws CLI (no endpoint or credentials options) and never
    deletes what it fetched; fsspec covers every protocol with ``storage_options``, and evicted remote copies
    are unlinked here (processes that still map the file keep reading it), so disk use stays bounded.

    Args:
        storage_options: fsspec options for remote URLs (e.g. ``{"endpoint_url": ...}`` for S3).
        cache_dir: where remote shards are fetched to (default: a folder in the system temp dir).
        capacity: shards kept open per process (each holds one file descriptor and one mmap).
    """

    def __init__(
        self, storage_options: dict[str, Any] | None, cache_dir: str | None, capacity: int = 8
    ) -> None:
        self.storage_options = storage_options or {}
        self.cache_dir = cache_dir or _default_cache_dir()
        self.lru = LRUCache(capacity, release_handler=self._release)
        self.broken: dict[str, ShardError] = {}
        self.fetches = 0

    def get(self, url: str) -> IndexedTarSamples:
        """The opened shard (raises :class:`ShardError`, remembered for damaged shards: no refetch loop)."""
        if url in self.broken:
            raise self.broken[url]
        shard = self.lru[url]
        if shard is None:
            try:
                shard = self._open(url)
            except ShardError as err:
                if not err.missing:
                    self.broken[url] = err
                raise
            self.lru[url] = shard
        return shard

    def _open(self, url: str) -> IndexedTarSamples:
        path = url.removeprefix("file://") if is_local(url) else self._fetch(url)
        try:
            return IndexedTarSamples(path=path)
        except FileNotFoundError as err:
            raise ShardError(f"shard {url!r} not found", missing=True) from err
        except Exception as err:  # noqa: BLE001  (any parse failure of a damaged tar means the same thing)
            raise ShardError(
                f"shard {url!r} is truncated or not a tar file ({type(err).__name__}: {err})"
            ) from err

    def _fetch(self, url: str) -> str:
        os.makedirs(self.cache_dir, exist_ok=True)
        name = hashlib.blake2b(url.encode(), digest_size=12).hexdigest() + ".tar"
        local = os.path.join(self.cache_dir, name)
        if os.path.exists(local):
            return local
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", dir=self.cache_dir)
        try:
            with os.fdopen(fd, "wb") as out:
                if url.startswith("pipe:"):
                    done = subprocess.run(url[5:], shell=True, stdout=out, stderr=subprocess.PIPE)
                    if done.returncode:
                        raise ShardError(
                            f"shard {url!r}: command exited {done.returncode}: {done.stderr.decode()[-500:]}"
                        )
                else:
                    with _open(url, self.storage_options) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
            os.replace(tmp, local)  # atomic: workers sharing the cache never see a partial file
        except FileNotFoundError as err:
            raise ShardError(f"shard {url!r} not found", missing=True) from err
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.fetches += 1
        return local

    def _release(self, url: str, shard: IndexedTarSamples) -> None:
        shard.close()
        if not is_local(url):
            local = shard.path
            if local and os.path.exists(local):
                os.unlink(local)

    def __len__(self) -> int:
        return len(self.lru)

    def close(self) -> None:
        self.lru.clear()


def captions_of(sample: dict[str, Any], text_key: str) -> list[str]:
    """Captions of one shard sample: ``.json[text_key]`` (string or list) if present, else ``.txt``."""
    meta = sample.get(".json")
    if meta is not None:
        obj = json.loads(meta.getvalue())
        if isinstance(obj, dict) and text_key in obj:
            value = obj[text_key]
            captions = value if isinstance(value, list) else [value]
            return _checked(captions)
    text = sample.get(".txt")
    if text is None:
        raise ValueError(f"no caption: neither .json[{text_key!r}] nor a .txt member")
    return _checked([text.getvalue().decode("utf-8")])


def _checked(captions: list[Any]) -> list[str]:
    if not captions:
        raise ValueError("caption list is empty")
    for caption in captions:
        if not isinstance(caption, str):
            raise ValueError(f"caption must be a string, got {type(caption).__name__}")
        if not caption.strip():
            raise ValueError("caption is empty")
    return captions


def image_member(sample: dict[str, Any]) -> tuple[str, bytes]:
    for ext in IMAGE_EXTENSIONS:
        if ext in sample:
            return ext, sample[ext].getvalue()
    members = sorted(k for k in sample if k.startswith("."))
    raise ValueError(f"no image member (members: {members})")


class ShardDataset(Dataset):
    """Map-style image-caption dataset over shards: one item per sample (``caption_sampling="random"``) or per
    (sample, caption) pair (``"all"``, evaluation). Yields the same dicts as the JSONL dataset.

    Args:
        shards: the shards, in order (sample ``i`` of the dataset is found by the cumulative counts).
        transform: uint8 image transform.
        text_key: ``.json`` entry holding the captions (falls back to ``.txt``).
        caption_sampling: ``"random"`` or ``"all"`` (needs a pass over the captions at construction).
        on_bad_record: ``"raise"``: a bad sample raises, naming shard, key and reason; ``"skip"``: it is replaced
            by the next valid one and counted. A missing shard always raises.
        max_pixels: decompression-bomb guard.
        min_side: allow reduced-size JPEG decoding down to this shorter side.
        storage_options: fsspec options for remote shards.
        cache_dir: local folder remote shards are fetched to.
        open_shards: shards kept open per process.
        max_replacements: give up after this many consecutive bad items under ``"skip"``.
        seed: base seed of the per-batch augmentation seeding (default: ``PL_GLOBAL_SEED``).
    """

    def __init__(
        self,
        shards: list[ShardInfo],
        transform: Callable[[torch.Tensor], torch.Tensor],
        text_key: str = "text",
        caption_sampling: Literal["random", "all"] = "random",
        on_bad_record: Literal["raise", "skip"] = "raise",
        max_pixels: int | None = None,
        min_side: int | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | None = None,
        open_shards: int = 8,
        max_replacements: int = 64,
        seed: int | None = None,
    ) -> None:
        self.shards, self.transform, self.text_key = shards, transform, text_key
        self.caption_sampling, self.on_bad_record = caption_sampling, on_bad_record
        self.max_pixels, self.min_side, self.max_replacements = max_pixels, min_side, max_replacements
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        self.cache = ShardCache(storage_options, cache_dir, open_shards)
        self.sample_starts = np.concatenate([[0], np.cumsum([s.nsamples for s in shards])]).astype(np.int64)
        self.pair_sample = self.pair_pos = None
        if caption_sampling == "all":
            self.pair_sample, self.pair_pos = self._index_captions()

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
        samples, positions = [], []
        for sample in range(self.num_samples):
            try:
                count = len(captions_of(self._raw(sample)[0], self.text_key))
            except (RecordError, ValueError, UnicodeDecodeError) as err:
                if self.on_bad_record == "raise":
                    raise self._error(sample, str(err)) from err
                count = 1  # the pair is replaced (and counted) when loaded
            samples.extend([sample] * count)
            positions.extend(range(count))
        return np.asarray(samples, dtype=np.int64), np.asarray(positions, dtype=np.int32)

    def locate(self, sample: int) -> tuple[int, int]:
        """(shard number, position in the shard) of a global sample index."""
        shard = int(np.searchsorted(self.sample_starts, sample, side="right")) - 1
        return shard, sample - int(self.sample_starts[shard])

    def _raw(self, sample: int) -> tuple[dict[str, Any], str]:
        shard_no, pos = self.locate(sample)
        info = self.shards[shard_no]
        try:
            tar = self.cache.get(info.url)
        except ShardError as err:
            if err.missing:
                raise  # a missing shard is never a skip
            raise RecordError(info.url, pos + 1, str(err)) from err
        if pos >= len(tar):
            raise RecordError(
                info.url,
                pos + 1,
                f"shard is truncated: it holds {len(tar)} samples, its listing says {info.nsamples}",
            )
        return tar[pos], info.url

    def _error(self, sample: int, reason: str, key: str | None = None) -> RecordError:
        shard_no, pos = self.locate(sample)
        return RecordError(self.shards[shard_no].url, pos + 1, reason, key)

    def load(self, item: int) -> dict[str, Any]:
        """Load one item or raise :class:`RecordError` naming shard, sample number, key and reason."""
        sample, pos = (
            (item, None) if self.pair_sample is None else (self.pair_sample[item], self.pair_pos[item])
        )
        raw, url = self._raw(int(sample))
        key = raw.get("__key__")
        try:
            captions = captions_of(raw, self.text_key)
            ext, data = image_member(raw)
            image = decode_image_bytes(data, max_pixels=self.max_pixels, min_side=self.min_side)
        except (ValueError, UnicodeDecodeError, ImageDecodeError) as err:
            raise self._error(int(sample), str(err), key) from err
        if pos is None:
            # torch's RNG, seeded per batch by __getitems__ (draws differ across batches and epochs).
            pos = int(torch.randint(len(captions), ()).item()) if len(captions) > 1 else 0
        elif pos >= len(captions):
            raise self._error(int(sample), "captions changed since the dataset was indexed", key)
        return {
            "image": self.transform(image),
            "caption": captions[pos],
            "image_id": int(sample),
            "index": item,
        }

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        """A whole batch, its random draws seeded by the batch's own indices (replayable after a resume)."""
        seed = zlib.crc32(np.asarray(items, dtype=np.int64).tobytes(), self.seed & 0xFFFFFFFF)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return [self[item] for item in items]

    def __getitem__(self, item: int) -> dict[str, Any]:
        reasons: list[str] = []
        for attempt in range(self.max_replacements + 1):
            # Forward walk (stays in the same open shard), then growing hops that leave a damaged region
            # (a truncated shard's missing tail) within a few attempts; deterministic, so ranks agree.
            offset = attempt if attempt <= 8 else 2 ** (attempt - 5)
            candidate = (item + offset) % len(self)
            try:
                sample = self.load(candidate)
            except RecordError as err:
                if self.on_bad_record == "raise":
                    raise
                reasons.append(str(err))
                continue
            sample["num_skipped"], sample["skip_reasons"] = len(reasons), reasons
            return sample
        raise RuntimeError(
            f"{self.max_replacements + 1} consecutive bad records from item {item}; first: {reasons[0]}"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Workers open their own shards (file descriptors and mmaps are per process).
        state["cache"] = ShardCache(self.cache.storage_options, self.cache.cache_dir, self.cache.lru.capacity)
        return state
