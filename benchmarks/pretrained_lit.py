"""LiT with a pretrained image tower vs the same run with a random image tower, on real photos, offline.

Data: the real photographs that scikit-image ships inside its wheel (``skimage/data``: the cat "chelsea", the
coffee cup, the motorcycle, the rocket, the astronaut, the coins, ... 16 photos), cut into five regions each (four
corners and the centre). Each crop is captioned from what the photo shows and where the crop lies
("the top left part of a photo of a tabby cat"). Training uses randomly jittered crops of each region (8 per
region), validation the exact regions: 80 image-caption pairs, one caption per image, R@1 by chance = 1/80.

Both runs are ``configs/lit.yaml`` as the CLI builds it (locked EfficientNet-lite0 with its feature cache, trained
all-MiniLM-L6-v2, the recipe's callbacks) at 96 px and batch 40, the same data, seed and steps; only ``model.image_tower.init_args.weights`` differs (the ImageNet file vs
none).

    python benchmarks/pretrained_lit.py               # ~4-12 min on 2 CPU cores (contention-dependent)
    python benchmarks/pretrained_lit.py --holdout 5   # validate on 5 photos (25 pairs) never trained on
    python benchmarks/pretrained_lit.py --quick       # checks that it runs: 1 step, 1 training crop per region

Caveat of the default split: validation crops are the exact regions of photos whose jittered crops (shifted by at
most 6% of the photo) are trained on, so it measures fitting near-duplicate views; ``--holdout`` measures transfer.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from mm_lightning.cli import cli_main

REPO = Path(__file__).resolve().parents[1]
PHOTOS = {
    "astronaut.png": "an astronaut in a white space suit",
    "brick.png": "a brick wall",
    "camera.png": "a man holding a camera",
    "chelsea.png": "a tabby cat",
    "coffee.png": "a cup of coffee on a saucer",
    "coins.png": "old coins on a table",
    "grass.png": "a patch of grass",
    "gravel.png": "a gravel path",
    "hubble_deep_field.jpg": "galaxies in deep space",
    "ihc.png": "stained tissue under a microscope",
    "moon.png": "the surface of the moon",
    "motorcycle_left.png": "a red motorcycle in a workshop",
    "page.png": "a printed page of text",
    "retina.jpg": "the retina of an eye",
    "rocket.jpg": "a rocket on a launch pad",
    "text.png": "handwritten text on a board",
}
REGIONS = {
    "top left": (0.0, 0.0),
    "top right": (0.5, 0.0),
    "bottom left": (0.0, 0.5),
    "bottom right": (0.5, 0.5),
    "centre": (0.25, 0.25),
}


def build_dataset(out: Path, train_jitters: int = 8, seed: int = 0, holdout: int = 0) -> tuple[Path, Path]:
    """Writes region crops of the scikit-image photos and train/val JSONL files under ``out``.

    With ``holdout`` > 0 the last ``holdout`` photos are validation only (never trained on) and the others
    training only: validation then measures transfer to photos and subjects the run never saw.
    """
    import skimage

    source = Path(skimage.__file__).parent / "data"
    rng = random.Random(seed)
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    for number, (file, subject) in enumerate(PHOTOS.items()):
        held_out = number >= len(PHOTOS) - holdout
        photo = Image.open(source / file).convert("RGB")
        width, height = photo.size
        for region, (fx, fy) in REGIONS.items():
            caption = f"the {region} part of a photo of {subject}"
            splits = {"val": [(0.0, 0.0)], "train": [None] * train_jitters}
            if holdout:
                splits = {"val": splits["val"]} if held_out else {"train": splits["train"]}
            for split, jitters in splits.items():
                for k, jitter in enumerate(jitters):
                    dx, dy = (
                        jitter if jitter is not None else (rng.uniform(-0.06, 0.06), rng.uniform(-0.06, 0.06))
                    )
                    left = min(max(fx + dx, 0.0), 0.5) * width
                    top = min(max(fy + dy, 0.0), 0.5) * height
                    crop = photo.crop((int(left), int(top), int(left + width / 2), int(top + height / 2)))
                    name = f"{split}/{Path(file).stem}-{region.replace(' ', '_')}-{k}.jpg"
                    (out / name).parent.mkdir(parents=True, exist_ok=True)
                    crop.resize((128, 128), Image.BICUBIC).save(out / name, quality=95)
                    rows[split].append({"image": name, "text": caption})
    for split, records in rows.items():
        (out / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return out / "train.jsonl", out / "val.jsonl"


def run(
    image_weights: str | None, args: argparse.Namespace, train: Path, val: Path, root: Path
) -> dict[str, float]:
    """One LiT run of ``configs/lit.yaml`` as the CLI builds it (its model, data options and callbacks) on these
    files at 96 px; returns the final validation retrieval metrics."""
    text_tower = ["--model.text_tower.init_args.name", args.text_tower] if args.text_tower else []
    cli = cli_main(
        [
            "--config", str(REPO / "configs" / "lit.yaml"),
            "--model.image_tower.init_args.weights", image_weights or "null",
            "--model.image_tower.init_args.image_size", "96",
            *text_tower,
            "--data.init_args.train_file", str(train),
            "--data.init_args.val_file", str(val),
            "--data.init_args.test_file", "null",
            "--data.init_args.batch_size", "40",
            "--data.init_args.num_workers", "0",
            "--trainer.accelerator", args.accelerator,
            "--trainer.max_steps", str(args.steps),
            "--trainer.val_check_interval", str(args.steps),
            "--trainer.check_val_every_n_epoch", "null",
            "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false",
            "--trainer.default_root_dir", str(root),
        ],
        run=False,
    )  # fmt: skip
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("val/r")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument(
        "--holdout", type=int, default=0, help="photos kept out of training (validation only)"
    )
    parser.add_argument(
        "--image_weights", default="efficientnet-lite0-57934424.pth", help="the ImageNet file"
    )
    parser.add_argument(
        "--text_tower", default=None, help="override configs/lit.yaml's text tower name (e.g. a folder)"
    )
    parser.add_argument("--quick", action="store_true", help="1 step, 1 training crop per region")
    args = parser.parse_args()
    if args.quick:
        args.steps = 1
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        train, val = build_dataset(
            Path(tmp) / "photos", train_jitters=1 if args.quick else 8, holdout=args.holdout
        )
        n_val = sum(1 for _ in val.open())
        results = {}
        for label, weights in (("pretrained", args.image_weights), ("random", None)):
            start = time.perf_counter()
            results[label] = run(weights, args, train, val, Path(tmp) / label)
            print(
                f"{label:>10}: " + " ".join(f"{k}={v:.3f}" for k, v in sorted(results[label].items())),
                f"({time.perf_counter() - start:.0f} s)",
            )
    pre, rnd = results["pretrained"]["val/r1_t2i"], results["random"]["val/r1_t2i"]
    ratio = pre / max(rnd, 1.0 / n_val)
    print(
        f"RESULT pretrained_lit ratio={ratio:.2f} (val r1_t2i pretrained={pre:.3f} vs random={rnd:.3f}, "
        f"r1_i2t {results['pretrained']['val/r1_i2t']:.3f} vs {results['random']['val/r1_i2t']:.3f}; {n_val} val pairs "
        f"from scikit-image photos x 5 regions ({args.holdout} photos held out of training), chance "
        f"{1 / n_val:.3f}; {args.steps} steps, locked EfficientNet-lite0 + "
        "trained all-MiniLM-L6-v2; random r1 floored at chance for the ratio)"
    )


if __name__ == "__main__":
    main()
