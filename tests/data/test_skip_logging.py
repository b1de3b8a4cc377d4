"""Skipped records reach TensorBoard: ``data/skipped`` scalar and a summary with the first reasons."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mm_lightning.callbacks import BadRecordLogger
from mm_lightning.data import MultimodalDataModule
from tests.data.helpers import TOKENIZER, save_image, write_jsonl


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.w * batch["image"].mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


@pytest.mark.timeout(120)
def test_skips_are_logged_to_tensorboard(tmp_path: Path) -> None:
    for i in range(4):
        save_image(tmp_path / "images" / f"{i}.jpg", seed=i)
    rows: list[dict | str] = [{"image": f"images/{i}.jpg", "text": f"a red circle {i}"} for i in range(4)]
    rows.insert(1, "{not json")  # dropped while indexing
    rows.insert(3, {"image": "images/missing.jpg", "text": "gone"})  # replaced at load time, every visit
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dm = MultimodalDataModule(
        train_file=str(train),
        tokenizer=TOKENIZER,
        image_size=16,
        batch_size=5,
        on_bad_record="skip",
        caption_sampling="all",
    )
    logger = TensorBoardLogger(tmp_path / "logs", name="", version="")
    callback = BadRecordLogger()
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=logger,
        callbacks=[callback],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.warns(UserWarning, match="skipping bad records"):
        trainer.fit(_Tiny(), datamodule=dm)

    # 1 bad line at indexing + the missing file once per epoch (5 items, one batch of 5 per epoch)
    assert callback.total(trainer) == 3
    assert any("train.jsonl:2" in r and "malformed JSON" in r for r in callback.reasons)
    assert any("train.jsonl:4" in r and "missing.jpg" in r for r in callback.reasons)
    events = EventAccumulator(str(tmp_path / "logs")).Reload()
    values = [e.value for e in events.Scalars("data/skipped")]
    assert values[-1] == 3 and values[0] == 2  # cumulative
    summary = events.Tensors("data/skipped_summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "3 bad records skipped" in summary and "missing.jpg" in summary
