"""Generated "natural-looking" JPEGs (smooth colour fields, shapes, noise): a secondary benchmark row only.

They compress like photos but decode much faster than camera photos of the same size, so loader speed-ups
measured on them do not transfer; ``benchmarks/data_pipeline.py --synthetic`` prints them labelled as such.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter
from support.real_photos import caption


def natural_image(rng: np.random.Generator, width: int = 640, height: int = 480) -> Image.Image:
    """Multi-octave smooth colour field, a few shapes, sensor-like noise."""
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


def build_synthetic(root: Path, n: int) -> Path:
    """Write n generated 640x480 q90 JPEGs + train.jsonl under root (reused when already there)."""
    jsonl = root / "train.jsonl"
    if jsonl.exists() and sum(1 for _ in open(jsonl)) == n:
        return jsonl
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(jsonl, "w") as f:
        for i in range(n):
            natural_image(rng).save(root / "images" / f"{i:05d}.jpg", quality=90)
            f.write(
                json.dumps({"image": f"images/{i:05d}.jpg", "text": [caption(rng) for _ in range(5)]}) + "\n"
            )
    return jsonl
