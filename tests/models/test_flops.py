"""FLOPs per batch, measured once with torch's FlopCounterMode, feed Lightning's ThroughputMonitor."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from mm_lightning.models.flops import FlopsMeter
from tests.models.helpers import pair_loader, tiny_module

BATCH, IN, OUT = 8, 32, 16


class TinyLinear(LightningModule):
    """One linear layer, counted the way MultimodalModule counts: forward in the step, backward in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(IN, OUT)
        self.flops = FlopsMeter()

    def training_step(self, batch, batch_idx):
        with self.flops.count("train"):
            return self.layer(batch[0]).square().mean()

    def backward(self, loss, *args, **kwargs) -> None:
        with self.flops.count("train"):
            super().backward(loss, *args, **kwargs)
        self.flops.finish("train")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_linear_model_flops_match_the_matmul_count(tmp_path: Path) -> None:
    model = TinyLinear()
    loader = DataLoader(TensorDataset(torch.randn(4 * BATCH, IN)), batch_size=BATCH)
    Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=tmp_path).fit(model, loader)  # fmt: skip
    # forward x @ W.T: 2*B*IN*OUT; backward dL/dW: 2*B*IN*OUT (the input needs no gradient)
    assert model.flops.totals["train"] == pytest.approx(4 * BATCH * IN * OUT, rel=0.01)


def test_module_flops_reach_the_throughput_monitor_without_warning(tmp_path: Path) -> None:
    model = tiny_module()
    assert model.flops_per_batch is None  # nothing measured before the first batch
    monitor = ThroughputMonitor(batch_size_fn=lambda batch: batch["image"].shape[0], window_size=2)
    trainer = Trainer(
        accelerator="cpu", max_steps=4, logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=1, val_check_interval=4, default_root_dir=tmp_path,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, pair_loader(), pair_loader(batch_size=16))
    assert not [w for w in caught if "flops_per_batch" in str(w.message)]
    train_flops, eval_flops = model.flops.totals["train"], model.flops.totals["eval"]
    model.train()
    assert model.flops_per_batch == train_flops > eval_flops > 0
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        columns = next(csv.reader(f))
    assert any("flops_per_sec" in c for c in columns), columns
