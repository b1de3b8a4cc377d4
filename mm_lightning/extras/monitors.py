"""Monitors that show why a run is slow or unstable (scalars to every logger; the grid to those that take images).

* :class:`StepTimeMonitor` - ``train/data_wait_fraction`` (steps per second come from the
  project's ``ThroughputLogger``, a default callback);
* :class:`PeakMemoryMonitor` - ``train/peak_memory_mb`` (CUDA allocator peak, or process peak RSS on CPU);
* :class:`GradNormMonitor` - ``grad_norm/<submodule>`` and ``grad_norm/total`` after the DDP reduction (the
  one place gradient norms are logged);
* :class:`RetrievalGridLogger` - ``val/retrieval_grid``: validation images with their true and top retrieved
  caption, from the embeddings ``validation_step`` returns.

All of them do their work on logging steps only (``trainer.log_every_n_steps``) or once per validation. They are
opt-in: add them to ``trainer.callbacks`` (configs/callbacks/monitored.yaml, base.yaml's, adds all of them, with ``FlopCounter``);
docs/training.md lists every tag, what it costs and what to do when it looks wrong.
"""

from __future__ import annotations

import resource
import textwrap
import time
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from PIL import Image, ImageDraw
from torch.optim import Optimizer
from torchvision.transforms.v2.functional import InterpolationMode, resize
from torchvision.utils import make_grid
from typing_extensions import override

from mm_lightning.data.collate import load_tokenizer
from mm_lightning.extras.nan_guard import step_grad_norms
from mm_lightning.logger_media import log_image, takes_images


def _log(trainer: Trainer, metrics: dict[str, float]) -> None:
    # Straight to the loggers (rank 0 only inside them): these values are measured on this process and
    # computed only on logging steps, which `self.log`'s per-batch bookkeeping would not line up with.
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def _is_logging_step(trainer: Trainer) -> bool:
    return trainer.global_step % max(trainer.log_every_n_steps, 1) == 0


class StepTimeMonitor(Callback):
    """The fraction of training wall time spent waiting for the next batch (``train/data_wait_fraction``).

    "Waiting for data" is the host time from the end of one training batch to the start of the next
    (Lightning's fetch of the next batch and its host-to-device copy); validation in between is excluded. The
    value is the average over the batches since the previous logging step, measured on each rank and logged by
    rank 0's loggers. Costs two ``time.perf_counter`` calls per batch.
    """

    def __init__(self) -> None:
        self._last_end: float | None = None
        self._wait = self._total = 0.0

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

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._last_end is not None:
            self._total += now - self._last_end
        self._last_end = now
        if _is_logging_step(trainer) and self._total > 0:
            _log(trainer, {"train/data_wait_fraction": self._wait / self._total})
            self._wait = self._total = 0.0

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
    """L2 norm of the gradients of each top-level submodule (e.g. ``image_encoder``, ``text_encoder``) and in total.

    Runs in ``on_before_optimizer_step``: after every backward of the step, after DDP's all-reduce (and
    ``ddp_explicit``'s, which wraps the closure) and after AMP unscaling, i.e. the gradients the optimizer uses,
    before clipping. The norms come from :func:`~mm_lightning.extras.nan_guard.step_grad_norms`, shared with the NaN
    guard, and are computed and copied to the host on logging steps only (one sync per logging step).
    """

    @override
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None:
        if not _is_logging_step(trainer):
            return
        norms = step_grad_norms(pl_module, trainer.global_step)
        children = norms.children
        if not children:
            return
        values = torch.stack([*children.values(), norms.total]).float().tolist()
        names = [f"grad_norm/{name}" for name in children] + ["grad_norm/total"]
        _log(trainer, dict(zip(names, values, strict=True)))


class RetrievalGridLogger(Callback):
    """At each validation, an image grid: every image with its true caption and its top retrieved caption.

    Uses what ``validation_step`` returns: a dict with L2-normalized ``image_embeddings`` and ``text_embeddings``,
    one row per row of the batch (no second forward pass). The first ``num_batches`` validation batches' captions
    form the retrieval pool and the first ``num_images`` distinct images are shown, the retrieved caption in green
    when it belongs to the image, red otherwise. Written on rank 0 as ``val/retrieval_grid``
    to the loggers that take images (TensorBoard, MLflow, W&B).
    Costs a CPU copy of ``num_batches`` batches and one tokenizer decode per validation.

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
        self._warned = False

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
        if batch["image"].dim() != 4:  # cached image features (LockedImageFeatures): no pictures to draw
            return
        if not isinstance(outputs, dict) or not {"image_embeddings", "text_embeddings"} <= outputs.keys():
            if not self._warned:
                rank_zero_warn(
                    "RetrievalGridLogger: validation_step returns no dict with 'image_embeddings' and"
                    " 'text_embeddings'; no retrieval grid is logged (leave RetrievalGridLogger out of trainer.callbacks)."
                )
                self._warned = True
            return
        if self._tokenizer is None:
            self._tokenizer = _tokenizer_of(trainer)
        # decoded per batch: each batch is padded to its own longest caption, so ids cannot be concatenated
        self._captions += self._tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
        self._rows.append(
            {
                "image": batch["image"].detach().float().cpu(),
                "image_id": batch["image_id"].cpu(),
                "image_embeddings": outputs["image_embeddings"].detach().float().cpu(),
                "text_embeddings": outputs["text_embeddings"].detach().float().cpu(),
            }
        )

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._rows or self.num_images < 1:
            return
        if takes_images(trainer):
            log_image(trainer, "val/retrieval_grid", self.render(trainer))
        self._rows, self._captions = [], []

    def render(self, trainer: Trainer | None) -> torch.Tensor:
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
        return make_grid(tiles, nrow=len(tiles), padding=0)

    def _tile(self, image: torch.Tensor, truth: str, retrieved: str, correct: bool) -> torch.Tensor:
        # Min-max per image undoes any normalization well enough to look at, without knowing mean/std.
        low, high = image.min(), image.max()
        pixels = ((image - low) / (high - low).clamp_min(1e-6) * 255).round().to(torch.uint8)
        pixels = resize(pixels, [self.tile, self.tile], interpolation=InterpolationMode.NEAREST)
        # torchvision draws no free text: the two captions go on a PIL canvas under the image
        width = max(self.tile // 7, 10)
        true_lines = textwrap.wrap("true: " + truth, width)[:4]
        top_lines = textwrap.wrap("top: " + retrieved, width)[:4]
        text = Image.new("RGB", (self.tile, 12 * 8 + 4), "white")
        draw = ImageDraw.Draw(text)
        draw.multiline_text((2, 2), "\n".join(true_lines), fill="black", spacing=1)
        draw.multiline_text(
            (2, 2 + 12 * 4), "\n".join(top_lines), fill="green" if correct else "red", spacing=1
        )
        caption = torch.from_numpy(np.asarray(text).copy()).permute(2, 0, 1)
        return torch.cat([pixels, caption], dim=1)


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
        or trainer.lightning_module.data_config["text"]["tokenizer"]
    )
    return load_tokenizer(name)
