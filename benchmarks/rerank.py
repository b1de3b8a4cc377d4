"""Re-ranking with the matching head on real photos: test R@1 with and without, and what it costs.

Trains ``configs/finetune.yaml`` with the matching head on (``objective.itm_weight: 1``) on the dev set's training
split (the split of ``benchmarks/recipes.py``: 150 train / 30 val / 59 test photos, 5 captions each), then scores
the checkpoint picked on ``val/r1_t2i`` with ``python -m mm_lightning evaluate``, without and with ``--rerank_k``.

    python benchmarks/rerank.py                     # the dev set (../shared/devdata/coco_mini), 10 epochs
    python benchmarks/rerank.py --epochs 20 --rerank_k 8 16
    python benchmarks/rerank.py --quick             # 16 small real photos, 64 px, one epoch, k = 2

``--quick`` checks the script end to end without the dev set: 16 JPEGs cut from the photographs that ship with
scikit-image (``benchmarks/support/real_photos.py``), split 8 / 4 / 4, the towers at 64 px, batches of 8, and every file
in a fresh temporary folder, removed at the end; k = 2 of the 4 test images, so the top k is a real cut.

The last line is ``RESULT rerank ratio=<re-ranked test R@1 / contrastive test R@1, text to image>`` for the first
``--rerank_k``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from importlib import import_module
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from recipes import CACHE, DEV_SET, QUICK_SPLIT, REPO, SPLIT_SIZES, quick_photos, split_dev_set  # noqa: E402

from mm_lightning.cli import main as mm_lightning_main  # noqa: E402


def run(args: list[str]) -> float:
    """Runs ``python -m mm_lightning ARGS`` in this process (the imports paid once); returns its wall time in
    seconds."""
    start = time.perf_counter()
    if mm_lightning_main(args):
        raise SystemExit(f"python -m mm_lightning {' '.join(args[:2])} failed (its error is above)")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEV_SET, help="a folder of image-caption JSONL files")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rerank_k", type=int, nargs="+", default=[16])
    parser.add_argument("--run", type=Path, default=CACHE / "rerank_run", help="the training run's folder")
    parser.add_argument(
        "--quick", action="store_true", help="16 small real photos, one epoch, in a temporary folder"
    )
    args = parser.parse_args()
    cache, sizes, small = CACHE, SPLIT_SIZES, []
    if args.quick:
        cache = Path(tempfile.mkdtemp(prefix="rerank_quick_"))
        atexit.register(shutil.rmtree, cache, ignore_errors=True)  # a checkpoint holds both towers
        sizes = QUICK_SPLIT
        # the recipe's batch of 128 is more than 8 images x 5 captions hold (a training batch is a full one)
        small = ["--model.image_tower.init_args.image_size", "64", "--data.init_args.batch_size", "8"]
        parser.set_defaults(data=quick_photos(cache, 16), epochs=1, rerank_k=[2], run=cache / "rerank_run")
        args = parser.parse_args()  # the options given still win

    split = split_dev_set(args.data, cache / "split", sizes=sizes)
    data = [f"--data.init_args.{s}_file={split / f'{s}.jsonl'}" for s in ("train", "val", "test")]
    common = [
        "--config",
        str(REPO / "configs" / "finetune.yaml"),
        *data,
        "--model.objective.itm_weight",
        "1.0",
        *small,
    ]
    checkpoints = args.run / "checkpoints"
    if not list(checkpoints.glob("best-*.ckpt")):
        fit_s = run(
            [
                "fit",
                *common,
                "--trainer.max_epochs",
                str(args.epochs),
                "--trainer.default_root_dir",
                str(args.run),
            ]
        )
        print(f"fit: {fit_s:.0f} s", flush=True)
    best = str(sorted(checkpoints.glob("best-*.ckpt"))[-1])
    evaluate = [
        "evaluate",
        *common,
        "--ckpt_path",
        best,
        "--trainer.default_root_dir",
        str(args.run / "evaluate"),
    ]

    rows = []
    # what evaluate loads on first use, loaded before the timed commands so that the first does not pay for it
    import_module("mm_lightning.commands.evaluate")
    import_module("scipy.stats")
    plain_s = run([*evaluate, "--output", str(args.run / "plain")])
    plain = json.loads((args.run / "plain" / "test_zeroshot_retrieval.json").read_text())["metrics"]
    rows.append(("contrastive (cosine)", plain, plain_s))
    for k in args.rerank_k:
        out = args.run / f"rerank{k}"
        seconds = run([*evaluate, "--output", str(out), "--rerank_k", str(k)])
        reranked = json.loads((out / f"test+itm_rerank{k}_zeroshot_retrieval.json").read_text())["metrics"]
        rows.append((f"re-ranked top {k} (match logit + cosine)", reranked, seconds))

    print(f"\ncheckpoint {best}\n")
    print("| scores | R@1 t2i | R@5 t2i | R@10 t2i | R@1 i2t | R@5 i2t | R@10 i2t | evaluate s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, m, seconds in rows:
        cells = [m[f"{w}_retrieval_recall@{n}"] for w in ("image", "text") for n in (1, 5, 10)]
        print(f"| {label} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {seconds:.0f} |")
    first = rows[1][1]["image_retrieval_recall@1"] / max(plain["image_retrieval_recall@1"], 1e-9)
    print(f"RESULT rerank ratio={first:.3f}")


if __name__ == "__main__":
    main()
