"""The throughput logger counts every step's samples but waits for the device only on the steps that log, and
logs under Lightning's ThroughputMonitor names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger

from mm_lightning.callbacks import ThroughputLogger
from tests.models.helpers import pair_loader, tiny_module


class MemoryLogger(Logger):
    name, version = "memory", 0

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_rates_are_logged_on_logging_steps_with_one_device_sync_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[int] = []  # the steps at which the monitor waits for the device (Lightning's: every step)
    logger, monitor = MemoryLogger(), ThroughputLogger(batch_size_fn=lambda batch: len(batch["image"]))
    monkeypatch.setattr(monitor, "wait_for_device", lambda trainer: syncs.append(trainer.global_step))
    trainer = Trainer(
        accelerator="cpu", max_steps=9, logger=logger, log_every_n_steps=3, callbacks=[monitor],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(tiny_module(), pair_loader(batch_size=8))
    assert syncs == [3, 6, 9]  # after steps 3, 6 and 9 of 9: the logging steps only
    logged = [(step, m) for step, m in logger.records if "train/samples" in m]
    loss_steps = [step for step, m in logger.records if "train/loss" in m]
    assert [step for step, _ in logged] == loss_steps == [2, 5, 8]  # written beside the batch's loss
    assert [m["train/samples"] for _, m in logged] == [
        24,
        48,
        72,
    ]  # every step's samples, counted on the host
    assert "train/device/samples_per_sec" not in logged[0][1]  # a rate needs two logging steps
    for _, metrics in logged[1:]:
        assert metrics["train/device/samples_per_sec"] == pytest.approx(
            8 * metrics["train/device/batches_per_sec"]
        )
        assert metrics["train/device/samples_per_sec"] > 0


def test_a_window_of_one_logging_step_is_refused() -> None:
    with pytest.raises(ValueError, match="window_size must be >= 2"):
        ThroughputLogger(batch_size_fn=len, window_size=1)


def test_accumulated_micro_batches_are_counted_and_the_clock_read_once_per_logging_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[int] = []
    logger, monitor = MemoryLogger(), ThroughputLogger(batch_size_fn=lambda batch: len(batch["image"]))
    monkeypatch.setattr(monitor, "wait_for_device", lambda trainer: syncs.append(trainer.global_step))
    trainer = Trainer(
        accelerator="cpu", max_steps=4, logger=logger, log_every_n_steps=2, callbacks=[monitor],
        accumulate_grad_batches=2, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(tiny_module(), pair_loader(batch_size=8))
    assert syncs == [2, 4]  # once per logging step, not once per micro-batch
    assert [m["train/samples"] for _, m in logger.records if "train/samples" in m] == [32, 64]
