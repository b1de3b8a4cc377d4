"""``benchmarks/recipes.py`` runs end to end on a few generated photos-like images: the table and the RESULT line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from tests.data.helpers import save_image

WORDS = ["red", "green", "blue", "stone", "sand", "leaf"]


def _split(root: Path, split: str, images: int, offset: int) -> None:
    rows = []
    for i in range(images):
        name = f"{split}_{i}.jpg"
        save_image(root / name, (48, 40), seed=offset + i)
        word = WORDS[(offset + i) % len(WORDS)]
        rows.append({"image": name, "text": [f"a {word} photo number {i}", f"picture {i} in {word}"]})
    (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_recipes_benchmark_prints_the_table_and_the_result(tmp_path: Path) -> None:
    for split, images, offset in (("train", 8, 0), ("val", 4, 100), ("test", 4, 200)):
        _split(tmp_path, split, images, offset)
    done = subprocess.run(
        [sys.executable, "benchmarks/recipes.py", "--data", str(tmp_path), "--image_size", "32", "--epochs", "1",
         "--baseline_steps", "4", "--workers", "0", "--batch_size", "4", "--runs_dir", str(tmp_path / "runs"),
         "--logs", str(tmp_path / "tb"), "--curves", str(tmp_path / "curves.png")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("| frozen towers + linear heads") for line in lines), done.stdout
    assert any(line.startswith("| configs/lit.yaml |") for line in lines), done.stdout
    result = re.fullmatch(r"RESULT recipes ratio=(\d+\.\d+) \(.*\)", lines[-1])
    assert result is not None, lines[-1]
    recalls = [float(v) for line in lines if line.startswith("| frozen") for v in line.split("|")[2:8]]
    assert len(recalls) == 6 and all(0.0 <= r <= 1.0 for r in recalls)
    # the learning curves come from the run's own TensorBoard events
    assert list((tmp_path / "tb" / "lit").glob("version_0/events.out.tfevents.*"))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
