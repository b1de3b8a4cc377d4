"""GPU figures: nvJPEG batch decoding, GPU-side crops, and the base recipe's training speed and MFU.

Called by ``python benchmarks/data_pipeline.py --gpu`` (needs a CUDA device; nothing is downloaded):
  * nvJPEG: ``torchvision.io.decode_jpeg(list_of_tensors, device="cuda")`` on the benchmark photos, batches of
    ``--batch-size``, vs one CPU core decoding the same files;
  * GPU crops: the same RandomResizedCrop boxes (the loader's sampler) cut and resized on the device after
    nvJPEG, normalized, channels-last bf16 -- model-ready batches with no CPU pixel work at all;
  * the base recipe (``configs/base.yaml``: ResNet-50 + a BERT-base-sized text tower, random init from
    configs, 224 px, bf16-mixed, channels-last) under ``Trainer.fit`` on in-memory device batches: samples/s
    and model FLOPs utilization (FLOPs per step from ``torch.utils.flop_counter``, peak from Lightning's table).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch.utils.flop_counter import FlopCounterMode
from torchvision.io import ImageReadMode, decode_jpeg

from mm_lightning.data.images import EncodedImage
from mm_lightning.data.transforms import IMAGENET_MEAN, IMAGENET_STD, DecodeResizedCrop
from mm_lightning.models import MultimodalModule
from mm_lightning.models.towers import HFTextTower, TorchvisionTower

BERT_BASE = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
}


def encoded_files(jsonl: Path) -> list[torch.Tensor]:
    rows = [json.loads(line) for line in open(jsonl)]
    return [
        torch.frombuffer(bytearray((jsonl.parent / r["image"]).read_bytes()), dtype=torch.uint8) for r in rows
    ]


def timed(fn: object, repeats: int = 3) -> float:
    """Best wall time of ``fn()`` (synchronized) over ``repeats`` runs after one warm-up."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def nvjpeg_rates(files: list[torch.Tensor], batch_size: int) -> dict[str, float]:
    """Images/s: nvJPEG batched decode alone, nvJPEG + GPU crop/resize/normalize, one CPU core decoding."""
    crop = DecodeResizedCrop(224, (0.9, 1.0))
    mean = torch.tensor(IMAGENET_MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD, device="cuda").view(1, 3, 1, 1) * 255
    batches = [files[i : i + batch_size] for i in range(0, len(files) - batch_size + 1, batch_size)]

    def decode_all() -> None:
        for batch in batches:
            decode_jpeg(batch, device="cuda", mode=ImageReadMode.RGB)

    def decode_crop_all() -> None:
        for batch in batches:
            images = decode_jpeg(batch, device="cuda", mode=ImageReadMode.RGB)
            out = torch.empty(len(images), 3, 224, 224, device="cuda")
            for k, image in enumerate(images):
                top, left, h, w = crop.crop_box(image.shape[-1], image.shape[-2])
                window = image[None, :, top : top + h, left : left + w].float()
                out[k] = torch.nn.functional.interpolate(
                    window, size=(224, 224), mode="bilinear", antialias=True
                )[0]
            out.sub_(mean).div_(std).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)

    count = len(batches) * batch_size
    cpu_files = [f.numpy().tobytes() for f in files[:64]]
    start = time.perf_counter()
    for data in cpu_files:
        EncodedImage(data).decode(1)
    cpu = len(cpu_files) / (time.perf_counter() - start)
    return {
        "nvjpeg": count / timed(decode_all),
        "nvjpeg_crop": count / timed(decode_crop_all),
        "cpu_core": cpu,
    }


def recipe_module() -> MultimodalModule:
    """The base recipe's model, random init, built offline (no hub access)."""
    return MultimodalModule(
        image_tower=TorchvisionTower("resnet50", weights=None, image_size=224),
        text_tower=HFTextTower(
            "mm-lightning/demo-bert",  # shipped config, resized to BERT-base below
            pretrained=False,
            config_overrides=BERT_BASE,
            pooling="cls",
        ),
        embed_dim=256,
        fusion={"layers": 1, "heads": 8},
        optim={"lr": 1e-4, "weight_decay": 0.05, "warmup_steps": 10},
    )


def device_batches(batch_size: int, tokens: int, count: int) -> list[dict[str, torch.Tensor]]:
    """Model-ready batches on the device: normalized bf16 channels-last images, COCO-length captions."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for i in range(count):
        image = torch.randn(batch_size, 3, 224, 224, device="cuda", generator=gen)
        ids = torch.randint(1000, 30000, (batch_size, tokens), device="cuda", generator=gen)
        out.append(
            {
                "image": image.contiguous(memory_format=torch.channels_last),
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "image_id": torch.arange(i * batch_size, (i + 1) * batch_size, device="cuda"),
                "index": torch.arange(i * batch_size, (i + 1) * batch_size, device="cuda"),
            }
        )
    return out


class _Clock(pl.Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


def flops_per_step(model: MultimodalModule, batch: dict[str, torch.Tensor]) -> float:
    """Forward + backward FLOPs of one training step (counted once, bf16 autocast as in training)."""
    model.train()
    with FlopCounterMode(display=False) as counter, torch.autocast("cuda", dtype=torch.bfloat16):
        model.training_step(batch, 0).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def recipe_rate(
    batch_size: int,
    tokens: int = 32,
    steps: int = 30,
    warmup: int = 10,
    jsonl: Path | None = None,
    workers: int = 8,
) -> dict[str, float]:
    """samples/s and MFU of ``Trainer.fit`` (bf16-mixed, channels-last) on in-memory device batches, or with
    ``jsonl``: fed by MultimodalDataModule's train loader (``workers`` CPU workers, pinned memory)."""
    torch.manual_seed(0)
    model = recipe_module().cuda().to(memory_format=torch.channels_last)
    batches = device_batches(batch_size, tokens, steps)
    flops = flops_per_step(model, batches[0])
    if jsonl is not None:
        from mm_lightning.data import MultimodalDataModule

        loader = MultimodalDataModule(
            train_file=str(jsonl),
            tokenizer="mm-lightning/demo-bert",
            max_length=tokens,
            batch_size=batch_size,
            num_workers=workers,
            pin_memory=True,
            image_config=model.data_config["image"],
        )
        steps = 3 * warmup + steps
    else:
        loader = torch.utils.data.DataLoader(batches, batch_size=None)
    clock = _Clock()
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    if jsonl is None:
        trainer.fit(model, train_dataloaders=loader)
    else:
        trainer.fit(model, datamodule=loader)
    torch.cuda.synchronize()
    clock.stamps.append(time.perf_counter())
    skip = warmup if jsonl is None else 3 * warmup  # loader workers start and fill their queues first
    step = statistics.mean(b - a for a, b in zip(clock.stamps[skip:], clock.stamps[skip + 1 :], strict=False))
    peak = get_available_flops(torch.device("cuda"), torch.bfloat16) or float("nan")
    return {"samples_per_s": batch_size / step, "tflops": flops / step / 1e12, "mfu": flops / step / peak}


def gpu_report(sets: dict[str, Path], batch_size: int, workers: int) -> tuple[str, float]:
    """Prints the GPU figures; returns a one-line summary and loader-fed / in-memory samples/s at ``batch_size``."""
    torch.backends.cudnn.benchmark = True
    name = torch.cuda.get_device_name()
    parts = [name]
    for set_name, jsonl in sets.items():
        try:
            rates = nvjpeg_rates(encoded_files(jsonl), batch_size)
        except Exception as err:  # keep the other figures of a short GPU run
            print(f"nvJPEG on {set_name} failed: {err!r}", flush=True)
            continue
        print(
            f"{set_name}: nvJPEG batch decode {rates['nvjpeg']:.0f} img/s, + GPU crop/resize/normalize to bf16 "
            f"channels-last {rates['nvjpeg_crop']:.0f} img/s; one CPU core decodes {rates['cpu_core']:.0f} img/s",
            flush=True,
        )
        parts.append(f"{set_name} nvJPEG {rates['nvjpeg']:.0f} img/s (+crop {rates['nvjpeg_crop']:.0f})")
    main_jsonl = next(iter(sets.values()))
    runs = [(batch_size, None), (batch_size, main_jsonl), (128, None), (128, main_jsonl), (256, None)]
    recipe_rates: dict[tuple[int, bool], float] = {}  # (batch, in-memory) -> samples/s
    for bs, jsonl in runs:
        feed = "in-memory device batches" if jsonl is None else f"MultimodalDataModule, {workers} workers"
        try:
            r = recipe_rate(bs, jsonl=jsonl, workers=workers)
        except Exception as err:
            print(f"base recipe, batch {bs}, {feed} failed: {err!r}", flush=True)
            continue
        # With the loader, captions are padded to the batch's longest (shorter than 32 tokens): FLOPs not shown.
        flops = "" if jsonl else f", {r['tflops']:.0f} TFLOP/s, MFU {r['mfu']:.1%}"
        print(
            f"base recipe (ResNet-50 + BERT-base, 224 px, bf16-mixed, channels-last), batch {bs}, {feed}: "
            f"{r['samples_per_s']:.0f} samples/s{flops}",
            flush=True,
        )
        parts.append(
            f"recipe b{bs} {'loader' if jsonl else 'in-memory'} {r['samples_per_s']:.0f}/s MFU {r['mfu']:.1%}"
        )
    fed = recipe_rates.get((batch_size, False), float("nan")) / recipe_rates.get(
        (batch_size, True), float("nan")
    )
    return ", ".join(parts), fed
