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
mmap) so that sample ``i`` is a pure lookup. A map-style dataset lets the sampler (:mod:`.mixing`) decide
the order from ``(seed, epoch)`` alone: every rank gets the same number of batches whatever the shard sizes,
and a resume mid-epoch skips indices, not re-reading a stream. Remote shards
are fetched whole (fsspec, so S3 endpoints and credentials come from ``storage_options``) into a local cache,
a bounded number at a time per process, and removed again when evicted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec
from braceexpand import braceexpand
from wids.wids import IndexedTarSamples
from wids.wids_dl import ULockFile
from wids.wids_lru import LRUCache

from mm_lightning import ExplainedError


class ShardError(ExplainedError, RuntimeError):
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


# Whole files only, never ranges: fsspec's random-access HTTP file needs ``Range`` support past its first block
# (5 MB), which ``python -m http.server``, many proxies and presigned-URL setups lack. ``cat_file``/``get_file``
# are one plain streamed GET over HTTP (``get_object`` on S3) and what a whole-shard fetch needs anyway.
def _read_bytes(url: str, storage_options: dict[str, Any]) -> bytes:
    fs, path = fsspec.core.url_to_fs(url, **options_for(url, storage_options))
    return fs.cat_file(path)


def _read_json(url: str, storage_options: dict[str, Any]) -> dict[str, Any] | None:
    """A small JSON file, or ``None`` if it does not exist."""
    try:
        return json.loads(_read_bytes(url, storage_options))
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
        try:
            descriptor = _read_json(spec, options)
        except ValueError as err:
            raise ShardError(f"shard list {spec!r} is not valid JSON ({err})") from err
        if descriptor is None:
            raise ShardError(f"shard list {spec!r} not found", missing=True)
        base = posixpath.dirname(spec)
        try:
            shards = [
                ShardInfo(_join(base, item["url"]), int(item["nsamples"])) for item in descriptor["shardlist"]
            ]
        except (KeyError, TypeError, ValueError) as err:
            raise ShardError(
                f"shard list {spec!r}: expected {{'shardlist': [{{'url': ..., 'nsamples': ...}}]}} ({err!r})"
            ) from err
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
        raise ShardError(f"{len(missing)} shard(s) not found, first: {missing[0]!r}", missing=True)
    return shards


def _join(base: str, url: str) -> str:
    if "://" in url or url.startswith(("pipe:", "/")) or not base:
        return url
    return f"{base}/{url}"


def _info_from_stats(url: str, options: dict[str, Any], cache_dir: str | None) -> ShardInfo:
    try:
        stats = None if url.startswith("pipe:") else _read_json(stats_url(url), options)
    except ValueError:  # an unreadable stats file: count the samples instead
        stats = None
    if isinstance(stats, dict) and isinstance(stats.get("successes"), int):
        return ShardInfo(url, stats["successes"])
    if not url.startswith("pipe:") and not _exists(url, options):
        raise ShardError(f"shard {url!r} not found", missing=True)
    cache = ShardCache(options, cache_dir, capacity=1)
    return ShardInfo(url, len(cache.get(url)))


def _received(path: str) -> str:
    """What a file that should be a tar holds, for the error message (an HTML error page, an empty body...)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(60)
    except OSError:
        return ""
    text = head.decode("utf-8", "replace")
    looks_like_text = head and all(c.isprintable() or c.isspace() for c in text)
    start = f", starting {text.strip()[:60]!r}" if looks_like_text else ""
    return f"; got {size} bytes{start}"


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
                f"shard {url!r} is truncated or not a tar file ({type(err).__name__}: {err}){_received(path)}"
            ) from err

    def _fetch(self, url: str) -> str:
        os.makedirs(self.cache_dir, exist_ok=True)
        name = hashlib.blake2b(url.encode(), digest_size=12).hexdigest() + ".tar"
        local = os.path.join(self.cache_dir, name)
        # Workers of a rank reach the same shard at about the same time: one fetches, the others wait for it.
        with ULockFile(local + ".lock"):
            if not os.path.exists(local):
                self._download(url, local)
        return local

    def _download(self, url: str, local: str) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", dir=self.cache_dir)
        try:
            if url.startswith("pipe:"):
                with os.fdopen(fd, "wb") as out:
                    done = subprocess.run(url[5:], shell=True, stdout=out, stderr=subprocess.PIPE)
                if done.returncode:
                    raise ShardError(  # no tar to read: as final as a missing shard
                        f"shard {url!r}: command exited {done.returncode}: {done.stderr.decode()[-500:]}",
                        missing=True,
                    )
            else:
                os.close(fd)
                fs, path = fsspec.core.url_to_fs(url, **options_for(url, self.storage_options))
                fs.get_file(path, tmp)  # streamed whole (see _read_bytes): no range requests
            os.replace(tmp, local)  # atomic: workers sharing the cache never see a partial file
        except FileNotFoundError as err:
            raise ShardError(f"shard {url!r} not found", missing=True) from err
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.fetches += 1

    def _release(self, url: str, shard: IndexedTarSamples) -> None:
        shard.close()
        if not is_local(url) and shard.path:
            # Processes that still map the file keep reading it; the next one to need it fetches it again.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shard.path)

    def __len__(self) -> int:
        return len(self.lru)

    def close(self) -> None:
        self.lru.clear()

    def fresh(self) -> ShardCache:
        """An empty cache with the same settings (for another process: descriptors and mmaps do not travel)."""
        return ShardCache(self.storage_options, self.cache_dir, self.lru.capacity)
