"""JSONL + image files -> WebDataset shards in img2dataset's layout (``python -m mm_lightning shard``).

    python -m mm_lightning shard --config configs/base.yaml --out shards/ --samples_per_shard 10000

For each split of the config's ``data`` section this writes ``<out>/<split>/00000.tar ...`` (members
``{key}.jpg|png|...``, ``{key}.txt`` = first caption, ``{key}.json`` = ``{"key", "text": [captions], "line",
"image"}``), ``00000_stats.json`` per shard (img2dataset's fields: ``count``, ``successes``, ``failed_to_resize``,
``status_dict``, ...) and ``shards.json`` (wids' shard list with sample counts), which training reads directly:
``--data.init_args.train_shards <out>/train/shards.json``. Shards are written in parallel by a process pool (webdataset's
``TarWriter``), each to a temporary name renamed when complete; a rerun keeps every finished shard whose input
lines are unchanged (resumable). Images are copied byte for byte (``--image_format copy``) or re-encoded as JPEG.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from PIL import Image
from tqdm import tqdm
from webdataset import TarWriter

from mm_lightning.data.images import (
    DEFAULT_MAX_PIXELS,
    ImageDecodeError,
    decode_image_bytes,
    pil_guard_lifted,
)
from mm_lightning.data.jsonl import RecordParser
from mm_lightning.data.pools import process_pool, splits_with_files
from mm_lightning.data.records import RecordError

ImageFormat = Literal["copy", "jpg"]
DESCRIPTOR = "shards.json"


@dataclass(frozen=True)
class ShardJob:
    """One shard to write: its number, the records (line, image path, captions) and the options."""

    number: int
    records: tuple[tuple[int, str, tuple[str, ...]], ...]
    out_dir: str
    source: str
    key_digits: int
    image_format: ImageFormat
    jpeg_quality: int
    validate: bool
    max_pixels: int | None
    on_bad_record: str

    def fingerprint(self) -> str:
        """Changes when the shard's input or options change (a rerun then rewrites it)."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr((self.records, self.image_format, self.jpeg_quality, self.validate)).encode())
        return digest.hexdigest()

    @property
    def stem(self) -> str:
        return os.path.join(self.out_dir, f"{self.number:05d}")


def _encoded_image(path: str, job: ShardJob) -> tuple[str, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    if job.validate or job.image_format == "jpg":
        decode_image_bytes(data, max_pixels=job.max_pixels)  # raises ImageDecodeError with the reason
    if job.image_format == "copy":
        ext = os.path.splitext(path)[1].lower().lstrip(".") or "jpg"
        return ("jpg" if ext == "jpeg" else ext), data
    with pil_guard_lifted(), Image.open(io.BytesIO(data)) as img:  # size checked by the decode above
        out = io.BytesIO()
        img.convert("RGB").save(out, format="JPEG", quality=job.jpeg_quality)
    return "jpg", out.getvalue()


def write_json_atomically(path: str, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` through a temporary file of its own in the same folder, then renames it.

    A temporary name per writer: two processes preparing the same data (two runs sharing a data folder) each
    rename a complete file of their own; with one shared ``.tmp`` name the second rename found it gone.
    """
    fd, tmp = tempfile.mkstemp(
        prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path) or "."
    )
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f, indent=1)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the file from others sharing the data
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_one_shard(job: ShardJob) -> dict[str, Any]:
    """Write one shard (+ its stats) unless an identical one exists; returns its stats."""
    stats_path = job.stem + "_stats.json"
    fingerprint = job.fingerprint()
    if os.path.exists(job.stem + ".tar") and os.path.exists(stats_path):
        with open(stats_path) as f:
            stats = json.load(f)
        if stats.get("fingerprint") == fingerprint:
            return {**stats, "reused": True}
    start = time.time()
    status: Counter = Counter()
    failures: list[str] = []
    tmp = job.stem + ".tar.tmp"
    with TarWriter(tmp) as sink:
        for i, (line, path, captions) in enumerate(job.records):
            key = f"{job.number:05d}{i:0{job.key_digits}d}"
            try:
                ext, data = _encoded_image(path, job)
            except (OSError, ImageDecodeError) as err:
                reason = getattr(err, "strerror", None) or str(err)
                kind = "missing_image" if isinstance(err, FileNotFoundError) else "undecodable_image"
                error = RecordError(job.source, line, f"image not written: {reason}", path, kind=kind)
                if job.on_bad_record == "raise":
                    sink.close()
                    os.unlink(tmp)
                    raise error from err
                status[type(err).__name__] += 1
                if len(failures) < 20:
                    failures.append(str(error))
                continue
            meta = {"key": key, "text": list(captions), "line": line, "image": path}
            sink.write({"__key__": key, ext: data, "txt": captions[0], "json": json.dumps(meta).encode()})
            status["success"] += 1
    os.replace(tmp, job.stem + ".tar")
    stats = {
        "count": len(job.records),
        "successes": status["success"],
        "failed_to_download": 0,
        "failed_to_resize": len(job.records) - status["success"],
        "duration": time.time() - start,
        "status_dict": dict(status),
        "failures": failures,
        "source": job.source,
        "fingerprint": fingerprint,
    }
    write_json_atomically(stats_path, stats)  # written last: its presence marks the shard complete
    return {**stats, "reused": False}


def _count_lines(path: str) -> int:
    """Non-blank lines of a file (records before validation), for the progress bar's total."""
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def _chunks(
    parser: RecordParser, samples_per_shard: int, on_bad_record: str, skipped: list[str]
) -> Iterator[tuple[tuple[int, str, tuple[str, ...]], ...]]:
    chunk: list[tuple[int, str, tuple[str, ...]]] = []
    with open(parser.file, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = parser.parse(raw, line_no)
            except RecordError as err:
                if on_bad_record == "raise":
                    raise
                skipped.append(str(err))
                continue
            chunk.append((line_no, record.image, tuple(record.captions)))
            if len(chunk) == samples_per_shard:
                yield tuple(chunk)
                chunk = []
    if chunk:
        yield tuple(chunk)


@dataclass
class ShardSummary:
    """What :func:`write_shards` did."""

    out_dir: str
    shards: int
    samples: int
    written: int
    reused: int
    skipped_lines: int
    failed_images: int
    descriptor: str


def write_shards(
    parser: RecordParser,
    out_dir: str,
    samples_per_shard: int = 10000,
    image_format: ImageFormat = "copy",
    jpeg_quality: int = 95,
    validate: bool = True,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    on_bad_record: str = "raise",
    workers: int | None = None,
    progress: bool = True,
) -> ShardSummary:
    """Convert one JSONL file (parsed and validated by ``parser``) into shards in ``out_dir``.

    Args:
        parser: the split's record parser (file, keys, image root, confinement), as training uses it.
        out_dir: output folder (created).
        samples_per_shard: records per shard (the last one may be smaller).
        image_format: ``"copy"`` keeps the original bytes; ``"jpg"`` re-encodes as JPEG.
        jpeg_quality: JPEG quality when re-encoding.
        validate: decode every image before writing it (bad images never reach a shard).
        max_pixels: decompression-bomb guard used by the validation.
        on_bad_record: ``"raise"`` stops at the first bad line or image (file, line, reason); ``"skip"`` leaves it
            out and counts it (shard stats and the summary).
        workers: writer processes (default: CPU count).
        progress: show a progress bar.

    Returns:
        A :class:`ShardSummary`; ``<out_dir>/shards.json`` lists the shards with their sample counts.
    """
    if samples_per_shard < 1:
        raise ValueError("samples_per_shard must be >= 1")
    os.makedirs(out_dir, exist_ok=True)
    key_digits = max(1, math.ceil(math.log10(samples_per_shard)))
    skipped: list[str] = []
    workers = workers or os.cpu_count() or 1
    results: dict[int, dict[str, Any]] = {}
    bar = tqdm(
        desc=f"shard {os.path.basename(parser.file)}",
        total=-(-_count_lines(parser.file) // samples_per_shard) if progress else None,  # bad lines: fewer
        unit=" shards",
        disable=not progress,
    )
    with process_pool(workers, preload=[__name__]) as pool:
        pending: dict[int, Future] = {}
        for number, records in enumerate(_chunks(parser, samples_per_shard, on_bad_record, skipped)):
            job = ShardJob(
                number, records, out_dir, parser.file, key_digits, image_format, jpeg_quality, validate,
                max_pixels, on_bad_record,
            )  # fmt: skip
            pending[number] = pool.submit(write_one_shard, job)
            while len(pending) >= 2 * workers:  # bounded memory: records of at most 2 shards per worker
                _collect(pending, results, bar)
        while pending:
            _collect(pending, results, bar)
    bar.close()
    shardlist = []
    for number in sorted(results):
        name = f"{number:05d}.tar"
        size = os.path.getsize(os.path.join(out_dir, name))
        shardlist.append({"url": name, "nsamples": results[number]["successes"], "filesize": size})
    descriptor = os.path.join(out_dir, DESCRIPTOR)
    write_json_atomically(
        descriptor, {"__kind__": "wids-shard-index-v1", "name": parser.file, "shardlist": shardlist}
    )
    return ShardSummary(
        out_dir=out_dir,
        shards=len(shardlist),
        samples=sum(s["nsamples"] for s in shardlist),
        written=sum(not r["reused"] for r in results.values()),
        reused=sum(r["reused"] for r in results.values()),
        skipped_lines=len(skipped),
        failed_images=sum(r["failed_to_resize"] for r in results.values()),
        descriptor=descriptor,
    )


def _collect(pending: dict[int, Future], results: dict[int, dict[str, Any]], bar: tqdm) -> None:
    number = next(iter(pending))
    results[number] = pending.pop(number).result()  # re-raises a worker's RecordError (file, line, reason)
    bar.update(1)


@dataclass
class ShardOptions:
    """Options of ``python -m mm_lightning shard``.

    Args:
        out: Output folder; each split goes to ``<out>/<split>/``.
        samples_per_shard: Records per shard (the last shard of a split may be smaller).
        splits: Splits of the config's ``data`` section to convert (those without a JSONL file are skipped).
        image_format: ``copy`` keeps each image's bytes; ``jpg`` re-encodes as JPEG.
        jpeg_quality: JPEG quality when re-encoding.
        validate: Decode every image while writing, so bad images never reach a shard.
        workers: Writer processes (default: every CPU).
        progress: Show a progress bar.
    """

    out: str = "shards"
    samples_per_shard: int = 10000
    splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    image_format: ImageFormat = "copy"
    jpeg_quality: int = 95
    validate: bool = True
    workers: int | None = None
    progress: bool = True


def shard_datamodule(dm: Any, options: ShardOptions) -> dict[str, ShardSummary]:
    """Convert every JSONL split of a :class:`~mm_lightning.data.MultimodalDataModule` (``prepare_data`` first,
    so the demo generates its data) with the datamodule's own parser, image root and ``on_bad_record``."""
    dm.prepare_data()
    summaries = {}
    for split in splits_with_files(dm.files, options.splits, "shard"):
        summary = write_shards(
            dm.record_parser(split),
            os.path.join(options.out, split),
            options.samples_per_shard,
            options.image_format,
            options.jpeg_quality,
            options.validate,
            dm.image_options.max_pixels,
            dm.hparams.on_bad_record,
            options.workers,
            options.progress,
        )
        summaries[split] = summary
        print(
            f"shard: {split}: {summary.samples} samples in {summary.shards} shards ({summary.written} written, "
            f"{summary.reused} reused), {summary.skipped_lines} bad lines and {summary.failed_images} bad images "
            f"left out; read it with --data.init_args.{split}_shards {summary.descriptor}"
        )
    return summaries
