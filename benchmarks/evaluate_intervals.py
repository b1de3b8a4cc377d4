"""What the bootstrap intervals add to ``evaluate``: a 5,000-caption test set of real photos, with and without.

The test set is 1,000 images x 5 captions: the dev set's photos (239 COCO photos, 5 human captions each) under
1,000 names (symbolic links in ``benchmarks/_cache/``, so each name is an image of its own). The demo config's
model is fitted for one step on it, and ``python -m mm_lightning evaluate`` scores that checkpoint with
``--bootstrap_resamples 0`` and with the default 1,000, in alternating order, each in a process of its own.

    python benchmarks/evaluate_intervals.py
    python benchmarks/evaluate_intervals.py --rounds 5 --images 2000
    python benchmarks/evaluate_intervals.py --quick    # one round on 16 test images, in a temporary folder

``--quick`` checks the script end to end without the dev set: the 16 test images are 8 JPEGs cut from the
photographs that ship with scikit-image (``benchmarks/support/real_photos.py``), each under 2 names, the model is fitted
and scored at batch size 8, and every file goes to a fresh temporary folder, removed at the end.

The last line is ``RESULT evaluate_intervals ratio=<median wall time with intervals / without>``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recipes import CACHE, DEV_SET, REPO, dev_records, quick_photos  # noqa: E402
from rerank import run  # noqa: E402


def test_set(source: Path, images: int, out: Path) -> Path:
    """``images`` records of the photos in ``source`` (the dev set's layout), each under a name of its own, 5
    captions each."""
    records = dev_records(source)
    links = out / "images"
    links.mkdir(parents=True, exist_ok=True)
    lines = []
    for number in range(images):
        record = records[number % len(records)]
        link = links / f"{number:05d}.jpg"
        if not link.exists():
            link.symlink_to(record["image"])
        lines.append(json.dumps({"image": str(link), "text": record["text"][:5]}))
    file = out / "test.jsonl"
    file.write_text("\n".join(lines) + "\n")
    return file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000, help="test images (5 captions each)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each setting, alternating")
    parser.add_argument(
        "--quick", action="store_true", help="one round on 16 test images, in a temporary folder"
    )
    args = parser.parse_args()
    folder, photos, batch_size = CACHE / "evaluate_intervals", DEV_SET, 128
    if args.quick:
        folder = Path(tempfile.mkdtemp(prefix="evaluate_intervals_quick_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        photos, batch_size = quick_photos(folder, 8), 8  # 16 images hold no full training batch of 128
        parser.set_defaults(images=16, rounds=1)
        args = parser.parse_args()  # the options given still win

    file = test_set(photos, args.images, folder)
    data = {
        "class_path": "mm_lightning.data.MultimodalDataModule",
        "init_args": {
            "train_file": str(file),
            "test_file": str(file),
            "batch_size": batch_size,
            "num_workers": 1,
        },
    }
    common = ["--config", str(REPO / "configs" / "demo.yaml"), "--data", json.dumps(data)]
    run_dir = folder / "run"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    if not checkpoint.is_file():
        run(["fit", *common, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(run_dir)])
    walls: dict[int, list[float]] = {0: [], 1000: []}
    for number in range(args.rounds):
        for resamples in (0, 1000) if number % 2 == 0 else (1000, 0):
            output = folder / f"results_{resamples}"
            walls[resamples].append(
                run(["evaluate", *common, "--ckpt_path", str(checkpoint), "--output", str(output),
                     "--bootstrap_resamples", str(resamples), "--trainer.default_root_dir", str(run_dir)])
            )  # fmt: skip
            print(f"round {number + 1}, {resamples} resamples: {walls[resamples][-1]:.2f} s", flush=True)

    from mm_lightning.commands.evaluate import figures_of, read_queries
    from mm_lightning.evaluation.intervals import Bootstrap, intervals

    task = "zeroshot_retrieval"
    queries = read_queries(folder / "results_1000" / f"test_{task}.queries.npz", task)
    start = time.perf_counter()
    drawn = intervals(figures_of(task, queries), Bootstrap())
    alone = time.perf_counter() - start
    result = json.loads((folder / "results_1000" / f"test_{task}.json").read_text())
    assert result["intervals"] == drawn  # the command drew these same intervals
    without, with_intervals = (statistics.median(walls[n]) for n in (0, 1000))
    print(f"test set: {result['images']} images, {result['captions']} captions")
    print(
        f"evaluate, median of {args.rounds}: {without:.2f} s without intervals, {with_intervals:.2f} s with"
    )
    paired = sorted(a / b for a, b in zip(walls[1000], walls[0], strict=True))
    print(f"per round, with / without: {', '.join(f'{r:.3f}' for r in paired)}")
    print(f"the bootstrap alone (1,000 resamples, 6 recall figures): {alone:.3f} s")
    # each photo is 4 or 5 test images: ties with its copies keep a caption's own image out of the top 1 to 3
    low, high = drawn["image_retrieval_recall@10"]
    print(f"text->image R@10: {result['metrics']['image_retrieval_recall@10']:.4f} [{low:.4f}, {high:.4f}]")
    print(f"RESULT evaluate_intervals ratio={with_intervals / without:.3f}")


if __name__ == "__main__":
    main()
