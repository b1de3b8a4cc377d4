"""LiT step time with the locked image tower's features cached vs recomputed, on real photos (CPU).

Both runs are ``configs/lit.yaml`` as the CLI builds it (locked EfficientNet-lite0, trained all-MiniLM-L6-v2, the
recipe's callbacks) on the same training split of the dev set (see ``benchmarks/recipes.py``), same batches and
steps; one without the recipe's ``LockedImageFeatures`` (the evaluation crop cached once per image). The step time is the wall time from one
training batch's start to the next's (data wait included), median over the steps after the first two; the
cache's one-off build is reported apart.

    python benchmarks/locked_features.py                     # 224 px, batch 32, 12 steps, 1 loader worker
    python benchmarks/locked_features.py --data DIR          # DIR/train.jsonl of your own
    python benchmarks/locked_features.py --quick             # checks that it runs: 8 generated photos, 64 px
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.pytorch import Callback
from recipes import CACHE, DEV_SET, REPO, recipe_cli, split_dev_set
from support.real_photos import PhotoSet, build

# --quick: JPEGs cut from real photos (5 captions each) instead of the dev set, and an LR warmup short enough that
# the runs reach the decay (which asks the trainer for the run's length)
QUICK_PHOTOS = PhotoSet("quick", (160, 120), (90, 90), 2, 0.0, 8)
QUICK_OVERRIDES = ["model.optim.warmup_steps=2"]  # --set items of recipes.py


class StepClock(Callback):
    """Wall time between consecutive training-batch starts (the whole step, data wait included)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]


def without_feature_cache() -> str:
    """``configs/lit.yaml``'s callbacks less its feature cache (the default list, then a long run's three), as a
    ``--trainer.callbacks`` value (it replaces the whole list)."""
    default = yaml.safe_load((REPO / "mm_lightning" / "callbacks" / "default.yaml").read_text())
    added = yaml.safe_load((REPO / "configs" / "callbacks" / "locked_features.yaml").read_text())
    kept = [e for e in added if not e["class_path"].endswith(".LockedImageFeatures")]
    assert len(kept) == len(added) - 1, "the LiT callbacks name the feature cache once"
    return json.dumps(default + kept)


def run(data: Path, args: argparse.Namespace, cache: bool, root: Path) -> tuple[float, float]:
    """Median step time (s) after the first two steps, and the time before the first step (s)."""
    recipe = argparse.Namespace(
        batch_size=args.batch_size, workers=args.workers, image_size=args.image_size, epochs=None,
        max_steps=args.steps, set=QUICK_OVERRIDES if args.quick else [],
    )  # fmt: skip
    cli = recipe_cli(
        "lit", data, recipe, root,
        "--data.init_args.val_file=null", "--data.init_args.test_file=null",
        *([] if cache else [f"--trainer.callbacks={without_feature_cache()}"]),
    )  # fmt: skip
    clock = StepClock()
    cli.trainer.callbacks.append(clock)  # an instrument beside the recipe's callbacks
    start = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return statistics.median(clock.step_times()[2:]), clock.starts[0] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=None, help="folder with train.jsonl (default: dev set)")
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="8 generated photos, 64 px, batch 8, 4 steps")
    args = parser.parse_args()
    if args.quick:
        args.image_size, args.batch_size, args.steps = 64, 8, 4
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.data:
            data = args.data
        elif args.quick:
            data = build(Path(tmp), QUICK_PHOTOS).parent
        else:
            data = split_dev_set(DEV_SET, CACHE / "coco_mini_split")
        recomputed, _ = run(data, args, cache=False, root=Path(tmp) / "plain")
        cached, setup = run(data, args, cache=True, root=Path(tmp) / "cached")
        _, warm_setup = run(data, args, cache=True, root=Path(tmp) / "cached")  # the cache already on disk
    print(f"recomputed: {recomputed * 1000:.0f} ms per step")
    print(f"cached:     {cached * 1000:.0f} ms per step (before the first step: {setup:.1f} s building the cache, "
          f"{warm_setup:.1f} s when it is already on disk)")  # fmt: skip
    print(
        f"RESULT locked_features ratio={recomputed / cached:.2f} (median LiT step time recomputed / cached, "
        f"{args.image_size} px, batch {args.batch_size}, {args.steps} steps, {args.workers} loader worker(s), "
        f"{args.threads} threads, {data})"
    )


if __name__ == "__main__":
    main()
