"""``benchmarks/recipes.py --quick`` (16 small real photos) runs end to end 2-fold: the table (mean ± std over the
folds, trainable parameters, peak memory) and the RESULT line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests import preloaded


def test_recipes_benchmark_cross_validates_and_prints_the_table_and_the_result(tmp_path: Path) -> None:
    done = preloaded.run(
        [sys.executable, "benchmarks/recipes.py", "--quick", "--folds", "2", "--runs_dir", str(tmp_path / "runs"),
         "--curves", str(tmp_path / "curves.png")],
        capture_output=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert any(line.startswith("| frozen towers + linear heads") for line in lines), done.stdout
    assert any(line.startswith("| configs/lit.yaml |") for line in lines), done.stdout
    # each figure with its interval over the pooled test images, and LiT against the baseline on the same ones
    (header,) = [line for line in lines if line.startswith("| figure |")]
    assert header.endswith("| configs/lit.yaml - baseline (paired) |"), header
    (r1,) = [line.split("|")[2:-1] for line in lines if line.startswith("| R@1 t2i |")]
    for run in r1[:2]:
        value, low, high = map(
            float, re.fullmatch(r" (\d\.\d{3}) \((\d\.\d{3})-(\d\.\d{3})\) ", run).groups()
        )
        assert low <= value <= high
    assert re.fullmatch(r" [+-]\d\.\d{3} \([+-]\d\.\d{3} to [+-]\d\.\d{3}\), \d+ % ", r1[2]), r1[2]
    result = re.fullmatch(r"RESULT recipes ratio=(\d+\.\d+) \(.*\)", lines[-1])
    assert result is not None, lines[-1]
    assert sum(line.startswith("data ") and "train 6, val 2, test 8" in line for line in lines) == 2, (
        done.stdout
    )
    (baseline,) = [line.split("|")[2:-1] for line in lines if line.startswith("| frozen")]
    spreads = [re.fullmatch(r" (\d\.\d{3}) ± (\d\.\d{3}) ", cell) for cell in baseline[:6]]
    assert all(s is not None and 0.0 <= float(s[1]) <= 1.0 for s in spreads), baseline
    trainable, peak_mb = int(baseline[8].replace(",", "")), float(baseline[9])
    (lit,) = [line.split("|")[2:-1] for line in lines if line.startswith("| configs/lit.yaml")]
    assert int(lit[8].replace(",", "")) > trainable  # the text tower's last two layers train too
    folds = [
        {split: {json.loads(r)["image"] for r in (tmp_path / "runs" / "folds2" / f"fold{f}" / f"{split}.jsonl").open()}
         for split in ("train", "val", "test")}
        for f in range(2)
    ]  # fmt: skip
    assert folds[0]["test"].isdisjoint(folds[1]["test"]) and len(folds[0]["test"] | folds[1]["test"]) == 16
    assert all(
        len(f["train"] | f["val"] | f["test"]) == 16 for f in folds
    )  # each image in one split of a fold
    assert (
        trainable == (1280 + 1) * 256 + (384 + 1) * 256 + 1 and peak_mb > 100
    )  # two heads + the temperature
    # the learning curves come from the runs' own TensorBoard events, in the run folder the CLI gave them
    events = list((tmp_path / "runs" / "lit").glob("version_*/events.out.tfevents.*"))
    assert len(events) == 4  # fit and test, in each fold
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
