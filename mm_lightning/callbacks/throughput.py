"""Training throughput that never makes a step wait: the clock is read after a device sync on logging steps only."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from mm_lightning.logging_steps import loggers_write_this_step

# the dtype the matrix products run in, by Trainer precision (for the device's peak FLOP/s in the MFU)
PRECISION_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "64-true": torch.float64,
}


def batch_size_of(batch: dict[str, Any]) -> int:
    """The number of image-text pairs in a batch."""
    return int(batch["image"].shape[0])


def warn_if_processes_share_cores(trainer: Trainer) -> None:
    """More CPU processes on a node than cores: they share them and every step waits for the slowest."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if isinstance(trainer.accelerator, CPUAccelerator) and trainer.num_devices > cores:
        rank_zero_warn(
            f"{trainer.num_devices} processes on {cores} CPU cores: they share the cores and every step waits for"
            f" the slowest; --trainer.devices {cores} or fewer runs faster."
        )


class ThroughputLogger(Callback):
    """Training samples/s and batches/s (FLOPs/s and MFU with ``pl_module.flops_per_batch``) under Lightning's
    ``ThroughputMonitor`` names (``train/device/samples_per_sec``, ...), over a window of logging steps.

    Lightning's monitor synchronizes the device at every step to read its clock, so on a GPU the host waits for
    the device at every step. This one counts samples on the host at each step and reads the clock, after a device
    sync, only on the steps the loggers write: the rate over the window between such steps is exact. Validation
    time inside a fit is left out; validation, test and predict throughput are not logged. When a fit starts, it
    warns if more CPU processes share a node than it has cores.

    Args:
        batch_size_fn: batch -> its number of samples (by default, of image-text pairs).
        window_size: logging steps the rates are measured over (2: from the previous logging step to this one).
    """

    def __init__(self, batch_size_fn: Callable[[Any], int] = batch_size_of, window_size: int = 2) -> None:
        if window_size < 2:
            raise ValueError(
                f"window_size must be >= 2 (the rates need two logging steps), got {window_size}"
            )
        self.batch_size_fn, self.window_size = batch_size_fn, window_size
        self.throughput: Throughput | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        warn_if_processes_share_cores(trainer)
        dtype = PRECISION_DTYPES.get(str(trainer.precision), torch.float32)
        peak = get_available_flops(trainer.strategy.root_device, dtype)
        self.throughput = Throughput(peak, trainer.world_size, self.window_size, separator="/")
        self.samples = self.batches = self.batches_logged = 0
        self.started, self.paused = time.perf_counter(), 0.0

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.steps_before = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.throughput is None:
            return
        self.samples += self.batch_size_fn(batch)
        self.batches += 1
        stepped = trainer.global_step > self.steps_before  # not a micro-batch of gradient accumulation
        if not (stepped and trainer.loggers and loggers_write_this_step(trainer, self.steps_before)):
            return
        self.wait_for_device(trainer)
        flops = getattr(pl_module, "flops_per_batch", None)
        self.throughput.update(
            time=time.perf_counter() - self.started - self.paused,
            batches=self.batches,
            samples=self.samples,
            flops=None if flops is None else flops * (self.batches - self.batches_logged),
        )
        self.batches_logged = self.batches
        metrics = {f"train/{name}": value for name, value in self.throughput.compute().items()}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=self.steps_before)  # the step the batch's other values go to

    def wait_for_device(self, trainer: Trainer) -> None:
        """Waits for the device's queued work, so the clock read next includes it (no-op on a CPU)."""
        device = trainer.strategy.root_device
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.wait_for_device(trainer)  # queued training work belongs to training time
        self.validation_started = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.throughput is not None and not trainer.sanity_checking:
            self.paused += time.perf_counter() - self.validation_started
