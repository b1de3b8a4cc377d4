"""Data audit: verify image-text data before training.

    python -m mm_lightning audit --config configs/base.yaml [--audit.output audit.json] [--audit.max_error_rate 0.01]

Reads the ``data`` section of a training config (other sections are accepted and ignored) and runs every record
through the same checks as training (:class:`~mm_lightning.data.jsonl.RecordParser` for each line,
:class:`~mm_lightning.data.samples.SampleBuilder` for each image, in a process pool), so a record the audit
passes is one ``fit`` accepts and vice versa. Tokenizes every caption and writes a JSON report with bad records
by kind (with examples naming file, line and reason), missing/undecodable images, empty and overlong captions,
duplicate images and captions, and histograms of image size/mode and caption length; then the leakage between
the splits (:mod:`~mm_lightning.commands.leakage`: an image of a later split found in an earlier one by path, by
content or as a near-copy, and the captions two splits share). Splits read from WebDataset
shards are scanned one process per shard (:func:`audit_shards`), with the same fields but the image modes. Exits 1
when errors exceed ``--audit.max_error_rate`` or a split has no valid record, or with
``--audit.fail_on_leakage true`` when an image is in two splits. :func:`run_audit` is the audit,
:func:`main` the command.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image
from tqdm import tqdm

from mm_lightning.commands.leakage import NEAR_COPY_BITS, SplitImages, image_hashes, leakage_report
from mm_lightning.data.collate import load_tokenizer
from mm_lightning.data.datamodule import MultimodalDataModule
from mm_lightning.data.images import ImageDecodeError, pil_guard_lifted
from mm_lightning.data.jsonl import check_utf8
from mm_lightning.data.pools import process_pool, splits_with_files
from mm_lightning.data.records import Record, RecordError
from mm_lightning.data.samples import SampleBuilder

if TYPE_CHECKING:
    from mm_lightning.extras.shards.dataset import ShardDataset

SIZE_BUCKETS = (0, 32, 64, 128, 224, 384, 512, 1024, 2048)
TOKEN_BUCKETS = (0, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
EXAMPLES = 10


def inspect_image(path: str, builder: SampleBuilder) -> dict[str, Any]:
    """Check, decode and transform one image as training does; return its size, mode and content hash, or
    the kind of error and why."""
    record = Record(path, [], "<audit>")
    try:
        image = builder.decode(record)
        builder.apply_transform(record, image)
        with pil_guard_lifted(), Image.open(path) as img:  # the size was checked by the decode above
            mode = img.mode
        with open(path, "rb") as f:
            data = f.read()
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        hashes = image_hashes(data)  # the size was checked by the decode above
    except RecordError as err:
        return {"ok": False, "kind": err.kind, "reason": err.reason}
    except (
        OSError,
        ImageDecodeError,
    ) as err:  # read or hashed after a full decode: the file changed meanwhile
        return {"ok": False, "kind": "undecodable_image", "reason": f"unreadable ({err})"}
    shape = {"height": image.shape[1], "width": image.shape[2]}
    return {"ok": True, **shape, "mode": mode, "hash": digest, "perceptual": hashes}


def histogram(values: list[int], edges: tuple[int, ...]) -> dict[str, int]:
    counts = np.histogram(np.asarray(values, dtype=np.int64), bins=[*edges, np.iinfo(np.int64).max])[0]
    labels = [f"{lo}-{hi - 1}" for lo, hi in zip(edges[:-1], edges[1:], strict=True)] + [f">={edges[-1]}"]
    return {label: int(c) for label, c in zip(labels, counts, strict=True) if c}


@dataclass
class SplitScan:
    """Line-level scan of one split (images are checked afterwards, in parallel)."""

    file: str
    builder: SampleBuilder
    records: int = 0
    bad_lines: Counter = field(default_factory=Counter)  # kind -> bad records
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    images: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))  # path -> line numbers
    captions: list[str] = field(default_factory=list)
    bad_records: list[tuple[int, str]] = field(default_factory=list)  # (line, kind) of every bad record

    def error(self, kind: str, message: str, lines: list[int]) -> None:
        self.bad_lines[kind] += len(lines)
        self.bad_records.extend((line, kind) for line in lines)
        if len(self.examples[kind]) < EXAMPLES:
            self.examples[kind].append(message)


def scan_lines(dm: MultimodalDataModule, split: str) -> SplitScan:
    """Parse and validate every line of ``split`` with the parser training uses."""
    parser = dm.record_parser(split)  # type: ignore[arg-type]
    scan = SplitScan(parser.file, dm.sample_builder(split, parser.confine_root, full_size=True))  # type: ignore[arg-type]
    with open(parser.file, "rb") as f:
        check_utf8(parser.file, f.read(4))  # a UTF-16/32 file is refused as a whole, as training does
        f.seek(0)
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            scan.records += 1
            try:
                record = parser.parse(raw, line_no)
            except RecordError as err:
                scan.error(err.kind, str(err), [line_no])
                continue
            scan.images[record.image].append(line_no)
            scan.captions.extend(record.captions)
    return scan


def caption_report(captions: list[str], tokenizer: str, max_length: int) -> dict[str, Any]:
    tok = load_tokenizer(tokenizer)
    lengths: list[int] = []
    for start in range(0, len(captions), 1024):
        # Full lengths on purpose (to count overlong captions): no "longer than the maximum" warning.
        ids = tok(captions[start : start + 1024], truncation=False, verbose=False)["input_ids"]
        lengths += [len(row) for row in ids]
    counts = Counter(captions)
    return {
        "captions": len(captions),
        "overlong_captions": sum(n > max_length for n in lengths),
        "duplicate_captions": sum(c - 1 for c in counts.values() if c > 1),
        "top_duplicate_captions": [[c, n] for c, n in counts.most_common(EXAMPLES) if n > 1],
        "caption_tokens_histogram": histogram(lengths, TOKEN_BUCKETS),
        "caption_tokens_max": max(lengths, default=0),
    }


def _image_report(scan: SplitScan, results: dict[str, dict[str, Any]], found: SplitImages) -> dict[str, Any]:
    bad_images: Counter = Counter()
    modes: Counter = Counter()
    sides: list[int] = []
    by_hash: dict[str, list[str]] = defaultdict(list)
    for path, lines in scan.images.items():
        res = results[path]
        if not res["ok"]:
            # Every line naming a bad image is a bad record (training skips or stops on each).
            bad_images[res["kind"]] += 1
            scan.error(res["kind"], f"{scan.file}:{lines[0]} (image {path!r}): {res['reason']}", lines)
            continue
        modes[res["mode"]] += 1
        sides.append(min(res["height"], res["width"]))
        by_hash[res["hash"]].append(path)
        found.add(path, res["hash"], res["perceptual"])
    return {
        "images": len(scan.images),
        "missing_images": bad_images["missing_image"],
        "undecodable_images": bad_images["undecodable_image"],
        "lines_sharing_an_image": sum(len(v) - 1 for v in scan.images.values()),
        "duplicate_images_by_content": sum(len(v) - 1 for v in by_hash.values() if len(v) > 1),
        "duplicate_image_examples": [v for v in by_hash.values() if len(v) > 1][:EXAMPLES],
        "image_modes": dict(modes),
        "image_short_side_histogram": histogram(sides, SIZE_BUCKETS),
    }


def audit(
    dm: MultimodalDataModule,
    splits: list[str],
    workers: int,
    progress: bool,
    near_copy_bits: int = NEAR_COPY_BITS,
) -> dict[str, Any]:
    """Scan ``splits`` of ``dm`` and return the report (a JSON-able dict), with the leakage between them."""
    hp = dm.hparams
    # Splits read from WebDataset shards have their own scan (audit_shards).
    shard_splits = [s for s in splits if getattr(dm, "shard_specs", {}).get(s) is not None]
    jsonl_splits = splits_with_files(dm.files, [s for s in splits if s not in shard_splits], "audit")
    scans = {s: scan_lines(dm, s) for s in jsonl_splits}
    # Each split checks its images with its own builder (its own image_root confinement).
    jobs = sorted({(p, s) for s, scan in scans.items() for p in scan.images})
    with process_pool(workers, preload=[__name__]) as pool:
        checked = list(tqdm(
            pool.map(inspect_image, [p for p, _ in jobs], [scans[s].builder for _, s in jobs], chunksize=16),
            total=len(jobs), desc="audit: decoding images", disable=not progress,
        ))  # fmt: skip
    results: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for (path, split), res in zip(jobs, checked, strict=True):
        results[split][path] = res
    report: dict[str, Any] = {"splits": {}}
    total_records = total_errors = 0
    empty = []
    found: dict[str, SplitImages] = {}
    for split, scan in scans.items():
        found[split] = SplitImages(captions=scan.captions)
        images = _image_report(scan, results[split], found[split])
        errors = sum(scan.bad_lines.values())
        if scan.records == errors:
            empty.append(split)
        report["splits"][split] = {
            "file": scan.file,
            "records": scan.records,
            "valid_records": scan.records - errors,
            "errors": errors,
            "bad_lines": dict(scan.bad_lines),
            "examples": dict(scan.examples),
            "bad_records": sorted(scan.bad_records),
            **images,
            **caption_report(scan.captions, hp.tokenizer, hp.max_length),
        }
        total_records, total_errors = total_records + scan.records, total_errors + errors
    for split in shard_splits:
        found[split] = SplitImages()
        rep = report["splits"][split] = audit_shards(dm, split, workers, progress, found[split])
        total_records, total_errors = total_records + rep["records"], total_errors + rep["errors"]
        if rep["records"] == rep["errors"]:
            empty.append(split)
    report["records"], report["errors"] = total_records, total_errors
    report["error_rate"] = total_errors / total_records if total_records else 0.0
    report["splits_without_valid_records"] = empty
    order = [
        s for s in splits if s in found
    ]  # train first: a later split's images are looked for in earlier ones
    report["leakage"] = leakage_report({s: found[s] for s in order}, near_copy_bits)
    return report


def run_audit(
    dm: MultimodalDataModule,
    output: str | None = None,
    max_error_rate: float = 0.0,
    splits: list[str] | tuple[str, ...] = ("train", "val", "test"),
    workers: int | None = None,
    progress: bool = True,
    fail_on_leakage: bool = False,
    near_copy_bits: int = NEAR_COPY_BITS,
) -> dict[str, Any]:
    """Audit ``dm``'s splits, print a summary, optionally write the JSON report; ``report["exit_code"]`` is 1
    when the error rate exceeds ``max_error_rate`` or a split has no valid record (training would stop), or with
    ``fail_on_leakage`` when an image of one split is in another, else 0.

    Args:
        dm: the datamodule (its ``prepare_data`` is called first).
        output: JSON report path, or ``None``.
        max_error_rate: largest accepted (bad records / records).
        splits: splits to scan (those without a file are left out).
        workers: image-decoding processes (default: every CPU).
        progress: show a progress bar.
        fail_on_leakage: exit 1 when an image is in two splits (same path, same content, or a near-copy).
        near_copy_bits: largest perceptual-hash distance of a near-copy.
    """
    dm.prepare_data()
    report = audit(dm, list(splits), workers or os.cpu_count() or 1, progress, near_copy_bits)
    report["max_error_rate"] = max_error_rate
    leaked = report["leakage"]["images_leaked"] > 0
    failed = report["error_rate"] > max_error_rate or bool(report["splits_without_valid_records"])
    report["fail_on_leakage"] = fail_on_leakage
    report["exit_code"] = int(failed or (fail_on_leakage and leaked))
    if output is not None:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(report, f, indent=2)
    print(
        f"audit: {report['records']} records, {report['errors']} errors "
        f"(rate {report['error_rate']:.4f}, max {max_error_rate})" + (f"; report: {output}" if output else "")
    )
    for split, rep in report["splits"].items():
        print(
            f"  {split}: {rep['records']} records, {rep['images']} images, bad {rep['bad_lines'] or 'none'}, "
            f"overlong captions {rep['overlong_captions']}, duplicate captions {rep['duplicate_captions']}"
        )
        first = [
            messages[0] for messages in rep["examples"].values() if messages
        ]  # file:line: reason, a kind each
        for message in first:
            print(f"    {message}")
        if rep["errors"] > len(first):
            where = f"every one in {output}" if output else "--audit.output FILE lists every one"
            print(f"    and {rep['errors'] - len(first)} more bad records ({where})")
    for split in report["splits_without_valid_records"]:
        print(f"  {split}: 0 valid records in {report['splits'][split]['file']}: training would stop")
    for pair, found in report["leakage"]["pairs"].items():
        later = pair.split("/")[1]
        print(
            f"  leakage {pair}: {found['images_leaked']} images of {later} in the other split ({found['same_path']}"
            f" by path, {found['same_content']} by content, {found['near_copies']} near-copies), "
            f"{found['same_captions']} captions in both"
        )
    return report


def check_shard(dataset: ShardDataset, shard: int) -> dict[str, Any]:
    """Check every sample of one shard as training reads it (record, decode, transform)."""
    from mm_lightning.extras.shards.files import ShardError

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
        try:
            hashes = image_hashes(record.image)  # type: ignore[arg-type]
        except ImageDecodeError as err:  # the hash's reduced decode refuses what the full one read
            out["bad"].append((record.image_name, "undecodable_image", f"{record.image_name}: {err}"))
            continue
        out["ok"].append((record.image_name, digest, side, record.captions, hashes))
    dataset.cache.close()
    return out


def audit_shards(dm: Any, split: str, workers: int, progress: bool, found: SplitImages) -> dict[str, Any]:
    """The report of a split that ``dm`` (a ``ShardDataModule``) reads from WebDataset shards: every sample
    checked as training reads it, at full size, one process per shard; the same fields as a JSONL split's. Its
    images and captions go to ``found``."""
    from mm_lightning.extras.shards.dataset import ShardDataset
    from mm_lightning.extras.shards.files import list_shards

    hp, spec = dm.hparams, dm.shard_specs[split]
    dataset = ShardDataset(
        list_shards(spec, hp.storage_options, hp.cache_dir), dm.sample_builder(split, full_size=True), hp.text_key,
        "random", dm.bad_record_policy(), hp.storage_options, hp.cache_dir, open_shards=1,
    )  # fmt: skip
    bad_lines: Counter = Counter()
    examples: dict[str, list[str]] = defaultdict(list)
    bad_records: list[tuple[str, str]] = []
    by_hash: dict[str, list[str]] = defaultdict(list)
    sides: list[int] = []
    captions: list[str] = []
    shards = range(len(dataset.shards))
    with process_pool(workers, preload=[__name__]) as pool:
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
            for name, digest, side, caps, hashes in result["ok"]:
                by_hash[digest].append(f"{dataset.shards[shard].url}:{name}")
                found.add(f"{dataset.shards[shard].url}:{name}", digest, hashes)
                sides.append(side)
                captions.extend(caps)
    found.captions = captions
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
    return {**report, **caption_report(captions, hp.tokenizer, hp.max_length)}


@dataclass
class AuditOptions:
    """Options of ``audit``.

    Args:
        output: Path of the JSON report.
        splits: Splits to scan (those without a file are skipped).
        workers: Image-decoding processes.
        max_error_rate: Exit with status 1 when (bad records / records) exceeds this.
        progress: Show a progress bar while decoding images.
        fail_on_leakage: Exit with status 1 when an image of one split is in another (the same path, the same
            content, or a near-copy); captions shared by two splits are reported but do not fail.
        near_copy_bits: Largest perceptual-hash distance (of 64 bits) at which two images count as near-copies."""

    output: str = "audit_report.json"
    splits: list[str] = field(default_factory=lambda: ["train", "val", "test"])
    workers: int = os.cpu_count() or 1
    max_error_rate: float = 0.0
    progress: bool = True
    fail_on_leakage: bool = False
    near_copy_bits: int = NEAR_COPY_BITS


def main(argv: list[str] | None = None) -> int:
    """Audit the data of a run's config (``--config``, ``--data.*``; ``--audit.*`` for the options above)."""
    from mm_lightning.cli import STANDALONE_COMMANDS
    from mm_lightning.config_parser import read_data_config

    datamodule, given = read_data_config(
        argv, "audit", AuditOptions, "audit", description=STANDALONE_COMMANDS["audit"]
    )
    options = AuditOptions(**given)
    report = run_audit(
        datamodule, options.output, options.max_error_rate, options.splits, options.workers, options.progress,
        options.fail_on_leakage, options.near_copy_bits,
    )  # fmt: skip
    if report["exit_code"]:
        print(
            "audit: too many bad records, a split without a valid record, or leakage: exit status 1",
            flush=True,
        )
    return report["exit_code"]
