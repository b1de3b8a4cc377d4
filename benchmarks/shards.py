"""Shard loader vs JSONL loader: samples/s on the same images, open files and memory vs dataset size.

    python benchmarks/shards.py [--images 400] [--workers 2] [--batch-size 32] [--rounds 3] [--photos DIR]
    python benchmarks/shards.py --quick   # seconds: the same path on 16 images, each loader timed once

Writes ``--images`` JPEGs (COCO-size natural-looking images generated here, or the JPEGs of ``--photos``) with
captions as JSONL, converts them with ``write_shards`` (images copied as is), serves the shards from a local
S3 endpoint (moto's server on 127.0.0.1), then times one training epoch of
  (a) MultimodalDataModule's train loader over the JSONL + image files (the baseline; every image listed 4
      times, so an epoch is long enough that worker start-up does not count),
  (b) ShardDataModule over the local shards,
  (c) ShardDataModule over the same shards on the local S3 endpoint (fetched into a cache as read),
with the same workers, batch size, image size and transforms; rounds alternate a/b/c and the best round of
each counts. Then, for the shard loader, open file descriptors and memory (USS of the loader process and its
workers, psutil) after the same number of batches from datasets of 1x and 4x the samples: both must stay flat.
Last line: ``RESULT shards ratio=<(b)/(a) samples/s> (...)``. Real photos:
``python benchmarks/support/real_photos.py /tmp/photos`` (when present) writes COCO-like JPEGs derived from camera
photos; pass ``--photos /tmp/photos/coco``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mm_lightning.data import MultimodalDataModule  # noqa: E402
from mm_lightning.data.jsonl import RecordParser  # noqa: E402
from mm_lightning.extras import ShardDataModule  # noqa: E402
from mm_lightning.extras.shards.writer import write_shards  # noqa: E402
from tests.shards.servers import CREDENTIALS, s3_server, upload  # noqa: E402

TOKENIZER = "mm-lightning/demo-bert"


def natural_jpeg(path: Path, rng: np.random.Generator) -> None:
    """640x480: a smooth colour field with edges and noise (decodes at a photo-like cost per pixel)."""
    low = Image.fromarray((rng.random((12, 16, 3)) * 255).astype(np.uint8)).resize((640, 480), Image.BICUBIC)
    arr = np.asarray(low, dtype=np.float32) + rng.normal(0, 10, (480, 640, 3))
    Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def make_data(root: Path, images: int, photos: Path | None, copies: int) -> Path:
    """JSONL with ``images * copies`` lines over ``images`` image files; returns the JSONL path."""
    root.mkdir(parents=True, exist_ok=True)
    if photos is not None:
        sources = sorted(p for p in photos.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))[:images]
        names = [str(p.resolve()) for p in sources]
    else:
        rng = np.random.default_rng(0)
        names = []
        for i in range(images):
            path = root / f"{i:06d}.jpg"
            if not path.exists():
                natural_jpeg(path, rng)
            names.append(path.name)
    file = root / f"train_x{copies}.jsonl"
    with open(file, "w") as f:
        for copy in range(copies):
            for i, name in enumerate(names):
                f.write(json.dumps({"image": name, "text": f"photo {i} copy {copy} of a scene"}) + "\n")
    return file


def loader_processes() -> list[psutil.Process]:
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def open_files_and_uss() -> tuple[int, float]:
    procs = loader_processes()
    fds = sum(p.num_fds() for p in procs)
    uss = sum(p.memory_full_info().uss for p in procs) / 2**20
    return fds, uss


def epoch(dm: MultimodalDataModule, limit: int | None = None) -> tuple[float, int, tuple[int, float]]:
    """(samples/s, samples, (fds, USS MiB) measured at the end while workers are alive)."""
    dm.setup("fit")
    loader = dm.train_dataloader()
    start, samples = time.perf_counter(), 0
    peak = (0, 0.0)
    for n, batch in enumerate(loader):
        samples += batch["image"].shape[0]
        if n % 4 == 3:
            fds, uss = open_files_and_uss()
            peak = (max(peak[0], fds), max(peak[1], uss))
        if limit is not None and n + 1 >= limit:
            break
    return samples / (time.perf_counter() - start), samples, peak


def footprint(args: argparse.Namespace) -> None:
    """Read the same number of batches from ``args.footprint`` with 2 shards open per process and one shard
    per shuffle window (fewer than either dataset holds): what stays open is bounded by the open shards."""
    dm = ShardDataModule(
        train_shards=args.footprint, open_shards=2, shuffle_shards=1, tokenizer=TOKENIZER,
        batch_size=args.batch_size, num_workers=args.workers, images={"size": args.image_size},
    )  # fmt: skip
    _, samples, (fds, uss) = epoch(dm, limit=max(4, args.images // args.batch_size))
    print(samples, fds, f"{uss:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--samples-per-shard", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--photos", type=Path, default=None, help="folder of real JPEG photos to use")
    parser.add_argument("--footprint", default=None, help=argparse.SUPPRESS)  # internal: one measurement
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the same path in seconds: 16 images, one worker, batch 4, each loader timed once, in a fresh temporary"
        " folder",
    )
    args = parser.parse_args()
    if args.footprint is not None:
        footprint(args)
    elif args.quick:
        # shards of 4: 4 and 16 shards, as in the full run, so the footprint's 2 open shards are fewer than either
        args.images, args.workers, args.batch_size, args.rounds, args.samples_per_shard = 16, 1, 4, 1, 4
        with tempfile.TemporaryDirectory(prefix="mm_lightning_shards_") as scratch:
            run(args, Path(scratch))
    else:
        run(args, Path(tempfile.gettempdir()) / "mm_lightning_bench_shards")


def run(args: argparse.Namespace, root: Path) -> None:
    os.environ.update(CREDENTIALS)
    common = {
        "tokenizer": TOKENIZER,
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "images": {"size": args.image_size},
        "loader": {"persistent_workers": False},
    }
    files = {c: make_data(root / "jsonl", args.images, args.photos, c) for c in (1, 4)}
    for copies, file in files.items():
        write_shards(
            RecordParser(str(file), "image", "text", str(file.parent), False),
            str(root / f"shards_x{copies}"),
            args.samples_per_shard,
            validate=False,
            progress=False,
        )
    # Throughput on the 4x data (every image 4 times): epochs long enough that worker start-up is noise.
    local = str(root / "shards_x4" / "shards.json")
    speeds: dict[str, list[float]] = {"jsonl": [], "shards_local": [], "shards_s3": []}
    with s3_server() as endpoint:
        upload(endpoint, "bench", root / "shards_x4", "x4")
        s3 = {
            "train_shards": "s3://bench/x4/shards.json",
            "storage_options": {"endpoint_url": endpoint},
            "cache_dir": str(root / "cache"),
        }
        for _ in range(args.rounds):
            speeds["jsonl"].append(epoch(MultimodalDataModule(train_file=str(files[4]), **common))[0])
            speeds["shards_local"].append(epoch(ShardDataModule(train_shards=local, **common))[0])
            speeds["shards_s3"].append(epoch(ShardDataModule(**s3, **common))[0])
    best = {k: max(v) for k, v in speeds.items()}
    for name, value in best.items():
        print(f"{name:>13}: {value:7.1f} samples/s (rounds: {', '.join(f'{v:.1f}' for v in speeds[name])})")

    flat = {}
    for copies in (1, 4):
        # A fresh process per size (the loader's own footprint, not this process's history).
        out = subprocess.run(
            [sys.executable, __file__, "--footprint", str(root / f"shards_x{copies}" / "shards.json"),
             "--workers", str(args.workers), "--batch-size", str(args.batch_size),
             "--image-size", str(args.image_size), "--images", str(args.images)],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        samples, fds, uss = int(out[-3]), int(out[-2]), float(out[-1])
        flat[copies] = (fds, uss)
        print(
            f"shards x{copies} ({args.images * copies} samples): {samples} read, "
            f"peak open files {fds}, peak USS {uss:.0f} MiB (loader + workers)"
        )
    images = "generated 640x480 JPEGs" if args.photos is None else f"photos from {args.photos}"
    ratio = best["shards_local"] / best["jsonl"]
    print(
        f"RESULT shards ratio={ratio:.2f} (shard/jsonl samples/s on local disk; s3/jsonl "
        f"{best['shards_s3'] / best['jsonl']:.2f}; {4 * args.images} samples of {args.images} {images}, "
        f"{args.workers} workers, batch "
        f"{args.batch_size}, {args.image_size} px; open files x1/x4 {flat[1][0]}/{flat[4][0]}, "
        f"USS x1/x4 {flat[1][1]:.0f}/{flat[4][1]:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
