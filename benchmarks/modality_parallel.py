"""Step time of DDP vs modality parallelism (``configs/modality_parallel.yaml``) on 2 gloo processes, with towers
of deliberately unequal cost, beside what the cost model in docs/scaling.md predicts from each part's measured time.

Run: ``python benchmarks/modality_parallel.py`` (``--quick`` checks that it runs: one timed step, one rep).

Two CPU processes (one thread each) train the project's ``MultimodalModule`` on synthetic batches of the same
global batch: a ViT image tower about 3x the demo text tower's cost. Under DDP each process runs both towers on
half the batch and all-reduces every gradient; under modality parallelism process 0 runs the image tower on the
whole batch, process 1 the text tower, they exchange embeddings, and only the heads' gradients cross. Variants
run interleaved, ``--reps`` times each; a variant's step time is the median of rank 0's timed steps.

The cost model (docs/scaling.md) is fed per-part times measured here, both processes busy as in training:
each tower's forward + backward on the rows it would get, the heads' loss, an all-reduce of each part's
gradients. The last line is ``RESULT modality_parallel ratio=<MP / DDP measured step time> (predicted ...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from allreduce import StepTimer, SyntheticPairs  # the 2-process DDP benchmark's batches and timer
from torch.utils.data import DataLoader

from mm_lightning.cli import cli_main
from mm_lightning.config_parser import CHECKPOINT_GROUPS
from mm_lightning.extras.modality_parallel import Layout, exchange_rows

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
WARMUP_STEPS = 2
VARIANTS = ("ddp", "modality_parallel")
# a ViT about 3x the demo text tower's forward + backward at 64 px (measured ratio printed by the run)
IMAGE_TOWER = {"patch_size": 8, "num_layers": 1, "num_heads": 4, "hidden_dim": 128, "mlp_dim": 512}


def cli_args(variant: str, steps: int, run_dir: str) -> list[str]:
    strategy = (
        ["--config", str(REPO / "configs" / "modality_parallel.yaml")]
        if variant == "modality_parallel"
        else ["--trainer.strategy", "ddp", "--trainer.limit_val_batches", "0"]
    )
    return [
        "--config", str(REPO / "configs" / "demo.yaml"),
        "--model.image_tower.init_args.name", "vit_custom",
        "--model.image_tower.init_args.kwargs", json.dumps(IMAGE_TOWER),
        "--model.objective.itm_weight", "0",
        "--trainer.devices", str(WORLD),
        *strategy,
        "--trainer.max_steps", str(WARMUP_STEPS + steps),
        "--trainer.logger", "false",
        "--trainer.callbacks", "[]",
        *[f"--{group}.save_top_k=0" for group in CHECKPOINT_GROUPS],  # no checkpoints
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", run_dir,
    ]  # fmt: skip


def time_fit(variant: str, steps: int, global_batch: int, run_dir: str) -> list[float]:
    """Rank 0's step times after the warm-up. Each reader gets its share of the same global batch: half under
    DDP, all of it under modality parallelism (one process per tower)."""
    cli = cli_main(cli_args(variant, steps, run_dir), run=False)
    timer = StepTimer()
    cli.trainer.callbacks.append(timer)  # an instrument, not part of the run
    readers = WORLD if variant == "ddp" else 1
    data = SyntheticPairs(global_batch * (WARMUP_STEPS + steps), image_size=64)
    loader = DataLoader(data, batch_size=global_batch // readers)
    cli.trainer.fit(cli.model, train_dataloaders=loader)
    return timer.times[WARMUP_STEPS:]


def median_time(work: Callable[[], Any], reps: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part_times(global_batch: int, reps: int) -> dict[str, float]:
    """Each part of a step timed alone (seconds), every process doing the same at once, as in a step."""
    cli = cli_main(cli_args("ddp", 1, tempfile.mkdtemp()), run=False)
    network = cli.model.model
    data = SyntheticPairs(global_batch, image_size=64)
    batch = next(iter(DataLoader(data, batch_size=global_batch)))
    batch["image_id"] = batch["image_id"].long()

    def tower(kind: str, rows: int) -> Callable[[], None]:
        def run() -> None:
            rows_of = {key: value[:rows] for key, value in batch.items()}
            _, emb = (
                network.encode_images(rows_of["image"]) if kind == "image" else network.encode_text(rows_of)
            )
            emb.sum().backward()

        return run

    def heads(rows: int) -> Callable[[], None]:
        image = torch.randn(rows, network.embed_dim, requires_grad=True)
        text = torch.randn(rows, network.embed_dim, requires_grad=True)

        def run() -> None:
            terms, _ = network.losses(batch["image_id"][:rows], None, None, image, None, text)
            sum(terms.values()).backward()

        return run

    def exchange(rows: int) -> Callable[[], None]:
        layout, rank = Layout(1, 1), dist.get_rank()
        width = network.embed_dim
        send = [count * width for count in layout.sends(rank, rows)]
        receive = [count * width for count in layout.receives(rank, rows)]
        flat = torch.randn(rows * width, requires_grad=True)
        return lambda: exchange_rows(flat, send, receive).sum().backward()

    def optimizer_step(parameters: list[torch.nn.Parameter]) -> Callable[[], None]:
        copies = [torch.nn.Parameter(p.detach().clone()) for p in parameters]
        for copy in copies:
            copy.grad = torch.randn_like(copy)
        return torch.optim.AdamW(copies, lr=1e-4).step

    def all_reduce(parameters: list[torch.nn.Parameter]) -> Callable[[], None]:
        flat = torch.zeros(sum(p.numel() for p in parameters))
        return lambda: dist.all_reduce(flat)

    half = global_batch // WORLD
    image_params = [*network.image_encoder.parameters(), *network.image_proj.parameters()]
    text_params = [*network.text_encoder.parameters(), *network.text_proj.parameters()]
    return {
        "image_half": median_time(tower("image", half), reps),
        "image_all": median_time(tower("image", global_batch), reps),
        "text_half": median_time(tower("text", half), reps),
        "text_all": median_time(tower("text", global_batch), reps),
        "heads": median_time(heads(half), reps),
        "reduce_all": median_time(all_reduce([*network.parameters()]), reps),
        "reduce_heads": median_time(all_reduce([network.contrastive.logit_scale]), reps),
        "exchange": median_time(exchange(global_batch), reps),
        "step_image": median_time(optimizer_step(image_params), reps),
        "step_text": median_time(optimizer_step(text_params), reps),
        "image_params": sum(p.numel() for p in image_params),
        "text_params": sum(p.numel() for p in text_params),
    }


def predicted(parts: dict[str, float]) -> dict[str, float]:
    """The cost model of docs/scaling.md for 2 processes: DDP runs both towers on half the batch, reduces all
    gradients and steps both towers; modality parallelism runs each tower once per DDP process's rows (two halves)
    and steps it, waits for the slower one, exchanges and reduces the heads."""
    ddp = (
        parts["image_half"]
        + parts["text_half"]
        + parts["heads"]
        + parts["reduce_all"]
        + parts["step_image"]
        + parts["step_text"]
    )
    image = WORLD * parts["image_half"] + parts["step_image"]
    text = WORLD * parts["text_half"] + parts["step_text"]
    mp_step = max(image, text) + parts["exchange"] + parts["heads"] + parts["reduce_heads"]
    return {"ddp": ddp, "modality_parallel": mp_step}


def worker(rank: int, port: int, out_dir: str, args: argparse.Namespace) -> None:
    # torchrun-style variables: Lightning joins this process group instead of launching processes itself
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))  # fmt: skip
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for _ in range(args.reps):
        for variant in VARIANTS:
            times[variant] += time_fit(variant, args.steps, args.global_batch, out_dir)
    parts = part_times(args.global_batch, 1 if args.quick else 5)
    if rank == 0:
        (Path(out_dir) / "times.json").write_text(json.dumps({"times": times, "parts": parts}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per fit (after 2 warm-up steps)")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions of each variant")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="one timed step, one rep, a global batch of 8")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.reps, args.global_batch = 1, 1, 8
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(port, out_dir, args), nprocs=WORLD, join=True)
        measured = json.loads((Path(out_dir) / "times.json").read_text())
    parts = measured["parts"]
    medians = {variant: statistics.median(times) for variant, times in measured["times"].items()}
    model = predicted(parts)
    print(
        f"global batch {args.global_batch}; image tower {parts['image_params']:,} parameters, text tower {parts['text_params']:,}"
    )
    print(f"tower cost, forward + backward on the whole batch: image {parts['image_all'] * 1000:.1f} ms, text"
          f" {parts['text_all'] * 1000:.1f} ms (image / text {parts['image_all'] / parts['text_all']:.2f})")  # fmt: skip
    for name in (
        "image_half",
        "text_half",
        "heads",
        "reduce_all",
        "reduce_heads",
        "exchange",
        "step_image",
        "step_text",
    ):
        print(f"  {name:13s} {parts[name] * 1000:8.1f} ms")
    for variant in VARIANTS:
        print(
            f"{variant:18s} measured {medians[variant] * 1000:8.1f} ms   predicted {model[variant] * 1000:8.1f} ms"
        )
    ratio = medians["modality_parallel"] / medians["ddp"]
    predicted_ratio = model["modality_parallel"] / model["ddp"]
    best = min(model, key=model.get)
    print(
        f"RESULT modality_parallel ratio={ratio:.3f} (MP/DDP step time measured; predicted {predicted_ratio:.3f},"
        f" predicted best: {best})"
    )


if __name__ == "__main__":
    main()
