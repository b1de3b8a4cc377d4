"""One bounded check of what only a GPU shows: training speed and MFU, whether the loader keeps up, nvJPEG,
gradient caching's memory, FSDP2's cost, the CUDA-only tests, DDP over NCCL.

    python benchmarks/gpu_check.py --out gpu_check.json        # a CUDA machine: about 5 minutes on an H200
    python benchmarks/gpu_check.py --photos DIR/train.jsonl    # real photos to feed the loader (default: the dev set)
    python benchmarks/gpu_check.py --stages env train_eager    # some stages only
    python benchmarks/gpu_check.py --bound train_compiled=400  # a stage's own time bound, in seconds
    python benchmarks/gpu_check.py --dry-run                   # every stage on CPU at tiny sizes
    python benchmarks/gpu_check.py --quick                     # the dry run on 16 small photos (a test runs this)

Each stage runs in a process of its own under a time bound (``STAGES``; all of them within ``--budget``). A stage
that fails, hangs or runs out of time is recorded with its reason and the next one runs; the JSON is rewritten
after every stage, so a run cut short keeps what it measured.

  env             the card, the versions, its dense bf16 peak and a measured 8192^3 bf16 matrix product
  train_eager     ViT-B/16 + BERT-base (random init, 224 px, 32-token captions, the fusion and matching head on),
                  bf16-mixed, channels-last, SDPA attention, ``Trainer.fit`` on in-memory device batches:
                  samples/s, TFLOP/s, MFU (FLOPs per step from ``torch.utils.flop_counter``), peak memory
  train_compiled  the same with the towers compiled (the module's ``compile: true``), and the compile time
  train_no_itm    train_eager without the matching head (contrastive only, the fusion module off)
  profile         where an eager step's device time goes: matrix products and attention vs the rest, top kernels
  loader_fed      train_eager fed by ``MultimodalDataModule`` from real photos with the machine's cores:
                  data-bound when it falls short of train_eager
  nvjpeg          nvJPEG batch decoding, also with the crops cut and resized on the device, vs one CPU core
  grad_cache      the whole batch vs 4 chunks (``GradientCaching``): peak memory and step time
  fsdp2           train_eager on one device under ``ShardedDataParallel`` (FSDP2, fp32 gradient reduction) vs
                  without: what the sharded units cost in step time and peak memory where nothing is split (the
                  saving per GPU is the parameters' and moments' (N-1)/N on N GPUs: docs/scaling.md)
  cuda_tests      the tests that only run with CUDA (the NaN guard's no-sync check)
  train_resnet50  ``configs/base.yaml``'s towers (ResNet-50 + BERT-base), eager
  ddp             stock DDP vs the explicit all-reduce (``configs/ddp_explicit.yaml``), 2 GPUs over NCCL
                  (skipped on one; the dry run runs the explicit one on 2 CPU processes over gloo)

``--quick`` is the dry run without the dev set and without writing outside a fresh temporary folder (the photos, the
demo data of the ddp stage and, unless ``--out`` says otherwise, the JSON): 16 small JPEGs cut from the photographs
that ship with scikit-image (``benchmarks/support/real_photos.py``), and the ddp stage stopped at 3 s, past its start.

The last line is ``RESULT gpu_check mfu=<train_compiled's, else train_eager's> samples_per_s=<its> (...)``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch.utils.flop_counter import FlopCounterMode
from torchvision.io import ImageReadMode, decode_jpeg

from mm_lightning.data.images import EncodedImage
from mm_lightning.data.transforms import IMAGENET_MEAN, IMAGENET_STD, DecodeResizedCrop
from mm_lightning.models import MultimodalModule

REPO = Path(__file__).resolve().parents[1]
DEV_PHOTOS = REPO.parent / "shared" / "devdata" / "coco_mini" / "train.jsonl"
# NVIDIA's dense bf16 figure for an H200 SXM (the H100 SXM's chip). Lightning's table has no row for the name such a
# card reports ("NVIDIA H200"), and its "h200 sxm1" row is the datasheet's with-sparsity figure, twice the dense one.
DENSE_BF16 = {"nvidia h200": 989e12}
BERT_BASE = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
}
BERT_TINY = BERT_BASE | {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
TINY_VIT = {"patch_size": 8, "num_layers": 1, "num_heads": 2, "hidden_dim": 16, "mlp_dim": 32}


@dataclass(frozen=True)
class Scale:
    """Sizes of one run of the check: the real one on a GPU, or the dry run on CPU."""

    device: str
    batch: int
    steps: int
    warmup: int
    image_size: int
    vit: dict[str, Any]
    resnet: str
    bert: dict[str, Any]
    fusion: dict[str, int]
    matmul: int
    tokens: int = 32
    bounds: dict[str, float] = field(default_factory=dict)


GPU = Scale(
    "cuda", 256, 20, 5, 224, {"name": "vit_b_16"}, "resnet50", BERT_BASE, {"layers": 1, "heads": 8}, 8192,
    bounds={"env": 60, "train_eager": 90, "train_compiled": 200, "train_no_itm": 60, "profile": 60, "loader_fed": 120, "nvjpeg": 60,
            "grad_cache": 120, "fsdp2": 120, "cuda_tests": 150, "train_resnet50": 90, "ddp": 240},
)  # fmt: skip
DRY = Scale(
    "cpu", 4, 2, 1, 32, {"name": "vit_custom", "kwargs": TINY_VIT}, "resnet18", BERT_TINY,
    {"layers": 1, "heads": 2}, 256, bounds={}
)  # fmt: skip
# no 2-process Lightning run finishes in 3 s: the ddp stage is started, then stopped with what it started
QUICK = dataclasses.replace(DRY, bounds={"ddp": 3})


def base_cli(scale: Scale, image_tower: dict[str, Any], jsonl: Path | None = None, **options: Any) -> Any:
    """``configs/base.yaml``'s module and data module as the CLI builds them (not run), random init, offline: the
    scale's towers (the demo's BERT vocabulary), ``options`` as ``--model.<key>`` values, the data on ``jsonl``."""
    from mm_lightning.cli import cli_main

    def value(item: Any) -> str:  # as typed on a command line: a string bare, anything else as JSON
        return item if isinstance(item, str) else json.dumps(item)

    tower = {"weights": None, "image_size": scale.image_size, "kwargs": {}, **image_tower}
    data = ["--data.init_args.train_file", str(jsonl), "--data.init_args.val_file", "null"] if jsonl else []
    args = [
        "--config", str(REPO / "configs" / "base.yaml"),
        *(arg for key, item in tower.items() for arg in (f"--model.image_tower.init_args.{key}", value(item))),
        "--model.text_tower.init_args.name", "mm-lightning/demo-bert",
        "--model.text_tower.init_args.pretrained", "false",
        "--model.text_tower.init_args.config_overrides", json.dumps(scale.bert),
        "--model.fusion", json.dumps(scale.fusion),
        "--model.optim.warmup_steps", "10",
        *(arg for key, item in options.items() for arg in (f"--model.{key}", value(item))),
        *data,
        "--data.init_args.test_file", "null",
        "--data.init_args.tokenizer", "mm-lightning/demo-bert",
        "--data.init_args.max_length", str(scale.tokens),
        "--data.init_args.batch_size", str(scale.batch),
        "--data.init_args.num_workers", str(loader_workers(scale)),
        "--trainer.accelerator", scale.device,
        "--trainer.devices", "1",
        "--trainer.strategy", "auto",
        "--trainer.logger", "false",
    ]  # fmt: skip
    return cli_main(args, run=False)


def module(scale: Scale, image_tower: dict[str, Any], **options: Any) -> MultimodalModule:
    """The check's model: ``configs/base.yaml``'s module with the scale's towers, random init, built offline."""
    return base_cli(scale, image_tower, **options).model


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_batches(scale: Scale, count: int) -> list[dict[str, torch.Tensor]]:
    """Model-ready batches on the device: normalized channels-last images, COCO-length captions."""
    gen = torch.Generator(device=scale.device).manual_seed(0)
    size, b, dev = scale.image_size, scale.batch, scale.device
    out = []
    for i in range(count):
        ids = torch.randint(1000, 30000, (b, scale.tokens), device=dev, generator=gen)
        image = torch.randn(b, 3, size, size, device=dev, generator=gen)
        rows = torch.arange(i * b, (i + 1) * b, device=dev)
        out.append(
            {
                "image": image.contiguous(memory_format=torch.channels_last),
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "image_id": rows,
                "index": rows,
            }
        )
    return out


class StepClock(pl.Callback):
    """The wall clock when the timed steps start (after ``warmup`` steps) and when training ends, each once the
    device's queue has drained; no sync in between, so the host queues work ahead as in any run."""

    def __init__(self, device: str, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.start: float | None = None
        self.end: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if self.start is None and trainer.global_step == self.warmup:
            synchronize(self.device)
            self.start = time.perf_counter()

    def on_train_end(self, *args: object) -> None:  # before fit's teardown moves the model off the device
        synchronize(self.device)
        self.end = time.perf_counter()


def flops_per_step(model: MultimodalModule, batch: dict[str, torch.Tensor], device: str) -> float:
    """Forward + backward FLOPs of one training step, under bf16 autocast as in training."""
    model.train()
    with FlopCounterMode(display=False) as counter, torch.autocast(device, dtype=torch.bfloat16):
        model.training_step(batch, 0).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def peak_flops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name().lower()
    listed = get_available_flops(torch.device("cuda"), torch.bfloat16)
    return DENSE_BF16.get(name, listed)


def loader_workers(scale: Scale) -> int:
    return max(1, min(15, len(os.sched_getaffinity(0)) - 1)) if scale.device == "cuda" else 1


def loader_timed_steps(scale: Scale) -> int:
    """Well past the batches the workers queue ahead (2 each), so a slow loader shows."""
    return max(scale.steps, 3 * 2 * loader_workers(scale))


def fit_rate(
    scale: Scale,
    image_tower: dict[str, Any],
    jsonl: Path | None = None,
    strategy: Any = "auto",
    channels_last: bool = True,
    **options: Any,
) -> dict:
    """samples/s, TFLOP/s, MFU and peak memory of ``Trainer.fit`` (bf16-mixed, channels-last) on an in-memory device
    batch, or fed by ``MultimodalDataModule`` from ``jsonl`` with the machine's cores; one device."""
    torch.manual_seed(0)
    cli = base_cli(scale, image_tower, jsonl, **options)
    model = cli.model.to(scale.device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    batch = device_batches(scale, 1)[0]
    flops = flops_per_step(model, batch, scale.device)
    warmup, timed_steps = scale.warmup, scale.steps
    if jsonl is None:  # one batch over and over: the peak memory is the step's, not a stack of staged inputs
        loader = torch.utils.data.DataLoader([batch] * (warmup + timed_steps), batch_size=None)
        data: dict[str, Any] = {"train_dataloaders": loader}
    else:  # base.yaml's loader options (pinned memory, batch slots) with the machine's cores
        data = {"datamodule": cli.datamodule}
        # the workers start first
        warmup, timed_steps = 3 * scale.warmup, loader_timed_steps(scale)
    del batch
    clock = StepClock(scale.device, warmup)
    trainer = pl.Trainer(
        accelerator=scale.device,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=warmup + timed_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    if scale.device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(model, **data)
    assert clock.start is not None and clock.end is not None
    step = (clock.end - clock.start) / timed_steps
    peak = peak_flops(scale.device)
    return {
        "batch": scale.batch,
        "timed_steps": timed_steps,
        "samples_per_s": scale.batch / step,
        "step_ms": 1000 * step,
        "tflops_per_s": flops / step / 1e12,
        "mfu": flops / step / peak if peak else None,
        "first_steps_s": clock.start - start,  # setup and the warm-up steps (compiled: the compilation too)
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if scale.device == "cuda" else None,
        **({"workers": data["datamodule"].hparams.num_workers} if jsonl else {}),
    }


def timed(fn: Callable[[], None], device: str, repeats: int = 3) -> float:
    """Best wall time of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def stage_env(scale: Scale, args: argparse.Namespace) -> dict:
    import lightning
    import torchvision
    import transformers

    n = scale.matmul
    a, b = (torch.randn(n, n, device=scale.device, dtype=torch.bfloat16) for _ in range(2))
    seconds = timed(lambda: a @ b, scale.device, repeats=10)
    return {
        "device": torch.cuda.get_device_name() if scale.device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count(),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "versions": {m.__name__: m.__version__ for m in (torch, torchvision, lightning, transformers)},
        "peak_bf16_tflops": (peak_flops(scale.device) or 0) / 1e12 or None,
        f"matmul_{n}_bf16_tflops": 2 * n**3 / seconds / 1e12,
    }


def stage_train_eager(scale: Scale, args: argparse.Namespace) -> dict:
    return fit_rate(scale, scale.vit)


def stage_train_compiled(scale: Scale, args: argparse.Namespace) -> dict:
    # the dry run checks the path through dynamo without paying a C++ compile on CPU
    return fit_rate(scale, scale.vit, compile={"backend": "eager"} if scale.device == "cpu" else True)


def stage_train_no_itm(scale: Scale, args: argparse.Namespace) -> dict:
    return fit_rate(scale, scale.vit, objective={"itm_weight": 0.0})


def stage_profile(scale: Scale, args: argparse.Namespace) -> dict:
    """Where an eager training step's time goes (the device's kernels; on CPU, the operators): the share of matrix
    products and attention, and the kernels that take the most."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = module(scale, scale.vit).to(scale.device).to(memory_format=torch.channels_last)
    batch = device_batches(scale, 1)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=scale.device == "cuda")

    def step() -> None:
        with torch.autocast(scale.device, dtype=torch.bfloat16):
            loss = model.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps = 3
    step()
    synchronize(scale.device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(scale.device)
    wall = (time.perf_counter() - start) / steps
    cuda = scale.device == "cuda"
    syncs: dict[str, int] = {}
    if cuda:  # the lines that make the host wait for the device (they leave it idle while Python catches up)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchronizing" in str(w.message):
                site = f"{Path(w.filename).name}:{w.lineno}"
                syncs[site] = syncs.get(site, 0) + 1
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        synchronize(scale.device)
    if cuda:
        rows = [
            (e.key, e.self_device_time_total) for e in prof.key_averages() if e.device_type == DeviceType.CUDA
        ]
        products = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|conv|flash|fmha|attention", re.IGNORECASE)
    else:
        rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        products = re.compile(r"aten::(mm|addmm|bmm|linear|conv|mkldnn|_scaled_dot|_flash|_efficient)")
    rows = sorted(((k, t) for k, t in rows if t > 0), key=lambda row: -row[1])
    total = sum(t for _, t in rows)
    return {
        "wall_ms_per_step": 1000 * wall,  # a plain loop: forward, backward, fused AdamW
        "ms_per_step": total / steps / 1000,
        "host_syncs_per_step": syncs,
        "matmul_attention_share": sum(t for k, t in rows if products.search(k)) / total,
        "top": [{"name": k[:100], "ms_per_step": t / steps / 1000, "share": t / total} for k, t in rows[:12]],
    }


def stage_train_resnet50(scale: Scale, args: argparse.Namespace) -> dict:
    return fit_rate(scale, {"name": scale.resnet})


def stage_loader_fed(scale: Scale, args: argparse.Namespace) -> dict:
    from data_pipeline import repeated

    # one epoch for the whole run: an epoch's end would drain the batches the workers queued ahead
    images = (3 * scale.warmup + loader_timed_steps(scale) + 2) * scale.batch
    return fit_rate(scale, scale.vit, jsonl=repeated(args.photos, images, args.work / "photos"))


def stage_nvjpeg(scale: Scale, args: argparse.Namespace) -> dict:
    from data_pipeline import rows_of

    dev, size = scale.device, scale.image_size
    rows = rows_of(args.photos)
    paths = list(dict.fromkeys(args.photos.parent / r["image"] for r in rows))[: 16 * scale.batch]
    files = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in paths]
    if not files:
        raise ValueError(f"{args.photos}: no images listed")
    crop = DecodeResizedCrop(size, (0.9, 1.0))
    mean = torch.tensor(IMAGENET_MEAN, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device=dev).view(1, 3, 1, 1) * 255
    size_of_batch = min(scale.batch, len(files))
    batches = [files[i : i + size_of_batch] for i in range(0, len(files) - size_of_batch + 1, size_of_batch)]

    def decode_all() -> None:
        for batch in batches:
            decode_jpeg(batch, device=dev, mode=ImageReadMode.RGB)

    def decode_crop_all() -> None:
        for batch in batches:
            images = decode_jpeg(batch, device=dev, mode=ImageReadMode.RGB)
            out = torch.empty(len(images), 3, size, size, device=dev)
            for k, image in enumerate(images):
                top, left, h, w = crop.crop_box(image.shape[-1], image.shape[-2])
                window = image[None, :, top : top + h, left : left + w].float()
                out[k] = torch.nn.functional.interpolate(
                    window, size=(size, size), mode="bilinear", antialias=True
                )[0]
            out.sub_(mean).div_(std).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)

    count = len(batches) * size_of_batch
    EncodedImage(files[0].numpy().tobytes()).decode(1)
    start = time.perf_counter()
    for data in files[:64]:
        EncodedImage(data.numpy().tobytes()).decode(1)
    cpu = min(64, len(files)) / (time.perf_counter() - start)
    return {
        "images": count,
        "decode_per_s": count / timed(decode_all, dev),
        "decode_crop_per_s": count / timed(decode_crop_all, dev),
        "cpu_core_decode_per_s": cpu,
    }


def stage_grad_cache(scale: Scale, args: argparse.Namespace) -> dict:
    whole = fit_rate(scale, scale.vit)
    caching = {"class_path": "mm_lightning.extras.GradientCaching", "init_args": {"chunks": 4}}
    chunked = fit_rate(scale, scale.vit, batch_embedding=caching)
    keys = ("samples_per_s", "step_ms", "peak_memory_gib")
    return {"whole": {k: whole[k] for k in keys}, "chunks_4": {k: chunked[k] for k in keys}}


def stage_fsdp2(scale: Scale, args: argparse.Namespace) -> dict:
    from mm_lightning.extras import ShardedDataParallel

    # contiguous weights in both: FSDP2 shards no channels-last tensor
    plain = fit_rate(scale, scale.vit, channels_last=False)
    sharded = fit_rate(
        scale, scale.vit, strategy=ShardedDataParallel(reduce_dtype="float32"), channels_last=False
    )
    keys = ("samples_per_s", "step_ms", "peak_memory_gib")
    return {"single_device": {k: plain[k] for k in keys}, "fsdp2": {k: sharded[k] for k in keys}}


def stage_cuda_tests(scale: Scale, args: argparse.Namespace) -> dict:
    files = ["tests/resilience/test_nan_guard_deferred.py"]
    # without CUDA they skip: the dry run checks that they still collect
    extra = ["--collect-only"] if scale.device == "cpu" else []
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *extra, *files]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0:
        raise RuntimeError(f"pytest exited {done.returncode}:\n" + "\n".join(lines[-40:]))
    return {"summary": lines[-1] if lines else ""}


def stage_ddp(scale: Scale, args: argparse.Namespace) -> dict:
    gpus = torch.cuda.device_count()
    if scale.device == "cuda" and gpus < 2:
        return {"skipped": f"needs 2 GPUs, this machine has {gpus}"}
    hardware = (
        ["--trainer.accelerator", "cuda", "--trainer.precision", "bf16-mixed", "--trainer.max_steps", "60"]
        if scale.device == "cuda"
        else ["--trainer.accelerator", "cpu", "--trainer.max_steps", "2"]
    )
    strategies = {"ddp": ["--trainer.strategy", "ddp"], "explicit": ["--config", "configs/ddp_explicit.yaml"]}
    if scale.device == "cpu":  # stock DDP on 2 CPU processes is what tests/test_strategies_cli.py runs
        del strategies["ddp"]
    out = {}
    # a quick run writes only in its own folder; the others keep the demo data in the repository's data/demo
    demo = ["--data.init_args.data_dir", str(args.work / "demo")] if args.quick else []
    for name, strategy in strategies.items():
        command = [
            sys.executable, "-m", "mm_lightning", "fit", "--config", "configs/demo.yaml", "--config",
            "configs/demo_data.yaml", *demo, *strategy, *hardware, "--trainer.devices", "2",
            "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(args.work / f"ddp_{name}"),
        ]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
        out[f"{name}_command_s"] = time.perf_counter() - start  # the whole command, its start included
    return out


STAGES: dict[str, Callable[[Scale, argparse.Namespace], dict]] = {
    "env": stage_env,
    "train_eager": stage_train_eager,
    "train_compiled": stage_train_compiled,
    "train_no_itm": stage_train_no_itm,
    "profile": stage_profile,
    "loader_fed": stage_loader_fed,
    "nvjpeg": stage_nvjpeg,
    "grad_cache": stage_grad_cache,
    "fsdp2": stage_fsdp2,
    "cuda_tests": stage_cuda_tests,
    "train_resnet50": stage_train_resnet50,
    "ddp": stage_ddp,
}


def run_stage(name: str, scale: Scale, args: argparse.Namespace, result_file: Path) -> None:
    """A stage in its own process group (so its loader workers and compile workers go with it)."""
    os.setpgrp()
    torch.backends.cudnn.benchmark = True
    torch.set_float32_matmul_precision("high")
    try:
        out = {"status": "ok", **STAGES[name](scale, args)}
        if "skipped" in out:
            out["status"] = "skipped"
    except Exception as err:  # recorded; the next stage runs
        out = {
            "status": "failed",
            "error": f"{type(err).__name__}: {err}"[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
    result_file.write_text(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="every stage on CPU at tiny sizes")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the dry run on 16 small photos, everything in a temporary folder",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON (default: benchmarks/_cache/gpu_check.json; --quick: its folder)",
    )
    parser.add_argument(
        "--photos", type=Path, default=None, help="a JSONL of real photos (default: the dev set)"
    )
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES))
    parser.add_argument("--budget", type=float, default=480, help="seconds for all the stages together")
    parser.add_argument(
        "--bound",
        nargs="+",
        default=[],
        metavar="STAGE=SECONDS",
        help="a stage's own time bound (within --budget)",
    )
    args = parser.parse_args()
    args.dry_run |= args.quick
    scale = QUICK if args.quick else DRY if args.dry_run else GPU
    bounds = dict(scale.bounds)
    for given in args.bound:
        name, _, seconds = given.partition("=")
        if name not in STAGES or not re.fullmatch(r"\d+(\.\d*)?", seconds) or float(seconds) <= 0:
            parser.error(
                f"--bound {given}: expected STAGE=SECONDS (seconds > 0) with a stage of {', '.join(STAGES)}"
            )
        bounds[name] = float(seconds)
    # asked through NVML, so the parent does not initialize CUDA and its forked children still can
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run to check the script on CPU")
    args.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    args.out = args.out or (args.work if args.quick else REPO / "benchmarks" / "_cache") / "gpu_check.json"
    if args.photos is None:
        from support.real_photos import PHOTO_SETS, build

        spec = PHOTO_SETS["coco"]
        if args.quick:  # not the dev set even where it is: the same few photos on every machine
            spec = dataclasses.replace(spec, name="coco_quick", size=(160, 120), count=16)
            args.photos = build(args.work, spec)
        elif DEV_PHOTOS.exists():
            args.photos = DEV_PHOTOS
        else:
            if args.dry_run:
                spec = dataclasses.replace(spec, name="coco_check", count=64)
            args.photos = build(Path(tempfile.gettempdir()) / "mm_lightning_real_photos", spec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"dry_run": args.dry_run, "photos": str(args.photos), "stages": {}}
    deadline = time.monotonic() + args.budget
    fork = multiprocessing.get_context("fork")  # the parent never touches CUDA, so its children may
    for name in args.stages:
        left = deadline - time.monotonic()
        if left < 5:
            report["stages"][name] = {"status": "no time left"}
            continue
        bound = min(bounds.get(name, args.budget), left)
        result_file = args.work / f"{name}.json"
        start = time.monotonic()
        child = fork.Process(target=run_stage, args=(name, scale, args, result_file))
        child.start()
        child.join(bound)
        timed_out = child.is_alive()
        with contextlib.suppress(ProcessLookupError):  # the stage and whatever it left running
            os.killpg(child.pid, signal.SIGKILL)
        child.join()
        if result_file.exists():  # a stage that finished but hung on its way out keeps its figures
            out = json.loads(result_file.read_text())
        elif timed_out:
            out = {"status": f"timed out after {bound:.0f} s"}
        else:
            out = {"status": f"died (exit code {child.exitcode})"}
        out["seconds"] = round(time.monotonic() - start, 1)
        report["stages"][name] = out
        args.out.write_text(json.dumps(report, indent=1))
        print(f"{name}: {json.dumps({k: v for k, v in out.items() if k != 'traceback'})}", flush=True)
    stages = report["stages"]
    best = next(
        (stages[n] for n in ("train_compiled", "train_eager") if stages.get(n, {}).get("status") == "ok"), {}
    )
    fed, eager = stages.get("loader_fed", {}), stages.get("train_eager", {})
    fed_ratio = fed.get("samples_per_s", 0) / eager["samples_per_s"] if eager.get("samples_per_s") else None
    statuses = ", ".join(f"{n} {s['status']}" for n, s in stages.items())
    mfu = best.get("mfu")
    print(
        f"RESULT gpu_check mfu={mfu if mfu is None else round(mfu, 3)} samples_per_s="
        f"{round(best.get('samples_per_s', 0))} (loader-fed / in-memory {fed_ratio and round(fed_ratio, 2)}; "
        f"{statuses}; figures in {args.out})"
    )


if __name__ == "__main__":
    main()
