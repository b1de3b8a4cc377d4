"""Large contrastive batches on small memory: gradient caching vs. the whole batch vs. plain accumulation (CPU).

Three ways to train on a batch of k x B pairs with ``MultimodalModule`` (ViT + BERT towers sized so that
activations dominate the memory):

  (a) whole   the k x B batch in one forward/backward            (the objective; memory of k x B activations)
  (b) chunks  ``GradientCaching(chunks=k)``: gradient caching          (same objective and gradient, memory of B)
  (c) accum   k micro-batches of B, gradients accumulated         (memory of B, but each micro-batch only sees
                                                                   its own B - 1 negatives: another objective)

Each variant runs in a fresh process (so peaks do not mix): one step from the same initial weights and batch,
whose parameters are compared with (a) (SGD, so parameter differences are gradient differences), then timed
steps. Peak activation memory = the process's peak resident memory during the timed steps (VmHWM, reset
after the warm-up step) minus its resident memory before them (weights, gradients, optimizer state, batch).
glibc is told to return freed blocks to the system (MALLOC_MMAP_THRESHOLD_), so resident memory tracks live
tensors.

    python benchmarks/large_batch.py                  # k=4, B=32, about a minute on 2 cores
    python benchmarks/large_batch.py --chunks 8 --batch 16
    python benchmarks/large_batch.py --quick          # checks that it runs: k=2, B=4, one timed step

Last line: ``RESULT large_batch ratio=<peak activation memory (b) / (a)> (...)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

VARIANTS = ("whole", "chunks", "accum")
LENGTH, VOCAB = 32, 36
REPO = Path(__file__).resolve().parents[1]


def build_model(chunks: int, run_dir: str) -> torch.nn.Module:
    """The demo's ``MultimodalModule`` as the CLI builds it (after the caller's seed), with ViT + BERT towers of
    4 layers, width 192, so that activations dominate the memory."""
    from mm_lightning.cli import cli_main

    bert = {
        "hidden_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 768,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    vit = {"patch_size": 8, "num_layers": 4, "num_heads": 4, "hidden_dim": 192, "mlp_dim": 768}
    args = [
        "--config", str(REPO / "configs" / "demo.yaml"),
        "--model.image_tower.init_args.name", "vit_custom",
        "--model.image_tower.init_args.kwargs", json.dumps(vit),
        "--model.text_tower.init_args.config_overrides", json.dumps(bert),
        "--model.embed_dim", "128",
        # pure contrastive training: the ITM head runs on the whole batch's tokens in every variant
        "--model.objective.itm_weight", "0",
        *(["--model.batch_embedding", "mm_lightning.extras.GradientCaching",
           "--model.batch_embedding.chunks", str(chunks)] if chunks > 1 else []),
        "--trainer.default_root_dir", run_dir,
    ]  # fmt: skip
    return cli_main(args, run=False).model


def make_batch(size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, LENGTH + 1, (size,), generator=g)
    mask = (torch.arange(LENGTH)[None] < lengths[:, None]).long()
    ids = torch.randint(7, VOCAB, (size, LENGTH), generator=g) * mask
    ids[:, 0] = 2
    return {
        "image": torch.randn(size, 3, 64, 64, generator=g),
        "input_ids": ids,
        "attention_mask": mask,
        "image_id": torch.arange(size),
        "index": torch.arange(size),
    }


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def run_variant(variant: str, chunks: int, batch: int, steps: int, params_out: str) -> dict:
    """One variant in this process: a compared first step, then timed steps with the memory peak."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(chunks if variant == "chunks" else 1, str(Path(params_out).parent / variant))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_batch(chunks * batch)
    parts = [{k: v[i * batch : (i + 1) * batch] for k, v in data.items()} for i in range(chunks)]

    def step() -> None:
        if variant == "accum":
            for part in parts:
                model.backward(model.training_step(part, 0) / chunks)
        else:
            model.backward(model.training_step(data, 0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradient buffers stay allocated: part of the baseline

    step()
    torch.save({n: p.detach() for n, p in model.named_parameters()}, params_out)
    baseline = _status_kb("VmRSS:")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current resident size
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"peak_mb": (_status_kb("VmHWM:") - baseline) / 1024, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chunks", type=int, default=4, help="k")
    parser.add_argument("--batch", type=int, default=32, help="B, pairs per chunk / micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    parser.add_argument("--quick", action="store_true", help="--chunks 2 --batch 4 --steps 1")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--params-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.chunks, args.batch, args.steps = 2, 4, 1
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.chunks, args.batch, args.steps, args.params_out)))
        return

    env = os.environ | {"MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONWARNINGS": "ignore"}
    results, params = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            out = str(Path(tmp) / f"{variant}.pt")
            cmd = [sys.executable, __file__, "--variant", variant, "--params-out", out]
            cmd += ["--chunks", str(args.chunks), "--batch", str(args.batch), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            params[variant] = torch.load(out)

    def param_diff(variant: str) -> float:
        return max((params[variant][n] - params["whole"][n]).abs().max().item() for n in params["whole"])

    k, b = args.chunks, args.batch
    print(f"batch of {k * b} pairs = {k} x {b}; ViT + BERT towers (4 layers, width 192), CPU, 1 thread")
    print(f"{'variant':<34}{'peak activation MB':>20}{'step s':>10}{'max |param - (a)|':>20}")
    labels = {
        "whole": f"(a) whole batch of {k * b}",
        "chunks": f"(b) {k} chunks, gradient caching",
        "accum": f"(c) {k} micro-batches, accumulation",
    }
    for variant in VARIANTS:
        r = results[variant]
        diff = "-" if variant == "whole" else f"{param_diff(variant):.1e}"
        print(f"{labels[variant]:<34}{r['peak_mb']:>20.1f}{r['step_s']:>10.2f}{diff:>20}")
    a, bb = results["whole"], results["chunks"]
    # a peak is counted in kB (VmHWM): that of a tiny batch can be 0
    memory_ratio, time_ratio = bb["peak_mb"] / max(a["peak_mb"], 1 / 1024), bb["step_s"] / a["step_s"]
    print(
        f"RESULT large_batch ratio={memory_ratio:.3f} (peak activation memory (b)/(a), target <= 0.5; "
        f"step time (b)/(a) = {time_ratio:.2f}, target <= 1.5; parameter difference after one step "
        f"(b) vs (a) {param_diff('chunks'):.1e}, (c) vs (a) {param_diff('accum'):.1e})"
    )


if __name__ == "__main__":
    main()
