"""TensorBoard monitors that show why a run is slow or unstable.

* :class:`StepTimeMonitor` - ``train/steps_per_sec`` and ``train/data_wait_fraction``;
* :class:`PeakMemoryMonitor` - ``train/peak_memory_mb`` (CUDA allocator peak, or process peak RSS on CPU);
* :class:`GradNormMonitor` - ``grad_norm/<submodule>`` and ``grad_norm/total`` after the DDP reduction;
* :class:`RetrievalGridLogger` - ``val/retrieval_grid``: validation images with their true and top retrieved
  caption.

The CLI adds them all; the README lists every tag and what to do when it looks wrong.
"""

from __future__ import annotations

import resource
import textwrap
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from PIL import Image, ImageDraw
from torch.optim import Optimizer
from typing_extensions import override

from mm_lightning.data.collate import load_tokenizer


def _log(trainer: Trainer, metrics: dict[str, float]) -> None:
    # Straight to the loggers (rank 0 only inside them): these values are measured on this process and
    # computed only on logging steps, which `self.log`'s per-batch bookkeeping would not line up with.
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _is_logging_step(trainer: Trainer) -> bool:
    return trainer.global_step % max(trainer.log_every_n_steps, 1) == 0


class StepTimeMonitor(Callback):
    """Optimizer steps per second and the fraction of wall time spent waiting for the next batch.

    "Waiting for data" is the host time from the end of one training batch to the start of the next
    (Lightning's fetch of the next batch and its host-to-device copy); validation in between is excluded. Both
    values are averages over the batches since the previous logging step, measured on rank 0.
    """

    def __init__(self) -> None:
        self._last_end: float | None = None
        self._wait = self._total = 0.0
        self._steps = 0
        self._step_before = 0

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_end = None  # the gap since the previous epoch includes epoch-end work

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._wait += now - self._last_end
        self._step_before = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._total += now - self._last_end
            self._steps += trainer.global_step - self._step_before
        self._last_end = now
        if _is_logging_step(trainer) and self._total > 0:
            _log(
                trainer,
                {
                    "train/steps_per_sec": self._steps / self._total,
                    "train/data_wait_fraction": self._wait / self._total,
                },
            )
            self._wait = self._total = 0.0
            self._steps = 0

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last_end is not None:  # shift the reference so validation time counts as neither
            self._last_end += time.perf_counter() - self._val_start


class PeakMemoryMonitor(Callback):
    """Peak memory since the previous logging step (CUDA) or of the whole process so far (CPU peak RSS).

    On CUDA it logs ``torch.cuda.max_memory_allocated`` and resets the peak after each log, so spikes show up
    at the step where they happen; on CPU the kernel only keeps the lifetime peak (``ru_maxrss``).
    """

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not _is_logging_step(trainer):
            return
        device = pl_module.device
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) / 2**20
            torch.cuda.reset_peak_memory_stats(device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
        _log(trainer, {"train/peak_memory_mb": peak})


class GradNormMonitor(Callback):
    """L2 norm of the gradients of each top-level submodule (e.g. ``image_encoder``, ``text_encoder``).

    Runs in ``on_before_optimizer_step``: after every backward of the step, after DDP's all-reduce (and
    ``ddp_explicit``'s, which wraps the closure) and after AMP unscaling, i.e. the gradients the optimizer uses,
    before clipping.
    """

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        if not _is_logging_step(trainer):
            return
        metrics, everything = {}, []
        for name, child in pl_module.named_children():
            grads = [p.grad for p in child.parameters() if p.grad is not None]
            if grads:
                metrics[f"grad_norm/{name}"] = torch.nn.utils.get_total_norm(grads).item()
                everything += grads
        if everything:
            metrics["grad_norm/total"] = torch.nn.utils.get_total_norm(everything).item()
            _log(trainer, metrics)


class RetrievalGridLogger(Callback):
    """At each validation, an image grid: every image with its true caption and its top retrieved caption.

    The first ``num_batches`` validation batches are embedded once more with the module's ``forward`` (which
    returns normalized ``image_embeddings`` / ``text_embeddings``); their captions form the retrieval pool and
    the first ``num_images`` distinct images are shown, the retrieved caption in green when it belongs to the
    image, red otherwise. Written on rank 0 to TensorBoard as ``val/retrieval_grid``.

    Args:
        num_images: Images in the grid.
        num_batches: Validation batches whose captions are the retrieval pool.
        tile: Side of each image tile in pixels.
    """

    def __init__(self, num_images: int = 8, num_batches: int = 4, tile: int = 128) -> None:
        self.num_images, self.num_batches, self.tile = num_images, num_batches, tile
        self._rows: list[dict[str, torch.Tensor]] = []
        self._captions: list[str] = []
        self._tokenizer: Any = None

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._rows, self._captions = [], []

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero or batch_idx >= self.num_batches:
            return
        with torch.no_grad():
            embeddings = pl_module(batch)
        if self._tokenizer is None:
            self._tokenizer = _tokenizer_of(trainer)
        # decoded per batch: each batch is padded to its own longest caption, so ids cannot be concatenated
        self._captions += self._tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
        self._rows.append(
            {
                "image": batch["image"].detach().float().cpu(),
                "image_id": batch["image_id"].cpu(),
                "image_embeddings": embeddings["image_embeddings"].cpu(),
                "text_embeddings": embeddings["text_embeddings"].cpu(),
            }
        )

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._rows:
            return
        experiments = [lg.experiment for lg in trainer.loggers if hasattr(lg.experiment, "add_image")]
        if experiments:
            grid = self.render(trainer)
            for experiment in experiments:
                experiment.add_image("val/retrieval_grid", grid, trainer.global_step)
        self._rows, self._captions = [], []

    def render(self, trainer: Trainer) -> torch.Tensor:
        """The grid as a uint8 (3, H, W) tensor."""
        rows = {k: torch.cat([r[k] for r in self._rows]) for k in self._rows[0]}
        captions = self._captions
        shown = _first_rows_of_distinct(rows["image_id"], self.num_images)
        best = (rows["image_embeddings"][shown] @ rows["text_embeddings"].T).argmax(1)
        tiles = [
            self._tile(
                rows["image"][i], captions[i], captions[j], bool(rows["image_id"][j] == rows["image_id"][i])
            )
            for i, j in zip(shown.tolist(), best.tolist(), strict=True)
        ]
        canvas = Image.new("RGB", (self.tile * len(tiles), tiles[0].height), "white")
        for k, tile in enumerate(tiles):
            canvas.paste(tile, (k * self.tile, 0))
        return torch.from_numpy(np.asarray(canvas).copy()).permute(2, 0, 1)

    def _tile(self, image: torch.Tensor, truth: str, retrieved: str, correct: bool) -> Image.Image:
        # Min-max per image undoes any normalization well enough to look at, without knowing mean/std.
        low, high = image.min(), image.max()
        pixels = ((image - low) / (high - low).clamp_min(1e-6) * 255).round().to(torch.uint8)
        pixels = F.interpolate(pixels[None].float(), size=(self.tile, self.tile), mode="nearest")[0].to(
            torch.uint8
        )
        width = max(self.tile // 7, 10)
        true_lines = textwrap.wrap("true: " + truth, width)[:4]
        top_lines = textwrap.wrap("top: " + retrieved, width)[:4]
        tile = Image.new("RGB", (self.tile, self.tile + 12 * 8 + 4), "white")
        tile.paste(Image.fromarray(pixels.permute(1, 2, 0).numpy()), (0, 0))
        draw = ImageDraw.Draw(tile)
        draw.multiline_text((2, self.tile + 2), "\n".join(true_lines), fill="black", spacing=1)
        draw.multiline_text(
            (2, self.tile + 2 + 12 * 4), "\n".join(top_lines), fill="green" if correct else "red", spacing=1
        )
        return tile


def _first_rows_of_distinct(image_ids: torch.Tensor, count: int) -> torch.Tensor:
    """Row indices of the first occurrence of up to ``count`` distinct image ids."""
    seen: dict[int, int] = {}
    for row, image_id in enumerate(image_ids.tolist()):
        if image_id not in seen:
            seen[image_id] = row
            if len(seen) == count:
                break
    return torch.tensor(list(seen.values()), dtype=torch.long)


def _tokenizer_of(trainer: Trainer) -> Any:
    """The tokenizer the data was encoded with (the datamodule's, else the text encoder's)."""
    name = (
        getattr(trainer.datamodule, "hparams", {}).get("tokenizer")
        or trainer.lightning_module.hparams["text"]["name"]
    )
    return load_tokenizer(name)
