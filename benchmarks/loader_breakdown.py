"""Where the train loader's time goes, per sample: each stage in one process, then the split with workers.

    python benchmarks/loader_breakdown.py --images DIR_OR_JSONL ... [--workers 2] [--batch-size 32] [--seconds 4]
    python benchmarks/loader_breakdown.py --quick   # seconds: the same path on a few photos, one short pass each

One process, one thread: the loader's own stages timed separately on the same images (best of 3 passes):
reading the file, the JPEG header and crop draw, the (DCT-scaled) decode, the antialiased resize, the rest of
building a sample (record lookup, path checks, seeding), tokenization, the rest of the collate, and the
normalization a Trainer applies after the handover. With workers: the loader's samples/s, the CPU time per
sample of the workers and of the main process (psutil), and how busy the cores were; the workers' CPU beyond
the one-process stages is the handover (shared-memory segments, pickling) and contention between the cores.

The last line is ``RESULT loader_breakdown ratio=<samples/s with workers / (workers x one-process samples/s)>``:
how close the loader with workers comes to running its one-process pipeline on every core.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_pipeline import add_photo_source, photo_tokenizer, repeated, run_on_photos, user_jsonl  # noqa: E402

from mm_lightning.data import MultimodalDataModule  # noqa: E402
from mm_lightning.data.images import EncodedImage, read_image_bytes  # noqa: E402


def best_of(fn, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def one_process(dm: MultimodalDataModule, batch_size: int) -> tuple[dict[str, float], int]:
    """Seconds per sample of each stage, one process, one thread."""
    dataset = dm.datasets["train"]
    collate, transform = dm.train_dataloader().collate_fn, dataset.builder.transform
    batches = [list(range(i, i + batch_size)) for i in range(0, len(dataset) - batch_size + 1, batch_size)]
    n = len(batches) * batch_size
    paths = [dataset.index.pair(dataset.caption_of(i)).record.image for i in range(n)]
    data = [read_image_bytes(p) for p in paths]

    def header_and_crop() -> None:
        for d in data:
            with EncodedImage(d) as image:
                transform.plan(*image.size, scalable=image.scalable)

    def header_crop_decode() -> None:
        for d in data:
            with EncodedImage(d) as image:
                image.decode(transform.plan(*image.size, scalable=image.scalable)[1])

    torch.manual_seed(0)

    def read_each() -> None:
        for path in paths:  # one file's bytes alive at a time, as in the loader
            read_image_bytes(path)

    t = {
        "read file": best_of(read_each),
        "header + crop draw": best_of(header_and_crop),
    }
    t["decode (DCT-scaled)"] = best_of(header_crop_decode) - t["header + crop draw"]
    whole_transform = best_of(lambda: [transform(d) for d in data])
    t["resize + flip"] = whole_transform - t["header + crop draw"] - t["decode (DCT-scaled)"]
    t["rest of a sample (record, checks, seeding)"] = (
        best_of(lambda: [dataset.__getitems__(b) for b in batches]) - whole_transform - t["read file"]
    )
    samples = [dataset.__getitems__(b) for b in batches]
    t["tokenization"] = best_of(lambda: [collate._tokenize([s["caption"] for s in b]) for b in samples])
    t["rest of the collate (stack, ids)"] = best_of(lambda: [collate(b) for b in samples]) - t["tokenization"]
    images = [collate(b)["image"] for b in samples]

    def normalize_each() -> None:
        for batch in images:  # one result alive at a time, as in a training loop
            dm.normalize(batch)

    t["normalization (after the handover)"] = best_of(normalize_each)
    return {k: v / n for k, v in t.items()}, n


def with_workers(dm: MultimodalDataModule, seconds: float) -> dict[str, float]:
    """samples/s, worker and main-process CPU seconds per sample, and core utilization (best of 3 rounds), each
    timing whole passes for at least ``seconds``."""
    loader = dm.train_dataloader()
    for _ in loader:  # start the workers
        pass
    me = psutil.Process()
    best: dict[str, float] = {}
    for _ in range(3):
        kids = me.children(recursive=True)
        cpu0 = sum(me.cpu_times()[:2]), {k.pid: sum(k.cpu_times()[:2]) for k in kids}
        start, n = time.perf_counter(), 0
        while n == 0 or time.perf_counter() - start < seconds:
            for batch in loader:
                dm.normalize_batch(batch)
                n += batch["image"].shape[0]
        wall = time.perf_counter() - start
        main_cpu = sum(me.cpu_times()[:2]) - cpu0[0]
        worker_cpu = sum(sum(k.cpu_times()[:2]) - cpu0[1].get(k.pid, 0.0) for k in kids)
        rate = n / wall
        if rate > best.get("rate", 0):
            best = {
                "rate": rate,
                "worker": worker_cpu / n,
                "main": main_cpu / n,
                "busy": (worker_cpu + main_cpu) / (wall * os.cpu_count()),
            }
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_photo_source(parser)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epoch-images", type=int, default=1024)
    parser.add_argument(
        "--seconds", type=float, default=4.0, help="minimum timed seconds of each measurement with workers"
    )
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_real_photos")
    args = parser.parse_args()
    run_on_photos(args, "loader_breakdown", run)


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)
    tokenizer = photo_tokenizer()
    source = " ".join(map(str, args.images))
    jsonl = user_jsonl(args.images, args.data / "user_images")
    jsonl = repeated(jsonl, args.epoch_images, args.data / "epochs" / "breakdown")

    def datamodule(workers: int) -> MultimodalDataModule:
        dm = MultimodalDataModule(
            train_file=str(jsonl),
            tokenizer=tokenizer,
            images={"size": 224},
            batch_size=args.batch_size,
            num_workers=workers,
            loader={
                "persistent_workers": workers > 0,
                "batch_slots": workers > 0,  # as the photo recipes
                "normalize_on": "device",
            },  # device: what a Trainer does
        )
        dm.setup("fit")
        return dm

    stages, n = one_process(datamodule(0), args.batch_size)
    total = sum(stages.values())
    print(f"one process, one thread ({n} samples, {source}): ms per sample")
    for name, seconds in stages.items():
        print(f"  {name:42s} {1000 * seconds:6.3f}  ({100 * seconds / total:4.1f} %)")
    print(f"  {'total':42s} {1000 * total:6.3f}  -> {1 / total:.0f} samples/s per core")
    w = with_workers(datamodule(args.workers), args.seconds)
    in_workers = total - stages["normalization (after the handover)"]
    print(
        f"{args.workers} workers, batch {args.batch_size}: {w['rate']:.0f} samples/s; CPU per sample: workers"
        f" {1000 * w['worker']:.3f} ms (one-process stages {1000 * in_workers:.3f} + handover and contention"
        f" {1000 * (w['worker'] - in_workers):.3f}), main process {1000 * w['main']:.3f} ms; cores busy"
        f" {100 * w['busy']:.0f} %"
    )
    ratio = w["rate"] / (args.workers / total)
    print(
        f"RESULT loader_breakdown ratio={ratio:.2f} ({w['rate']:.0f} samples/s with {args.workers} workers vs"
        f" {args.workers} x {1 / total:.0f} one-process)"
    )


if __name__ == "__main__":
    main()
