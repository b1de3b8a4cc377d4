"""FLOPs per batch, measured once with torch's FlopCounterMode by a callback, feed the ThroughputLogger."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from mm_lightning.callbacks import ThroughputLogger
from mm_lightning.extras import FlopCounter
from tests.models.helpers import pair_loader, tiny_module

BATCH, IN, OUT = 8, 32, 16


class TinyLinear(LightningModule):
    """One linear layer; with ``skip_first`` the first step returns no loss (Lightning runs no backward for it)."""

    def __init__(self, skip_first: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(IN, OUT)
        self.skip_first = skip_first

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).square().mean()
        return None if self.skip_first and batch_idx == 0 else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: LightningModule, counter: FlopCounter, tmp_path: Path, *callbacks) -> None:
    loader = DataLoader(TensorDataset(torch.randn(4 * BATCH, IN)), batch_size=BATCH)
    Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path, callbacks=[*callbacks, counter]).fit(model, loader)  # fmt: skip


def test_linear_model_flops_match_the_matmul_count(tmp_path: Path) -> None:
    counter = FlopCounter()
    _fit(TinyLinear(), counter, tmp_path)
    # forward x @ W.T: 2*B*IN*OUT; backward dL/dW: 2*B*IN*OUT (the input needs no gradient)
    assert counter.totals["train"] == pytest.approx(4 * BATCH * IN * OUT, rel=0.01)


def test_a_step_without_backward_is_not_counted(tmp_path: Path) -> None:
    counter = FlopCounter()
    _fit(TinyLinear(skip_first=True), counter, tmp_path)
    # the second batch's forward and backward; a forward-only count (the first batch's) would be half of it
    assert counter.totals["train"] == pytest.approx(4 * BATCH * IN * OUT, rel=0.01)


def test_module_flops_reach_the_throughput_logger_without_warning(tmp_path: Path) -> None:
    model = tiny_module()
    assert model.flops_per_batch is None  # nothing measured before the first batch
    counter = FlopCounter()
    monitor = ThroughputLogger(batch_size_fn=lambda batch: batch["image"].shape[0], window_size=2)
    trainer = Trainer(
        accelerator="cpu", max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[counter, monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1, val_check_interval=4, default_root_dir=tmp_path,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, pair_loader(), pair_loader(batch_size=16))
    assert not [w for w in caught if "flops_per_batch" in str(w.message)]
    train_flops, eval_flops = counter.totals["train"], counter.totals["eval"]
    assert train_flops > eval_flops > 0
    assert model.flops_per_batch == eval_flops  # the last stage that ran
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        columns = next(csv.reader(f))
    assert any("flops_per_sec" in c for c in columns), columns
