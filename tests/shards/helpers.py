"""Shards for the tests: img2dataset's layout (``{key}.jpg``, ``.txt``, ``.json``, ``_stats.json``), uneven sizes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image
from webdataset import TarWriter

from mm_lightning.data.images import decode_image_bytes
from mm_lightning.data.samples import BadRecordPolicy, SampleBuilder
from mm_lightning.extras.shards.dataset import ShardDataset
from mm_lightning.extras.shards.files import list_shards
from tests.conftest import REPO, tiny_demo_args
from tests.data.helpers import natural_array

CAPTIONS_PER_SAMPLE = 2


def jpeg_bytes(seed: int, size: tuple[int, int] = (40, 32)) -> bytes:
    out = io.BytesIO()
    Image.fromarray(natural_array(size[1], size[0], seed)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def large_jpeg_bytes(megabytes: float = 6.0) -> bytes:
    """A noise JPEG of about ``megabytes`` (larger than fsspec's 5 MB HTTP block, so a ranged reader needs
    more than one request for a shard that holds it)."""
    side = int(1600 * (megabytes / 2.86) ** 0.5)  # 1600 x 1600 noise at quality 95 is 2.86 MB
    noise = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(noise).save(out, format="JPEG", quality=95)
    return out.getvalue()


def caption(sample: int, j: int) -> str:
    return f"a red circle number {sample} version {j}"


def write_shard(
    path: Path, first: int, count: int, broken: dict[int, bytes] | None = None, stats: bool = True
) -> Path:
    """Samples ``first .. first+count-1``; ``broken`` replaces some images' bytes. Writes ``_stats.json``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with TarWriter(str(path)) as sink:
        for n in range(first, first + count):
            key = f"{n:09d}"
            meta = {"key": key, "text": [caption(n, j) for j in range(CAPTIONS_PER_SAMPLE)]}
            image = (broken or {}).get(n, jpeg_bytes(n))
            sink.write(
                {"__key__": key, "jpg": image, "txt": caption(n, 0), "json": json.dumps(meta).encode()}
            )
    if stats:
        stem = str(path)[: -len(".tar")]
        Path(stem + "_stats.json").write_text(json.dumps({"count": count, "successes": count}))
    return path


def uneven_shards(root: Path, sizes: tuple[int, ...] = (7, 3, 11, 5), **kwargs: object) -> str:
    """Shards ``root/00000.tar ...`` with the given sample counts; returns the brace pattern."""
    first = 0
    for i, size in enumerate(sizes):
        write_shard(root / f"{i:05d}.tar", first, size, **kwargs)  # type: ignore[arg-type]
        first += size
    return str(root / f"{{00000..{len(sizes) - 1:05d}}}.tar")


def shard_demo_args(
    root: Path, *extra: str, max_steps: int = 6, callbacks: dict[str, dict | None] | None = None
) -> list[str]:
    """:func:`tests.conftest.tiny_demo_args` with ``configs/shards.yaml`` stacked right after the demo config
    (so the run's own log and checkpoint folders, given later, still win)."""
    args = tiny_demo_args(root, *extra, max_steps=max_steps, callbacks=callbacks)
    return [*args[:2], "--config", str(REPO / "configs" / "shards.yaml"), *args[2:]]


def shard_dataset(
    spec: str | list[str],
    transform: object = None,
    on_bad_record: str = "raise",
    storage_options: dict | None = None,
    **kwargs: object,
) -> ShardDataset:
    """A :class:`ShardDataset` with the datamodule's pieces (bytes decoder, bad-record policy)."""
    return ShardDataset(
        list_shards(spec, storage_options, kwargs.get("cache_dir")),  # type: ignore[arg-type]
        SampleBuilder(transform, decode_bytes=decode_image_bytes),  # type: ignore[arg-type]
        policy=BadRecordPolicy(on_bad_record),  # type: ignore[arg-type]
        storage_options=storage_options,
        **kwargs,  # type: ignore[arg-type]
    )
