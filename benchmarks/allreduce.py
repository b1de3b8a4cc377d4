"""Step time of stock DDP vs ``ddp_explicit`` (bucketed, bucketed + overlap, per_parameter) on 2 gloo processes.

Run: ``python benchmarks/allreduce.py`` (add ``--models demo`` or ``--steps 4 --reps 1`` for a quick look);
``python benchmarks/allreduce.py --quick`` checks that it runs: the demo model, batches of 8, one timed step, one rep.

Two CPU processes (gloo, one thread each) train the project's ``MultimodalModule`` on synthetic batches:
``demo`` is the configs/demo.yaml model, ``25m`` swaps in a ResNet-50 image tower (~25M parameters, 100 MB
of fp32 gradients per step). Variants run interleaved, ``--reps`` times each, so load from other processes
on the machine hits them alike; the step time of a variant is the median over all its timed steps (rank 0,
from ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, reduction, optimizer step).
The last line is ``RESULT allreduce ratio=<bucketed / ddp step time on the 25m model> (...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from mm_lightning.cli import cli_main
from mm_lightning.config_parser import CHECKPOINT_GROUPS

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("ddp", "bucketed", "bucketed_overlap", "per_parameter")
WARMUP_STEPS = 2


class SyntheticPairs(Dataset):
    """Random normalized images and token ids shaped like the DataModule's batches (no decoding cost)."""

    def __init__(self, n: int, image_size: int, length: int = 16, vocab: int = 36) -> None:
        generator = torch.Generator().manual_seed(0)
        self.images = torch.randn(n, 3, image_size, image_size, generator=generator)
        self.ids = torch.randint(5, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "image": self.images[i],
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "image_id": torch.tensor(i),
            "index": torch.tensor(i),
        }


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def strategy_option(variant: str) -> str:
    """The variant as a ``--trainer.strategy`` value (``configs/ddp_explicit.yaml`` names the explicit one)."""
    if variant == "ddp":
        return "ddp"
    mode = (
        {"mode": "bucketed", "overlap_backward": True} if variant == "bucketed_overlap" else {"mode": variant}
    )
    return json.dumps({"class_path": "mm_lightning.extras.ExplicitAllReduceDDPStrategy", "init_args": mode})


def time_fit(
    model_name: str, variant: str, steps: int, batch_size: int, run_dir: str
) -> tuple[list[float], int]:
    """The demo's module and a 2-process trainer as the CLI builds them (no logger or callbacks besides the
    timer), fed the synthetic batches; the step times after the warm-up and the module's parameter count."""
    resnet50 = [
        "--model.image_tower.init_args.name",
        "resnet50",
        "--model.image_tower.init_args.kwargs",
        "{}",
    ]
    cli = cli_main(
        [
            "--config", str(REPO / "configs" / "demo.yaml"),
            *(resnet50 if model_name == "25m" else []),
            "--trainer.devices", "2",
            "--trainer.strategy", strategy_option(variant),
            "--trainer.max_steps", str(WARMUP_STEPS + steps),
            "--trainer.logger", "false",
            "--trainer.callbacks", "[]",
            *[f"--{group}.save_top_k=0" for group in CHECKPOINT_GROUPS],  # no checkpoints
            "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false",
            "--trainer.limit_val_batches", "0",
            "--trainer.default_root_dir", run_dir,
        ],
        run=False,
    )  # fmt: skip
    timer = StepTimer()
    cli.trainer.callbacks.append(timer)  # an instrument, not part of the run
    data = SyntheticPairs(2 * batch_size * (WARMUP_STEPS + steps), image_size=64)
    cli.trainer.fit(cli.model, train_dataloaders=DataLoader(data, batch_size=batch_size))
    return timer.times[WARMUP_STEPS:], sum(p.numel() for p in cli.model.parameters())


def worker(rank: int, port: int, out_dir: str, args: argparse.Namespace) -> None:
    # torchrun-style variables: Lightning joins this process group instead of launching processes itself.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")  # fmt: skip
    torch.set_num_threads(1)
    times: dict[str, dict[str, list[float]]] = {}
    params: dict[str, int] = {}
    for model_name in args.models:
        batch_size = 32 if model_name == "demo" and not args.quick else 8
        for _ in range(args.reps):
            for variant in VARIANTS:
                step_times, params[model_name] = time_fit(
                    model_name, variant, args.steps, batch_size, out_dir
                )
                times.setdefault(model_name, {}).setdefault(variant, []).extend(step_times)
    if rank == 0:
        (Path(out_dir) / "times.json").write_text(json.dumps({"times": times, "params": params}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["demo", "25m"], choices=["demo", "25m"])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per fit (after 2 warm-up steps)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of every variant")
    parser.add_argument("--quick", action="store_true", help="--models demo --steps 1 --reps 1, batches of 8")
    args = parser.parse_args()
    if args.quick:
        args.models, args.steps, args.reps = ["demo"], 1, 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(port, out_dir, args), nprocs=2, join=True)
        measured = json.loads((Path(out_dir) / "times.json").read_text())
    times, params = measured["times"], measured["params"]

    summary = {}
    for model_name, per_variant in times.items():
        n_params = params[model_name]
        medians = {v: statistics.median(t) for v, t in per_variant.items()}
        summary[model_name] = {v: medians[v] / medians["ddp"] for v in VARIANTS}
        print(
            f"{model_name} ({n_params / 1e6:.1f}M params), median step time over {len(per_variant['ddp'])} steps:"
        )
        for variant in VARIANTS:
            print(
                f"  {variant:17s} {medians[variant] * 1000:8.1f} ms   x{summary[model_name][variant]:.3f} vs ddp"
            )
    key = "25m" if "25m" in summary else args.models[0]
    details = ", ".join(
        f"{m}: " + " ".join(f"{v}={r:.3f}" for v, r in s.items() if v != "ddp") for m, s in summary.items()
    )
    print(
        f"RESULT allreduce ratio={summary[key]['bucketed']:.3f} (bucketed/ddp step time on {key}; {details})"
    )


if __name__ == "__main__":
    main()
