"""BadRecordLogger: makes ``on_bad_record="skip"`` visible (``data/skipped`` scalar + first reasons).

Workers are separate processes, so skips travel inside the batch (``num_skipped`` per row, plus
``skip_reasons``); this callback adds them up in the main process.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override


class BadRecordLogger(pl.Callback):
    """Logs ``data/skipped`` (cumulative, all ranks, including lines dropped while indexing) and keeps the
    first reasons; warns on the first skip and writes a text summary to TensorBoard at the end of fit.

    Args:
        keep: how many skip reasons to keep for the summary.
    """

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.local_skipped = 0
        self.reasons: list[str] = []
        self._warned = False
        self._index_skipped = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        skips = getattr(trainer.datamodule, "index_skips", None)
        self._index_skipped = skips.count if skips is not None else 0
        if skips is not None:
            self._add_reasons(skips.first)

    def _add_reasons(self, reasons: list[str]) -> None:
        if reasons and not self._warned:
            rank_zero_warn(f"skipping bad records (on_bad_record='skip'); first: {reasons[0]}")
            self._warned = True
        for reason in reasons:
            if len(self.reasons) < self.keep and reason not in self.reasons:
                self.reasons.append(reason)

    def _count(self, batch: Any) -> None:
        if isinstance(batch, dict) and "num_skipped" in batch:
            self.local_skipped += int(batch["num_skipped"].sum())
            self._add_reasons(batch.get("skip_reasons", []))

    def total(self, trainer: pl.Trainer) -> int:
        """Skips on all ranks so far (a collective: call it on every rank)."""
        local = torch.tensor(self.local_skipped, dtype=torch.long, device=trainer.strategy.root_device)
        return int(trainer.strategy.reduce(local, reduce_op="sum")) + self._index_skipped

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log("data/skipped", float(self.total(trainer)), on_step=True, on_epoch=False)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._count(batch)
        # Every step (the logger still writes every log_every_n_steps): one scalar all-reduce, and the
        # Lightning logger's cadence stays the single source of truth.
        self._log(trainer, pl_module)

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
        self._count(batch)

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
        self._count(batch)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        total = self.total(trainer)
        if not total:
            return
        summary = f"{total} bad records skipped. First reasons:\n" + "\n".join(f"- {r}" for r in self.reasons)
        rank_zero_warn(summary)
        experiment = getattr(trainer.logger, "experiment", None)
        if trainer.is_global_zero and hasattr(experiment, "add_text"):
            experiment.add_text("data/skipped_summary", summary.replace("\n", "  \n"), trainer.global_step)
