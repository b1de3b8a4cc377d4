"""FLOPs of one batch, measured once with torch's ``FlopCounterMode``, for the ``ThroughputLogger``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override


class FlopCounter(Callback):
    """Counts the FLOPs of the first training batch (forward + backward) and the first evaluation batch.

    ``ThroughputLogger`` reads ``pl_module.flops_per_batch`` to log FLOPs/s (and MFU on GPUs with a known peak);
    this callback sets it to the measured value of the stage that runs. The count is free after the first batch.
    A training batch that runs no backward (a step the NaN guard skipped) is not counted; the next one is.

    Attributes:
        totals: the measured FLOPs per batch, ``{"train": ..., "eval": ...}``.
    """

    def __init__(self) -> None:
        self.totals: dict[str, int] = {}
        self._counter: FlopCounterMode | None = None
        self._kind: str | None = None

    def _start(self, kind: str, pl_module: LightningModule) -> None:
        pl_module.flops_per_batch = self.totals.get(kind)
        if kind in self.totals or self._counter is not None:
            return
        self._counter, self._kind = FlopCounterMode(display=False), kind
        self._counter.__enter__()

    def _stop(self, pl_module: LightningModule, keep: bool = True) -> None:
        if self._counter is None:
            return
        counter, kind = self._counter, self._kind
        self._counter = self._kind = None
        counter.__exit__(None, None, None)
        if keep and kind is not None:
            self.totals[kind] = counter.get_total_flops()
            pl_module.flops_per_batch = self.totals[kind]

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start("train", pl_module)

    @override
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._kind == "train":
            self._stop(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop(pl_module, keep=False)  # no backward ran: an incomplete count

    @override
    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._start("eval", pl_module)

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
        self._stop(pl_module)

    # a test batch is counted like a validation batch
    on_test_batch_start = on_validation_batch_start
    on_test_batch_end = on_validation_batch_end

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop(pl_module, keep=False)  # leave no counting mode pushed behind
