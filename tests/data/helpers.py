"""Helpers for the data tests: natural-looking images and JSONL files written into a temporary folder."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

TOKENIZER = "mm-lightning/demo-bert"


def natural_array(height: int, width: int, seed: int = 0) -> np.ndarray:
    """Smooth colour field plus mild noise: compresses and decodes like a photo, not like white noise."""
    rng = np.random.default_rng(seed)
    low = Image.fromarray((rng.random((6, 8, 3)) * 255).astype(np.uint8)).resize(
        (width, height), Image.BICUBIC
    )
    arr = np.asarray(low, dtype=np.float32) + rng.normal(0, 6, (height, width, 3))
    return arr.clip(0, 255).astype(np.uint8)


def save_image(path: Path, size: tuple[int, int] = (48, 40), seed: int = 0, **save_kwargs: object) -> Path:
    """Write a natural-looking RGB image of ``size`` (width, height); the format follows the suffix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(natural_array(size[1], size[0], seed)).save(path, **save_kwargs)
    return path


def write_jsonl(path: Path, rows: Iterable[dict | str]) -> Path:
    """Write rows (dicts as JSON, strings verbatim) one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def coco_style(
    root: Path, num_images: int = 6, captions_per_image: int = 3, size: tuple[int, int] = (48, 40)
) -> Path:
    """A COCO-style split: one line per image, ``text`` a list of captions; returns the JSONL path."""
    rows = []
    for i in range(num_images):
        save_image(root / "images" / f"{i:03d}.jpg", size, seed=i)
        caps = [f"a red circle number {i} version {j}" + " left" * (i % 3) for j in range(captions_per_image)]
        rows.append({"image": f"images/{i:03d}.jpg", "text": caps})
    return write_jsonl(root / "split.jsonl", rows)


def one_bad_image_with_five_captions(root: Path) -> Path:
    """9 good images with a caption each, and at lines 4-8 one undecodable image named by 5 caption lines."""
    rows: list[dict | str] = []
    for i in range(9):
        save_image(root / "images" / f"{i}.jpg", (20, 16), seed=i)
        rows.append({"image": f"images/{i}.jpg", "text": f"photo {i}"})
    (root / "images" / "broken.jpg").write_bytes(b"\xff\xd8 not a whole jpeg")
    rows[3:3] = [{"image": "images/broken.jpg", "text": f"broken caption {c}"} for c in range(5)]
    return write_jsonl(root / "five.jsonl", rows)
