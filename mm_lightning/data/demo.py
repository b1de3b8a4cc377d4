"""Deterministic synthetic coloured shapes with compositional captions, as PNG + JSONL (the real data path).
Val and test use attribute combinations unseen in training: unique captions, two per image."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw
from typing_extensions import override

from mm_lightning.data.datamodule import MultimodalDataModule

SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 175, 60),
    "blue": (45, 90, 235),
    "yellow": (240, 215, 40),
    "purple": (150, 60, 205),
    "orange": (245, 135, 25),
}
SIZES: dict[str, float] = {"small": 0.22, "large": 0.42}  # shape diameter as a fraction of the image side
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.27, 0.27),
    "top right": (0.73, 0.27),
    "bottom left": (0.27, 0.73),
    "bottom right": (0.73, 0.73),
    "center": (0.5, 0.5),
}
BACKGROUNDS = {"dark": (25, 25, 30), "gray": (125, 125, 125), "beige": (225, 205, 170)}
TEMPLATES = (
    "a {size} {colour} {shape} in the {position} on a {background} background",
    "{background} background with a {size} {colour} {shape} at the {position}",
)
FORMAT_VERSION = 1

Combo = tuple[str, str, str, str, str]  # shape, colour, size, position, background


def captions_for(combo: Combo) -> list[str]:
    """All captions (one per template) of one attribute combination."""
    shape, colour, size, position, background = combo
    return [
        t.format(shape=shape, colour=colour, size=size, position=position, background=background)
        for t in TEMPLATES
    ]


def _shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r * 0.8, cy), (cx, cy + r), (cx - r * 0.8, cy)]
    if shape == "star":
        points = []
        for k in range(10):
            radius = r if k % 2 == 0 else r * 0.42
            angle = -math.pi / 2 + k * math.pi / 5
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        return points
    raise ValueError(f"not a polygon shape: {shape}")


def render(combo: Combo, image_size: int, rng: random.Random) -> Image.Image:
    """Draw one combination with small random jitter in position, size and colour."""
    shape, colour, size, position, background = combo
    jitter = lambda value, spread: value + rng.uniform(-spread, spread)  # noqa: E731
    bg = tuple(int(min(255, max(0, jitter(c, 12)))) for c in BACKGROUNDS[background])
    fg = tuple(int(min(255, max(0, jitter(c, 18)))) for c in COLOURS[colour])
    image = Image.new("RGB", (image_size, image_size), bg)
    draw = ImageDraw.Draw(image)
    px, py = POSITIONS[position]
    cx, cy = jitter(px, 0.05) * image_size, jitter(py, 0.05) * image_size
    r = jitter(SIZES[size], 0.03) * image_size / 2
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif shape == "square":
        s = r * 0.85
        draw.rectangle([cx - s, cy - s, cx + s, cy + s], fill=fg)
    elif shape == "cross":
        w = r * 0.33
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fg)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fg)
    else:
        draw.polygon(_shape_polygon(shape, cx, cy, r), fill=fg)
    return image


def _split_combos(seed: int, num_val: int, num_test: int) -> dict[str, list[Combo]]:
    combos: list[Combo] = list(itertools.product(SHAPES, COLOURS, SIZES, POSITIONS, BACKGROUNDS))
    random.Random(seed).shuffle(combos)
    if num_val + num_test >= len(combos):
        raise ValueError(f"num_val + num_test must be < {len(combos)} (the number of attribute combinations)")
    return {
        "val": combos[:num_val],
        "test": combos[num_val : num_val + num_test],
        "train": combos[num_val + num_test :],
    }


def generate_demo_dataset(
    root: str | os.PathLike,
    *,
    image_size: int = 64,
    train_renders: int = 4,
    num_val: int = 150,
    num_test: int = 150,
    seed: int = 0,
) -> Path:
    """Write the demo dataset to ``root`` atomically; a complete one with the same parameters is kept."""
    root = Path(root)
    params = {
        "version": FORMAT_VERSION,
        "image_size": image_size,
        "train_renders": train_renders,
        "num_val": num_val,
        "num_test": num_test,
        "seed": seed,
    }
    if is_complete(root, params):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        counts = _write_splits(tmp, params)
        (tmp / "MANIFEST.json").write_text(json.dumps({**params, "counts": counts}, indent=1))
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def _write_splits(out: Path, params: dict[str, Any]) -> dict[str, int]:
    rng = random.Random(params["seed"] + 1)
    counts: dict[str, int] = {}
    for split, combos in _split_combos(params["seed"], params["num_val"], params["num_test"]).items():
        repeats = params["train_renders"] if split == "train" else 1
        image_dir = out / "images" / split
        image_dir.mkdir(parents=True)
        lines = []
        for i, combo in enumerate(c for c in combos for _ in range(repeats)):
            name = f"images/{split}/{i:06d}.png"
            render(combo, params["image_size"], rng).save(out / name)
            lines.append(json.dumps({"image": name, "text": captions_for(combo)}))
        if split == "train":
            rng.shuffle(lines)
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        counts[split] = len(lines)
    return counts


def is_complete(root: Path, params: dict[str, Any]) -> bool:
    """True when ``root`` holds a finished dataset built with ``params`` (manifest + files present)."""
    try:
        manifest = json.loads((root / "MANIFEST.json").read_text())
    except (OSError, ValueError):
        return False
    if {k: manifest.get(k) for k in params} != params:
        return False
    for split, count in manifest.get("counts", {}).items():
        jsonl = root / f"{split}.jsonl"
        if not jsonl.is_file() or sum(1 for _ in jsonl.open()) != count:
            return False
        if len(list((root / "images" / split).iterdir())) != count:
            return False
    return True


def demo_generator_args(
    render_size: int, train_renders: int, num_val: int, num_test: int, demo_seed: int
) -> dict[str, int]:
    """The :func:`generate_demo_dataset` arguments of a demo datamodule's options (JSONL or shards)."""
    return {
        "image_size": render_size,
        "train_renders": train_renders,
        "num_val": num_val,
        "num_test": num_test,
        "seed": demo_seed,
    }


class DemoDataModule(MultimodalDataModule):
    """The synthetic demo: generated on first use, then read like user data.

    Args:
        data_dir: cache directory of the generated files (JSONL + PNG images).
        render_size: generated image side in pixels (the transforms then resize to ``images.size``).
        train_renders: renders (random jitter) of each training attribute combination.
        num_val: validation images (held-out attribute combinations, unique captions).
        num_test: test images (held-out attribute combinations, unique captions).
        demo_seed: generator seed (the dataset is a pure function of these arguments).
        **kwargs: any other :class:`MultimodalDataModule` argument (batch_size, images, loader, tokenizer, ...).
    """

    def __init__(
        self,
        data_dir: str = "data/demo",
        render_size: int = 64,
        train_renders: int = 4,
        num_val: int = 150,
        num_test: int = 150,
        demo_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        root = Path(data_dir)
        super().__init__(
            train_file=str(root / "train.jsonl"),
            val_file=str(root / "val.jsonl"),
            test_file=str(root / "test.jsonl"),
            predict_file=str(root / "test.jsonl"),
            **kwargs,
        )
        self.data_dir = root
        self.generator_args = demo_generator_args(render_size, train_renders, num_val, num_test, demo_seed)

    @override
    def prepare_data(self) -> None:
        generate_demo_dataset(self.data_dir, **self.generator_args)
        super().prepare_data()
