"""Plain progress lines when a run's output goes to a file (nohup, SLURM), where a progress bar is unreadable."""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from mm_lightning.callbacks.run_summary import metrics_line


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


class ProgressLines(Callback):
    """Plain progress lines for output that is not a terminal (rank 0); silent on a terminal (it has the bar).

    Args:
        every_s: Seconds between two training progress lines.
        force: Print them on a terminal too."""

    def __init__(self, every_s: float = 30.0, force: bool = False) -> None:
        self.every_s = every_s
        self.force = force
        self._active = False
        self._start_time = self._last_time = 0.0
        self._start_step = 0

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._active = trainer.is_global_zero and (self.force or not sys.stdout.isatty())

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start_time = self._last_time = time.monotonic()
        self._start_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if not self._active or now - self._last_time < self.every_s:
            return
        self._last_time = now
        step, total = trainer.global_step, trainer.estimated_stepping_batches
        rate = (step - self._start_step) / max(now - self._start_time, 1e-9)
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        line = f"epoch {trainer.current_epoch + 1}{epochs} step {step}"
        if total != float("inf"):
            line += f"/{int(total)} ({100 * step / total:.0f}%)"
        loss = trainer.callback_metrics.get("train/loss")
        if loss is not None:
            line += f"  train/loss {float(loss):.4f}"
        line += f"  {rate:.2f} steps/s  elapsed {_duration(now - self._start_time)}"
        if total != float("inf") and rate > 0:
            line += f"  left ~{_duration((total - step) / rate)}"
        print(line, flush=True)

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active and trainer.state.fn == "fit" and not trainer.sanity_checking:
            metrics = metrics_line(trainer, "val/")
            print(
                f"epoch {trainer.current_epoch + 1} step {trainer.global_step} validated: {metrics}",
                flush=True,
            )
