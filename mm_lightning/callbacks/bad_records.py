"""BadRecordLogger: makes ``on_bad_record="skip"`` visible in every stage (``data/skipped`` + a summary)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from mm_lightning.data.skips import SkipLog
from mm_lightning.logging_steps import loggers_write_this_step


class BadRecordLogger(pl.Callback):
    """Logs ``data/skipped`` (cumulative over ranks, indexing drops included), warns on the first skip, and
    at each stage's end writes a summary as ``data/skipped_summary`` (to loggers that take text). The data
    module counts and prints skips itself, with or without this callback.

    Args:
        keep: how many skip reasons the summary keeps."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.local = SkipLog(keep)
        self.indexed = SkipLog(keep)  # dropped while indexing (the same on every rank)
        self._warned = False
        self._steps_before = 0  # optimizer steps done when the current training batch started

    @property
    def reasons(self) -> list[str]:
        """The first skip reasons (this rank's, lines dropped while indexing first)."""
        merged = SkipLog(self.keep)
        merged.update(self.indexed)
        merged.update(self.local)
        return merged.first

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        skips = getattr(trainer.datamodule, "index_skips", None)
        self.indexed = SkipLog(self.keep)
        if skips is not None:
            self.indexed.update(skips)
            self._warn_first(skips.first)

    def _warn_first(self, reasons: list[str]) -> None:
        if reasons and not self._warned:
            rank_zero_warn(f"skipping bad records (on_bad_record='skip'); first: {reasons[0]}")
            self._warned = True

    def _count(self, batch: Any, split: str) -> None:
        before = len(self.local.first)
        self.local.add_batch(batch, split)
        self._warn_first(self.local.first[before:])

    def end_pass(self, trainer: pl.Trainer, split: str) -> None:
        """Count the records met in this pass of ``split`` once over all ranks (a collective: call on every rank)."""
        if not (trainer.world_size > 1 and torch.distributed.is_initialized()):
            self.local.end_pass(split)  # each rank keeps its own count; `gathered` sums them
            return
        every_rank: list = [None] * trainer.world_size  # once a pass: the records a rank met (few)
        torch.distributed.all_gather_object(every_rank, self.local.pending.get(split, {}))
        # rank 0 keeps the joined count, the others none, so the cross-rank sum of `gathered` stays right
        self.local.end_pass(split, every_rank if trainer.is_global_zero else [])

    def gathered(self, trainer: pl.Trainer) -> SkipLog:
        """All ranks' skips so far plus the indexing drops (a collective: call it on every rank). Within a
        pass, a record met on two ranks counts twice until the pass ends."""
        table = self.local.to_tensor(trainer.strategy.root_device)
        total = trainer.strategy.reduce(table, reduce_op="sum").cpu()
        log = SkipLog.from_tensor(total, [], self.keep)
        log.update(self.indexed)
        log.first = self.reasons
        return log

    def total(self, trainer: pl.Trainer) -> int:
        """Skips on all ranks so far (a collective: call it on every rank)."""
        return self.gathered(trainer).count

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._steps_before = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count(batch, "train")
        # Only on the steps the loggers write (the same on every rank, so the all-reduce stays collective).
        if loggers_write_this_step(trainer, self._steps_before):
            total = float(self.total(trainer))
            pl_module.log("data/skipped", total, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:  # the sanity check re-reads the first val batches; count them once
            self._count(batch, "val")

    @override
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._count(batch, "test")

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._count(batch, "predict")

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end_pass(trainer, "train")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.end_pass(trainer, "val")
        if trainer.state.fn == "validate":  # in fit, the training steps log it
            pl_module.log("data/skipped", float(self.total(trainer)), batch_size=1)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end_pass(trainer, "test")
        pl_module.log("data/skipped", float(self.total(trainer)), batch_size=1)

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end_pass(trainer, "predict")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._summarize(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._summarize(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._summarize(trainer)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log = self._summarize(trainer)
        for logger in trainer.loggers:  # no LightningModule.log in predict; loggers write on rank 0
            logger.log_metrics({"data/skipped": float(log.count)}, step=trainer.global_step)

    def _summarize(self, trainer: pl.Trainer) -> SkipLog:
        self.end_pass(trainer, "train")  # a fit stopped within an epoch
        log = self.gathered(trainer)
        if not log.count:
            return log
        summary = log.summary()
        if trainer.is_global_zero:
            from mm_lightning.logger_media import log_text  # loaded only when a run skipped records

            log_text(trainer, "data/skipped_summary", summary)
        return log
