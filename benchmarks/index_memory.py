"""Index memory: JsonlIndex (offsets + numpy arrays) vs a list of dicts, on a 1,000,000-line JSONL.

    python benchmarks/index_memory.py [--lines 1000000] [--visit 300000] [--workers 2]
    python benchmarks/index_memory.py --quick   # seconds: the same path on 10,000 lines (a noisy ratio)

Each variant runs in a fresh interpreter and reports (1) the RSS the index adds, peak included, and (2) how
much the forked DataLoader workers' private memory (USS) grows while they read ``--visit`` records: a Python
list is ref-counted on every access, so copy-on-write duplicates its pages in each worker; numpy arrays are
one object each and their pages are only read. Target: index <= 100 MB, worker growth flat.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_jsonl(path: Path, lines: int) -> Path:
    if path.exists() and sum(1 for _ in open(path, "rb")) == lines:
        return path
    words = "a man woman dog cat on the street with red blue bus train sitting next to table".split()
    with open(path, "w") as f:
        for i in range(lines):
            caption = " ".join(words[(i * 7 + k) % len(words)] for k in range(8 + i % 7))
            # ~5 captions per image, as in COCO: consecutive lines share an image
            f.write(json.dumps({"image": f"train2017/{i // 5:012d}.jpg", "text": caption}) + "\n")
    return path


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


class ListDataset:
    """The plain layout: every record a dict in one Python list."""

    def __init__(self, path: str) -> None:
        with open(path) as f:
            self.rows = [json.loads(line) for line in f]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> str:
        return self.rows[i]["text"]


class IndexDataset:
    """Same access through JsonlIndex: offsets in numpy, lines re-read on demand."""

    def __init__(self, path: str) -> None:
        from mm_lightning.data.jsonl import JsonlIndex, RecordParser  # imported (and measured) before

        self.index = JsonlIndex(RecordParser(path, "image", "text", os.path.dirname(path), False))

    def __len__(self) -> int:
        return self.index.num_captions

    def __getitem__(self, i: int) -> str:
        return self.index.read(int(self.index.cap_line[i])).captions[0]


def count(batch: list[str]) -> int:
    return len(batch)


def child(kind: str, path: str, visit: int, workers: int) -> dict[str, float]:
    from torch.utils.data import DataLoader

    import mm_lightning.data.jsonl  # noqa: F401  (library imports are not index memory)

    base = rss_mb()
    start = time.perf_counter()
    dataset = IndexDataset(path) if kind == "index" else ListDataset(path)
    build_s = time.perf_counter() - start
    after = rss_mb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    loader = DataLoader(
        dataset,
        batch_size=1000,
        sampler=range(visit),
        num_workers=workers,
        collate_fn=count,
        multiprocessing_context="fork",
        persistent_workers=True,
    )
    kids = psutil.Process().children
    uss_start, uss_end = [], []
    for n, _ in enumerate(loader):
        if n == 1:
            uss_start = [c.memory_full_info().uss / 2**20 for c in kids()]
    uss_end = [c.memory_full_info().uss / 2**20 for c in kids()]
    del loader
    return {
        "index_mb": after - base,
        "peak_mb": peak - base,
        "build_s": build_s,
        "worker_uss_start_mb": sum(uss_start) / len(uss_start),
        "worker_growth_mb": (sum(uss_end) - sum(uss_start)) / len(uss_end),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--visit", type=int, default=300_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--child", choices=["index", "list"])
    parser.add_argument("--path", type=Path, default=Path(tempfile.gettempdir()) / "mm_lightning_1m.jsonl")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the same path in seconds on 10,000 lines, in a fresh temporary folder",
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, str(args.path), args.visit, args.workers)))
    elif args.quick:
        with tempfile.TemporaryDirectory(prefix="mm_lightning_index_memory_") as scratch:
            # 3 batches of reads: the workers' memory is taken after the second
            args.lines, args.visit, args.path = 10_000, 3_000, Path(scratch) / "lines.jsonl"
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    make_jsonl(args.path, args.lines)
    results = {}
    for kind in ("list", "index"):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--path",
            str(args.path),
            "--visit",
            str(args.visit),
            "--workers",
            str(args.workers),
        ]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results[kind] = json.loads(out)
        r = results[kind]
        print(
            f"{kind:5s}: index +{r['index_mb']:.0f} MB RSS (peak +{r['peak_mb']:.0f} MB), built in "
            f"{r['build_s']:.1f} s; worker USS {r['worker_uss_start_mb']:.0f} MB, grows "
            f"{r['worker_growth_mb']:+.0f} MB per worker over {args.visit} reads",
            flush=True,
        )
    lst, idx = results["list"], results["index"]
    # a small file's index may add less than the RSS can show
    ratio = lst["index_mb"] / idx["index_mb"] if idx["index_mb"] > 0 else float("nan")
    print(
        f"RESULT index_memory ratio={ratio:.1f} (list of dicts +{lst['index_mb']:.0f} MB "
        f"vs JsonlIndex +{idx['index_mb']:.0f} MB (peak +{idx['peak_mb']:.0f}) for {args.lines} lines; worker "
        f"growth {lst['worker_growth_mb']:+.0f} vs {idx['worker_growth_mb']:+.0f} MB/worker over {args.visit} reads)"
    )


if __name__ == "__main__":
    main()
