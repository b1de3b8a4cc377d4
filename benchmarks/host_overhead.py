"""Host time per step that Lightning and the CLI's defaults add to a plain loop, in milliseconds, with towers so
small that the plain loop's step takes a few milliseconds on a CPU.

    python benchmarks/host_overhead.py [--steps 300] [--warmup 30] [--rounds 5] [--threads 1]
    python benchmarks/host_overhead.py --quick   # checks that it runs: 4 steps, 1 round, a temporary folder

On a GPU, host work per step is free only while the host runs ahead of the device; with a 135 ms device step,
20 ms of hooks is 15 %. ``lightning_overhead.py`` measures the demo's step (about a second on a CPU), where such
costs vanish in the ratio; this benchmark makes the model's own work small, so what is left is the host time of:

  plain:   the module's ``training_step``, ``backward``, clipping, AdamW and the LR schedule in a for loop;
  bare:    ``Trainer.fit`` with no logger, callbacks or progress bar (Lightning's loop + the module's hooks);
  default: ``Trainer.fit`` as the CLI builds it from ``configs/demo.yaml``: TensorBoard, the progress bar and
           every default callback (``mm_lightning/callbacks/default.yaml``).

Same model, optimizer, schedule and in-memory batches in all three (``lightning_overhead.Harness``); runs alternate
in rounds, a run's figure is its median step (the interval between two batch starts); the added times are the
median over rounds of the differences within a round. One more default run under Lightning's ``SimpleProfiler``
gives each callback's per-step hooks in ms.
Last line: ``RESULT host_overhead ms_per_step=<default - bare>``, with bare Lightning's own ``bare - plain``;
target: the defaults add <= 1 ms per step beyond bare Lightning.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from lightning_overhead import QUICK, Harness, data_folder, print_attribution, quiet_process

# towers of a few thousand parameters: the model's own step is a few ms, so the host's share is what is measured
SMALL_MODEL = [
    "--model.image_tower.init_args.kwargs", json.dumps({"widths": [8, 16], "layers": [1, 1]}),
    "--model.image_tower.init_args.image_size", "32",
    "--model.text_tower.init_args.config_overrides",
    json.dumps({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}),
    "--model.embed_dim", "16",
    "--model.fusion.heads", "2",
    "--data.init_args.render_size", "32",
    "--data.init_args.batch_size", "8",
]  # fmt: skip


def report(args: argparse.Namespace, harness: Harness) -> None:
    """The runs, the added times (medians over rounds), the attribution and the RESULT line."""
    print(f"default callbacks: {', '.join(harness.callback_names)}", flush=True)
    kinds = ["plain", "bare", "default"]
    walls: dict[str, list[float]] = defaultdict(list)
    for r in range(args.rounds):
        for kind in kinds:
            wall, _ = harness.plain(args.warmup) if kind == "plain" else harness.fit(args.warmup, kind)
            walls[kind].append(1000 * wall)
            print(f"round {r} {kind:8s} step {1000 * wall:7.3f} ms", flush=True)
    step = {kind: statistics.median(v) for kind, v in walls.items()}
    # the differences within a round (runs side by side under the same load), then their median over rounds
    bare = statistics.median(b - p for b, p in zip(walls["bare"], walls["plain"], strict=True))
    defaults = statistics.median(d - b for d, b in zip(walls["default"], walls["bare"], strict=True))
    print("\nmedian step over rounds (ms):", "  ".join(f"{k} {v:.3f}" for k, v in step.items()))
    print_attribution(harness, args.warmup, args.steps)
    print(
        f"RESULT host_overhead ms_per_step={defaults:.3f} (the CLI's defaults beyond bare Lightning; bare "
        f"Lightning beyond the plain loop {bare:.3f} ms; median step plain {step['plain']:.3f} / bare "
        f"{step['bare']:.3f} / default {step['default']:.3f} ms; {args.steps} steps ({args.warmup} warm-up) x "
        f"{args.rounds} interleaved rounds, {args.threads} thread(s))"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="batches per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--data",
        type=Path,
        help="data and run folder (default: mm_lightning_host_overhead in the temp folder)",
    )
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 round, in a fresh temporary folder")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 4, 1, 1
    quiet_process(args.threads)
    with data_folder(args.data, args.quick, "mm_lightning_host_overhead") as data:
        report(args, Harness(args.steps, data, [*SMALL_MODEL, *QUICK] if args.quick else SMALL_MODEL))


if __name__ == "__main__":
    main()
