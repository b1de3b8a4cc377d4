"""Skipped records reach the loggers: ``data/skipped`` scalar and a summary with the first reasons (TensorBoard,
CSV without the text, MLflow's local store)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
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


def fit_with_skips(tmp_path: Path, logger: Any) -> tuple[BadRecordLogger, pl.Trainer]:
    """Two epochs over 4 good records, a malformed line and a missing image (``on_bad_record="skip"``)."""
    for i in range(4):
        save_image(tmp_path / "images" / f"{i}.jpg", seed=i)
    rows: list[dict | str] = [{"image": f"images/{i}.jpg", "text": f"a red circle {i}"} for i in range(4)]
    rows.insert(1, "{not json")  # dropped while indexing
    rows.insert(3, {"image": "images/missing.jpg", "text": "gone"})  # replaced at load time, every visit
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    dm = MultimodalDataModule(
        train_file=str(train),
        tokenizer=TOKENIZER,
        batch_size=5,
        on_bad_record="skip",
        images={"size": 16},
        loader={"caption_sampling": "all"},
    )
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
    return callback, trainer


@pytest.mark.timeout(120)
def test_skips_are_logged_to_tensorboard(tmp_path: Path) -> None:
    callback, trainer = fit_with_skips(tmp_path, TensorBoardLogger(tmp_path / "logs", name="", version=""))

    # 1 bad line at indexing + the missing file once per epoch (5 items, one batch of 5 per epoch)
    assert callback.total(trainer) == 3
    assert any("train.jsonl:2" in r and "malformed JSON" in r for r in callback.reasons)
    assert any("train.jsonl:4" in r and "missing.jpg" in r for r in callback.reasons)
    events = EventAccumulator(str(tmp_path / "logs")).Reload()
    values = [e.value for e in events.Scalars("data/skipped")]
    assert values[-1] == 3 and values[0] == 2  # cumulative
    summary = events.Tensors("data/skipped_summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "3 bad records skipped" in summary and "missing.jpg" in summary


@pytest.mark.timeout(120)
def test_skips_reach_csv_and_mlflow(tmp_path: Path) -> None:
    from mlflow import MlflowClient  # seconds to import: only here

    store = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow_logger = MLFlowLogger("skips", tracking_uri=store, artifact_location=str(tmp_path / "artifacts"))
    csv_logger = CSVLogger(tmp_path / "logs", name="csv")
    fit_with_skips(tmp_path, [csv_logger, mlflow_logger])

    with open(Path(csv_logger.log_dir) / "metrics.csv") as f:
        skipped = [float(row["data/skipped"]) for row in csv.DictReader(f) if row.get("data/skipped")]
    assert skipped[0] == 2 and skipped[-1] == 3
    client = MlflowClient(store)
    run_id = mlflow_logger.run_id
    assert [m.value for m in client.get_metric_history(run_id, "data/skipped")][-1] == 3
    summaries = client.list_artifacts(run_id, "data/skipped_summary")
    assert len(summaries) == 1 and summaries[0].path.endswith(".md")
    summary = Path(
        client.download_artifacts(run_id, summaries[0].path, str(tmp_path / "download"))
    ).read_text()
    assert "3 bad records skipped" in summary and "missing.jpg" in summary
