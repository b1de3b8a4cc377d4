"""Audit of shard splits: every sample through the checks training applies, one process per shard.

Called by :func:`mm_lightning.data.audit.audit` for splits a :class:`ShardDataModule` reads from shards; the
split report has the same fields as a JSONL split's (bad records by kind with examples naming the shard, the
sample key and the reason; image sizes, modes and duplicates; caption lengths and duplicates).
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from typing import Any

from tqdm import tqdm

from mm_lightning.data.pools import process_pool
from mm_lightning.data.records import RecordError
from mm_lightning.data.sources.shard_dataset import ShardDataset
from mm_lightning.data.sources.shards import ShardError

EXAMPLES = 10


def check_shard(dataset: ShardDataset, shard: int) -> dict[str, Any]:
    """Check every sample of one shard as training reads it (record, decode, transform)."""
    first, stop = int(dataset.sample_starts[shard]), int(dataset.sample_starts[shard + 1])
    out: dict[str, Any] = {"ok": [], "bad": []}
    for sample in range(first, stop):
        try:
            record = dataset.record(sample)
            image = dataset.builder.decode(record)
            dataset.builder.apply_transform(record, image)
        except RecordError as err:
            out["bad"].append((err.sample or str(sample), err.kind, str(err)))
            continue
        except ShardError as err:  # missing: every sample of the shard is lost
            out["bad"].extend((f"#{n - first + 1}", "missing_image", str(err)) for n in range(first, stop))
            break
        digest = hashlib.blake2b(record.image, digest_size=16).hexdigest()  # type: ignore[arg-type]
        side = min(int(image.shape[-2]), int(image.shape[-1]))
        out["ok"].append((record.image_name, digest, side, record.captions))
    dataset.cache.close()
    return out


def audit_shard_split(
    dataset: ShardDataset, spec: object, workers: int, progress: bool
) -> tuple[dict[str, Any], list[str]]:
    """The image part of a split report plus every valid caption (for the caption report)."""
    bad_lines: Counter = Counter()
    examples: dict[str, list[str]] = defaultdict(list)
    bad_records: list[tuple[str, str]] = []
    by_hash: dict[str, list[str]] = defaultdict(list)
    sides: list[int] = []
    captions: list[str] = []
    shards = range(len(dataset.shards))
    with process_pool(workers) as pool:
        results = tqdm(
            pool.map(check_shard, [dataset] * len(shards), shards),
            total=len(shards),
            desc="audit: reading shards",
            disable=not progress,
        )
        for shard, result in zip(shards, results, strict=True):
            for key, kind, message in result["bad"]:
                bad_lines[kind] += 1
                bad_records.append((f"{dataset.shards[shard].url} {key}", kind))
                if len(examples[kind]) < EXAMPLES:
                    examples[kind].append(message)
            for name, digest, side, caps in result["ok"]:
                by_hash[digest].append(f"{dataset.shards[shard].url}:{name}")
                sides.append(side)
                captions.extend(caps)
    from mm_lightning.data.audit import SIZE_BUCKETS, histogram

    errors = sum(bad_lines.values())
    report = {
        "file": str(spec),
        "shards": len(dataset.shards),
        "records": dataset.num_samples,
        "valid_records": dataset.num_samples - errors,
        "errors": errors,
        "bad_lines": dict(bad_lines),
        "examples": dict(examples),
        "bad_records": sorted(bad_records),
        "images": dataset.num_samples,
        "missing_images": bad_lines["missing_image"],
        "undecodable_images": bad_lines["undecodable_image"],
        "duplicate_images_by_content": sum(len(v) - 1 for v in by_hash.values() if len(v) > 1),
        "duplicate_image_examples": [v for v in by_hash.values() if len(v) > 1][:EXAMPLES],
        "image_short_side_histogram": histogram(sides, SIZE_BUCKETS),
    }
    return report, captions
