"""What the layout-free training order costs the loader on real photos: the train loader as it is (one order per
epoch over the whole data set, read by position; each sample's draws seeded by its visit) against the loader it
replaced (torchdata's ``StatefulDataLoader`` with a shuffled sampler, the draws seeded once per batch).

    python benchmarks/global_order.py --images <coco_mini>/train.jsonl <coco_mini>/val.jsonl
                                      [--workers 2] [--batch-size 32] [--rounds 7] [--seconds 3]
    python benchmarks/global_order.py --quick   # seconds: the same path on a few photos, one short pass each

Same data module options, images, batch size and workers for both; samples/s of the model-ready batch, the two
variants once per round, so load from other processes hits them alike; the median of the per-round ratios counts.
The last line is ``RESULT global_order ratio=<global order / per-batch seeded>`` (the target: >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

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
from mm_lightning.data.samples import ImageTextDataset  # noqa: E402
from mm_lightning.data.seeding import derive_seed  # noqa: E402


class SeededPerBatch(ImageTextDataset):
    """The dataset's draws as they were: torch's generator seeded once per batch, from the batch's indices."""

    def __getitems__(self, items: list[int]) -> list[dict[str, Any]]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, items))
            return self.policy.load_batch([int(i) for i in items], self.load, len(self))


def data_module(jsonl: Path, tokenizer: str, batch_size: int, workers: int) -> MultimodalDataModule:
    dm = MultimodalDataModule(
        train_file=str(jsonl),
        tokenizer=tokenizer,
        batch_size=batch_size,
        num_workers=workers,
        images={"size": 224},
        loader={"caption_sampling": "random"},
    )
    dm.setup("fit")
    return dm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_photo_source(parser)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per measurement")
    parser.add_argument("--epoch-images", type=int, default=1024, help="list smaller sets several times")
    parser.add_argument(
        "--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_global_order"
    )
    args = parser.parse_args()
    run_on_photos(args, "global_order", run)


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # the workers are the parallelism
    tokenizer = photo_tokenizer()
    jsonl = repeated(
        user_jsonl(args.images, args.data / "user_images"), args.epoch_images, args.data / "epoch"
    )

    ours = data_module(jsonl, tokenizer, args.batch_size, args.workers)
    before = data_module(jsonl, tokenizer, args.batch_size, args.workers)
    dataset = before.datasets["train"]
    dataset.__class__ = SeededPerBatch
    loaders = {
        "global order": ours.train_dataloader(),
        "per-batch seeded": StatefulDataLoader(
            dataset, shuffle=True, drop_last=True, **before._loader_kwargs()
        ),
    }
    normalize = {"global order": ours.normalize_batch, "per-batch seeded": before.normalize_batch}
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for r in range(args.rounds):
        for name, loader in loaders.items():
            rates[name].append(samples_per_second(loader, args.seconds, normalize[name]))
            print(f"  round {r} {name:18s} {rates[name][-1]:7.1f} samples/s", flush=True)
    ratios = [a / b for a, b in zip(rates["global order"], rates["per-batch seeded"], strict=True)]
    print(
        f"\nsamples/s with {args.workers} workers, batch {args.batch_size}, median of {args.rounds} rounds:"
    )
    for name, rate in rates.items():
        print(f"  {name:18s} {statistics.median(rate):7.1f}")
    print(
        f"RESULT global_order ratio={statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f};"
        f" {statistics.median(rates['global order']):.0f} vs {statistics.median(rates['per-batch seeded']):.0f}"
        f" samples/s, {args.workers} workers, batch {args.batch_size})"
    )


if __name__ == "__main__":
    main()
