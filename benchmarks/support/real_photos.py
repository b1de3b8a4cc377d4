"""Benchmark JPEGs derived from real camera photographs that ship inside Python wheels (no download).

Sources: scikit-image's sample photos (``skimage/data``: astronaut, chelsea the cat, coffee, rocket, the
motorcycle stereo pair) and matplotlib's ``grace_hopper.jpg`` when matplotlib is installed. They are 451-741
px originals; each benchmark image is a random crop of one of them (at most mildly rescaled), or for phone
sizes a mosaic of such crops, so the pixels keep a camera photo's statistics (texture, noise, colour), then
re-encoded by PIL at COCO-like and phone-like settings. Synthetic images decode much faster than photos of
the same size, so loader speed must be measured on these.

    python benchmarks/support/real_photos.py /tmp/photos    # writes the sets and prints a summary
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from importlib import resources
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image

SKIMAGE_PHOTOS = (
    "astronaut.png",
    "chelsea.png",
    "coffee.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
)
WORDS = (
    "a man woman dog cat person people street table plate food bus train car sitting standing next to "
    "on of in with the red blue white black green large small two three near top front holding giant "
    "kitchen room field grass water beach sky building city road sign tree group young old wooden"
).split()


@dataclass(frozen=True)
class PhotoSet:
    """One benchmark set: size, JPEG settings and how many images."""

    name: str
    size: tuple[int, int]  # width, height of a landscape image (a quarter are stored portrait)
    quality: tuple[int, int]  # inclusive range
    subsampling: int  # PIL: 0 = 4:4:4, 2 = 4:2:0
    progressive: float  # fraction saved progressive
    count: int

    def describe(self) -> str:
        chroma = "4:4:4" if self.subsampling == 0 else "4:2:0"
        kind = "progressive" if self.progressive == 1 else "baseline" if self.progressive == 0 else "mixed"
        q = (
            f"q{self.quality[0]}"
            if self.quality[0] == self.quality[1]
            else f"q{self.quality[0]}-{self.quality[1]}"
        )
        return f"{self.size[0]}x{self.size[1]} {q} {chroma} {kind}"


PHOTO_SETS = {
    "coco": PhotoSet("coco", (640, 480), (90, 95), 2, 0.0, 400),
    "coco444p": PhotoSet("coco444p", (640, 480), (90, 90), 0, 1.0, 200),
    "flickr500": PhotoSet("flickr500", (500, 375), (85, 92), 2, 0.0, 400),
    "phone1280": PhotoSet("phone1280", (1280, 960), (90, 90), 2, 0.0, 120),
    "phone2048": PhotoSet("phone2048", (2048, 1536), (90, 95), 2, 0.5, 64),
    "phone4032": PhotoSet("phone4032", (4032, 3024), (88, 92), 2, 0.0, 64),
}


def source_photos() -> dict[str, Image.Image]:
    """The real photographs available offline, by name.

    Raises:
        SystemExit: scikit-image is not installed (it is in the ``dev`` extra).
    """
    try:
        folder = resources.files("skimage") / "data"
    except ModuleNotFoundError:
        sys.exit("the real-photo benchmark set needs scikit-image: pip install -e '.[dev]' (or scikit-image)")
    photos = {
        name: Image.open(BytesIO((folder / name).read_bytes())).convert("RGB") for name in SKIMAGE_PHOTOS
    }
    try:
        import matplotlib

        hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
        photos["grace_hopper.jpg"] = Image.open(hopper).convert("RGB")
    except (ImportError, OSError):
        pass
    return photos


def _tile(photo: Image.Image, width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """A width x height random crop of ``photo``, scaled by at most 1.5x (so no blur-like upscaling)."""
    zoom = max(width / photo.width, height / photo.height, float(rng.uniform(0.8, 1.5)))
    w, h = max(width, round(photo.width * zoom)), max(height, round(photo.height * zoom))
    scaled = photo.resize((w, h), Image.LANCZOS)
    x, y = int(rng.integers(0, w - width + 1)), int(rng.integers(0, h - height + 1))
    tile = scaled.crop((x, y, x + width, y + height))
    return tile.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else tile


def compose(photos: list[Image.Image], width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """One photo crop for COCO sizes; a mosaic of crops (cells of ~400-600 px) for phone sizes."""
    cols, rows = max(1, round(width / 520)), max(1, round(height / 520))
    if cols == rows == 1:
        return _tile(photos[int(rng.integers(len(photos)))], width, height, rng)
    canvas = Image.new("RGB", (width, height))
    xs, ys = np.linspace(0, width, cols + 1).astype(int), np.linspace(0, height, rows + 1).astype(int)
    for i in range(cols):
        for j in range(rows):
            cell = _tile(photos[int(rng.integers(len(photos)))], xs[i + 1] - xs[i], ys[j + 1] - ys[j], rng)
            canvas.paste(cell, (int(xs[i]), int(ys[j])))
    return canvas


def caption(rng: np.random.Generator) -> str:
    """A COCO-length caption (mean ~10.5 words)."""
    words = int(np.clip(round(rng.normal(10.5, 2.5)), 6, 50))
    return " ".join(rng.choice(WORDS, words))


def build(root: Path, spec: PhotoSet, seed: int = 0) -> Path:
    """Write ``spec.count`` JPEGs and a train.jsonl (5 captions each) under ``root/spec.name``; reused if present."""
    folder = root / spec.name
    jsonl = folder / "train.jsonl"
    if jsonl.exists() and sum(1 for _ in open(jsonl)) == spec.count:
        return jsonl
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    photos = list(source_photos().values())
    with open(jsonl, "w") as f:
        for i in range(spec.count):
            width, height = spec.size if rng.random() < 0.75 else spec.size[::-1]
            image = compose(photos, width, height, rng)
            name = f"images/{i:05d}.jpg"
            image.save(
                folder / name,
                quality=int(rng.integers(spec.quality[0], spec.quality[1] + 1)),
                subsampling=spec.subsampling,
                progressive=bool(rng.random() < spec.progressive),
            )
            f.write(json.dumps({"image": name, "text": [caption(rng) for _ in range(5)]}) + "\n")
    return jsonl


def bits_per_pixel(jsonl: Path) -> float:
    """Mean compressed size per pixel (camera JPEGs at q~90 are typically 2-4 bits per pixel)."""
    bits = pixels = 0
    for line in open(jsonl):
        path = jsonl.parent / json.loads(line)["image"]
        with Image.open(path) as img:
            pixels += img.width * img.height
        bits += path.stat().st_size * 8
    return bits / pixels


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mm_lightning_real_photos")
    print("sources:", ", ".join(source_photos()))
    for spec in PHOTO_SETS.values():
        path = build(out, spec)
        print(
            f"{spec.name:10s} {spec.describe():32s} {spec.count:4d} images {bits_per_pixel(path):.2f} bits/px"
        )
