"""What each part of the loader's fast path is worth on real photos: the train loader with every part on, then
with one part off at a time, then with all of them off.

    python benchmarks/fast_path.py --images <coco_mini>/train.jsonl <coco_mini>/val.jsonl
                                   [--workers 2] [--batch-size 32] [--rounds 7] [--seconds 3]
    python benchmarks/fast_path.py --quick   # seconds: the same path on a few photos, one short pass each

Parts (``MultimodalDataModule`` options):
  reduced_decode    ``data.images.reduced_decode``: JPEGs decoded at 1/2, 1/4 or 1/8 size where the crop allows;
  batch_slots       ``data.loader.batch_slots``: image batches stacked into reusable shared-memory buffers;
  device_normalize  ``data.loader.normalize_on: device``: uint8 crosses from the workers, normalized after
                    (off: normalized in the workers, float32 crossing).
Samples/s of the model-ready batch (normalized for all), every variant once per round, so load from other
processes hits them alike; each variant is compared with all-on in the same round, and the median over rounds
counts. docs/benchmarks.md says which parts are on by default and why. The last line is
``RESULT fast_path ratio=<all on / all off>`` with the change without each part in parentheses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data_pipeline import (  # noqa: E402
    add_photo_source,
    photo_tokenizer,
    repeated,
    run_on_photos,
    samples_per_second,
    user_jsonl,
)

from mm_lightning.data import MultimodalDataModule  # noqa: E402

ALL_ON = {"reduced_decode": True, "batch_slots": True, "device_normalize": True}


def loader_for(jsonl: Path, tokenizer: str, batch_size: int, workers: int, parts: dict[str, bool]):
    dm = MultimodalDataModule(
        train_file=str(jsonl),
        tokenizer=tokenizer,
        batch_size=batch_size,
        num_workers=workers,
        images={"size": 224, "reduced_decode": parts["reduced_decode"]},
        loader={
            "batch_slots": parts["batch_slots"],
            "normalize_on": "device" if parts["device_normalize"] else "worker",
        },
    )
    dm.setup("fit")
    # normalized after the handover as a Trainer does; in the workers already otherwise
    return dm.train_dataloader(), dm.normalize_batch if parts["device_normalize"] else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_photo_source(parser)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per measurement")
    parser.add_argument("--epoch-images", type=int, default=1024, help="list smaller sets several times")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_fast_path")
    args = parser.parse_args()
    run_on_photos(args, "fast_path", run)


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # the workers are the parallelism
    tokenizer = photo_tokenizer()

    jsonl = repeated(
        user_jsonl(args.images, args.data / "user_images"), args.epoch_images, args.data / "epoch"
    )
    variants = {"all on": ALL_ON}
    variants |= {f"without {part}": {**ALL_ON, part: False} for part in ALL_ON}
    variants["all off"] = dict.fromkeys(ALL_ON, False)
    loaders = {
        name: loader_for(jsonl, tokenizer, args.batch_size, args.workers, parts)
        for name, parts in variants.items()
    }
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for r in range(args.rounds):
        for name, (loader, after) in loaders.items():
            rates[name].append(samples_per_second(loader, args.seconds, after))
            print(f"  round {r} {name:26s} {rates[name][-1]:7.1f} samples/s", flush=True)

    # each variant against all-on in the same round (a slow spell hits both), the median over rounds
    def median_ratio(name: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[name], rates["all on"], strict=True))

    print(
        f"\nsamples/s with {args.workers} workers, batch {args.batch_size}, median of {args.rounds} rounds:"
    )
    for name, rate in rates.items():
        ratios = [a / b for a, b in zip(rate, rates["all on"], strict=True)]
        print(
            f"  {name:26s} {statistics.median(rate):7.1f}  {statistics.median(ratios):.3f} of all on"
            f" (rounds {min(ratios):.3f}-{max(ratios):.3f})"
        )
    changes = ", ".join(f"{part} {median_ratio(f'without {part}') - 1:+.1%}" for part in ALL_ON)
    print(
        f"RESULT fast_path ratio={1 / median_ratio('all off'):.3f} (all on"
        f" {statistics.median(rates['all on']):.0f} samples/s; without each part: {changes};"
        f" {args.workers} workers, batch {args.batch_size}, median of {args.rounds} paired rounds)"
    )


if __name__ == "__main__":
    main()
